"""Tokenizing input files into a shard folder (``balanced-loader build-shards``)."""

from __future__ import annotations

import os
from typing import Any

from balanced_loader.data.index import META_FILE, read_index_json
from balanced_loader.data.shards import ShardWriter
from balanced_loader.data.sources import jsonl_text
from balanced_loader.data.tokenizers import get_tokenizer, token_dtype


def expand_inputs(specs: list[str]) -> list[str]:
    """Files from paths, folders (every file under them but hidden ones and ``__pycache__``) and globs,
    in order, without repeats."""
    import glob

    out: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = []
            for root, dirs, files in os.walk(spec):
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
                found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
            found.sort()
        elif os.path.isfile(spec):
            found = [spec]
        elif any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                raise ValueError(f"the pattern {spec} matches no files")
        else:
            raise ValueError(f"input {spec} does not exist")
        out.extend(found)
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def _docs_of(path: str, text_field: str) -> Any:
    """The docs of one input file: each non-blank line's ``text_field`` for ``.jsonl``, else the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if not path.endswith(".jsonl"):
        yield data
        return
    for lineno, line in enumerate(data.splitlines(), 1):
        if line.strip():
            yield jsonl_text(line, text_field, f"{path} line {lineno}").encode("utf-8")


def build_from_files(files: list[str], out_dir: str, *, tokenizer: Any = None, text_field: str = "text",
                     max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                     progress: bool = False) -> dict[str, Any]:
    """Tokenize files into a shard folder (one doc per file, or per line of a ``.jsonl``); returns its metadata."""
    tok = get_tokenizer(tokenizer)
    if not files:
        raise ValueError("no input files to build shards from")
    it: Any = files
    bar = None
    if progress:
        from tqdm import tqdm

        it = bar = tqdm(files, desc="building shards", unit="file")
    with ShardWriter(out_dir, dtype=token_dtype(tok.vocab_size), tokenizer=tok.identity(),
                     max_shard_bytes=max_shard_bytes, max_docs_per_shard=max_docs_per_shard) as w:
        for path in it:
            for data in _docs_of(path, text_field):
                w.add(tok.encode(data))
            if bar is not None:
                bar.set_postfix(docs=w.num_docs, tokens=w.num_tokens, refresh=False)
    return read_index_json(os.path.join(out_dir, META_FILE))
