"""Tokenizing input files into a shard folder (``balanced-loader build-shards``).

Docs: one per file, or one per non-blank line of a ``.jsonl`` file, in input order. The parent
process reads the docs in order and cuts them into chunks; ``workers`` processes tokenize the
chunks (a Hugging Face tokenizer with one batch call per chunk) and the parent writes the results
in chunk order, so the folder is byte-identical whatever the number of workers. At most
``2 * workers + 1`` chunks are in flight, so memory stays bounded for any corpus size.

Parts (``part=(K, N)``, ``--part K/N``) split one build over machines with no coordination.
The rule: the input files, in order, form one byte stream of ``B`` bytes; part ``K`` owns the
byte range ``[K*B//N, (K+1)*B//N)`` (the last part runs to the end), and a doc belongs to the
part whose range holds its first byte (a ``.jsonl`` line's first byte, a whole file's first byte).
So each machine reads only its range (a big ``.jsonl`` is entered at its range with one seek),
the parts are contiguous runs of the whole build's doc stream, and opened together in part order
(``open_source([dir0, dir1, ...])``) they hold exactly the docs of one whole build, in its order.
A part whose range starts no doc (more parts than docs) is an empty folder with only
``shards.json``; readers of parts count it as 0 docs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.data.index import META_FILE, read_index_json
from balanced_loader.data.shards import ShardWriter
from balanced_loader.data.sources import jsonl_text
from balanced_loader.data.tokenizers import encode_many, get_tokenizer, token_dtype

CHUNK_DOCS = 512  # docs per chunk sent to a worker ...
CHUNK_BYTES = 4 << 20  # ... or fewer when their input bytes pass this (a bigger doc is a chunk alone)


def expand_inputs(specs: list[str]) -> list[str]:
    """Files from paths, folders (every file under them but hidden ones and ``__pycache__``) and globs,
    in order, without repeats."""
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


# ---------------------------------------------------------------------------------------------
# The input set and its parts
# ---------------------------------------------------------------------------------------------


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``; one ``ValueError`` otherwise."""
    k, sep, n = str(text).partition("/")
    try:
        kk, nn = int(k, 10), int(n, 10)
    except ValueError:
        kk = nn = -1
    if not sep or nn < 1 or not 0 <= kk < nn or nn > 1 << 20:
        raise ValueError(f"--part must be K/N with 0 <= K < N (e.g. 0/4 for the first of 4 machines), got {text!r}")
    return kk, nn


def file_sizes(files: list[str]) -> list[int]:
    sizes = []
    for path in files:
        try:
            sizes.append(os.path.getsize(path))
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return sizes


def input_identity(files: list[str], sizes: list[int], text_field: str) -> dict[str, Any]:
    """What identifies the input set of a build: file names relative to their common folder, sizes and the
    text field, hashed (so parts built on machines that mount the data at different roots still agree)."""
    absolute = [os.path.abspath(f) for f in files]
    root = os.path.dirname(absolute[0]) if len(absolute) == 1 else os.path.commonpath(absolute)
    names = [os.path.relpath(f, root).replace(os.sep, "/") for f in absolute]
    blob = json.dumps({"files": list(zip(names, sizes, strict=True)), "text_field": text_field}, sort_keys=True)
    return {"files": len(files), "bytes": int(sum(sizes)), "sha256": hashlib.sha256(blob.encode()).hexdigest()}


def part_range(total_bytes: int, k: int, n: int) -> tuple[int, int]:
    """Input-stream bytes ``[lo, hi)`` whose docs part ``k`` of ``n`` owns (``hi`` of the last part: no limit)."""
    lo = k * total_bytes // n
    hi = (k + 1) * total_bytes // n if k < n - 1 else sys.maxsize
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class RawDoc:
    """One doc as read: its bytes (a ``.jsonl`` line or a whole file) and where it came from, for errors."""

    data: bytes
    jsonl: bool
    where: str


def read_docs(files: list[str], sizes: list[int], lo: int = 0, hi: int = sys.maxsize) -> Iterator[RawDoc]:
    """The docs whose first byte lies in ``[lo, hi)`` of the input stream, in order; reads only those bytes
    (plus the end of the line that crosses ``lo``)."""
    start = 0  # where this file starts in the input stream
    for path, size in zip(files, sizes, strict=True):
        first = start
        start += size
        if not path.endswith(".jsonl"):
            if lo <= first < hi:
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError as e:
                    raise ValueError(f"cannot read {path}: {e.strerror}") from None
                yield RawDoc(data=data, jsonl=False, where=path)
            continue
        if first >= hi or start <= lo:
            continue  # no line of this file starts inside the range
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the with below)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        with f:
            pos = max(0, lo - first)
            lineno = 1 if pos == 0 else None  # line numbers are known only when the file is read from its start
            if pos:
                f.seek(pos - 1)
                pos += len(f.readline()) - 1  # skip the rest of the line that started before the range
            end = hi - first
            while pos < end:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    where = f"{path} line {lineno}" if lineno is not None else f"{path} line at byte {pos}"
                    yield RawDoc(data=line, jsonl=True, where=where)
                pos += len(line)
                if lineno is not None:
                    lineno += 1


def chunks(docs: Iterator[RawDoc], max_docs: int = CHUNK_DOCS, max_bytes: int = CHUNK_BYTES
           ) -> Iterator[list[RawDoc]]:
    chunk: list[RawDoc] = []
    nbytes = 0
    for d in docs:
        chunk.append(d)
        nbytes += len(d.data)
        if len(chunk) >= max_docs or nbytes >= max_bytes:
            yield chunk
            chunk, nbytes = [], 0
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------------
# Tokenizing chunks, in this process or in workers
# ---------------------------------------------------------------------------------------------


class ChunkEncoder:
    """Turns a chunk of raw docs into ``(tokens, lengths)``: all docs' ids concatenated, and ``[docs]`` int64."""

    def __init__(self, tokenizer: Any, text_field: str) -> None:
        self.tok = tokenizer
        self.text_field = text_field

    def __call__(self, chunk: list[RawDoc]) -> tuple[np.ndarray, np.ndarray]:
        texts = [jsonl_text(d.data, self.text_field, d.where) if d.jsonl else d.data for d in chunk]
        ids = [np.asarray(a) for a in encode_many(self.tok, texts)]
        lengths = np.array([len(a) for a in ids], dtype=np.int64)  # [docs]
        # one array per chunk: cheaper to send back from a worker than many small ones
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint8)  # [sum(lengths)]
        return flat, lengths


_worker_encoder: ChunkEncoder | None = None


def _init_worker(tokenizer: Any, text_field: str) -> None:
    global _worker_encoder
    # the processes are the parallelism: keep each HF batch call on one thread (read when the tokenizer runs)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_encoder = ChunkEncoder(tokenizer, text_field)


def _encode_in_worker(chunk: list[RawDoc]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None
    return _worker_encoder(chunk)


def encoded_chunks(pieces: Iterator[list[RawDoc]], encoder: ChunkEncoder, workers: int
                   ) -> Iterator[tuple[list[RawDoc], tuple[np.ndarray, np.ndarray]]]:
    """``(chunk, encoder(chunk))`` in chunk order; with ``workers > 1`` encoded in that many processes
    with at most ``2 * workers + 1`` chunks in flight (an ordered imap that reads ahead a bounded amount)."""
    if workers <= 1:
        for c in pieces:
            yield c, encoder(c)
        return
    methods = multiprocessing.get_all_start_methods()
    # never fork: the parent may hold threads (a tokenizer's pool, tqdm) that a forked child would inherit locked
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(encoder.tok, encoder.text_field)) as pool:
        pending: deque[tuple[list[RawDoc], Future]] = deque()
        try:
            for c in pieces:
                pending.append((c, pool.submit(_encode_in_worker, c)))
                if len(pending) > 2 * workers:
                    c0, fut = pending.popleft()
                    yield c0, fut.result()
            while pending:
                c0, fut = pending.popleft()
                yield c0, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


def build_from_files(files: list[str], out_dir: str, *, tokenizer: Any = None, text_field: str = "text",
                     max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                     progress: bool = False, workers: int = 1, part: tuple[int, int] | str | None = None,
                     chunk_docs: int = CHUNK_DOCS) -> dict[str, Any]:
    """Tokenize files into a shard folder (one doc per file, or per line of a ``.jsonl``); returns its metadata
    (``shards.json``) plus ``"build"``: ``{"seconds", "docs", "input_bytes", "docs_per_s", "mb_per_s",
    "workers"}`` (not stored: the folder does not depend on timing).

    ``workers``: tokenizing processes (the folder is the same for any number). ``part``: ``(K, N)`` or
    ``"K/N"``: build only part ``K`` of ``N`` (see the module doc for the rule); ``shards.json`` and
    ``index.json`` then record ``part``, and always ``inputs`` (the input set's identity). ``chunk_docs``:
    most docs per chunk (one batch call of the tokenizer, one task of a worker).
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 1024:
        raise ValueError(f"workers must be an integer in 1..1024, got {workers!r}")
    k, n = parse_part(part) if isinstance(part, str) else (part if part is not None else (0, 1))
    if part is not None and not (isinstance(k, int) and isinstance(n, int) and 0 <= k < n):
        raise ValueError(f"part must be (K, N) with 0 <= K < N, got {part!r}")
    tok = get_tokenizer(tokenizer)
    if not files:
        raise ValueError("no input files to build shards from")
    t0 = time.perf_counter()
    sizes = file_sizes(files)
    inputs = input_identity(files, sizes, text_field)
    lo, hi = part_range(inputs["bytes"], k, n)
    extra: dict[str, Any] = {"inputs": inputs}
    if part is not None:
        extra["part"] = {"index": k, "count": n, "input_bytes": [lo, min(hi, inputs["bytes"])]}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=min(hi, inputs["bytes"]) - lo, desc="building shards" + (f" (part {k}/{n})" if part else ""),
                   unit="B", unit_scale=True)
    read_bytes = 0
    encoder = ChunkEncoder(tok, text_field)
    try:
        with ShardWriter(out_dir, dtype=token_dtype(tok.vocab_size), tokenizer=tok.identity(),
                         max_shard_bytes=max_shard_bytes, max_docs_per_shard=max_docs_per_shard,
                         extra=extra, allow_empty=part is not None) as w:
            pieces = chunks(read_docs(files, sizes, lo, hi), chunk_docs)
            for chunk, (flat, lengths) in encoded_chunks(pieces, encoder, workers):
                ends = np.cumsum(lengths)
                for i, e in enumerate(ends.tolist()):
                    w.add(flat[e - int(lengths[i]):e])
                nbytes = sum(len(d.data) for d in chunk)
                read_bytes += nbytes
                if bar is not None:
                    bar.update(nbytes)
                    bar.set_postfix(docs=w.num_docs, tokens=w.num_tokens, refresh=False)
            if not w.num_docs and part is None:
                raise ValueError(f"the {len(files)} input file(s) hold no docs (every .jsonl line is blank)")
    finally:
        if bar is not None:
            bar.close()
    meta = read_index_json(os.path.join(out_dir, META_FILE))
    dt = max(time.perf_counter() - t0, 1e-9)
    meta["build"] = {"seconds": dt, "docs": meta["num_docs"], "input_bytes": read_bytes,
                     "docs_per_s": meta["num_docs"] / dt, "mb_per_s": read_bytes / 2**20 / dt, "workers": workers}
    return meta
