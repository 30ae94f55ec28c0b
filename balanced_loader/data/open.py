"""Opening data: :func:`open_source` (any source spec) and :func:`read_batch_source` (the CLI's
``--lengths FILE | --source DIR``).

The one module that knows every source type, so ``sources``, ``shards`` and ``lengths`` need not
import each other (``shards`` imports ``sources``; ``lengths`` imports nothing of ours).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from balanced_loader.data.hf_datasets import TOKENIZE_HINT, HFDatasetSource, hf_kind
from balanced_loader.data.lengths import LENGTH_SUFFIXES, doc_line, read_lengths
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.sources import JsonlSource, LengthSource, Source


def open_source(spec: Any, *, text_field: str = "text", tokenizer: Any = None,
                token_field: str = "input_ids") -> Source:
    """Open a source: a shard folder, a ``.jsonl`` file, a length file (``.npy``, ``.txt``, ``.txt.gz``;
    planning only), a list/array of lengths, or a Hugging Face ``datasets.Dataset`` whose
    ``token_field`` column holds token ids (read zero-copy from its Arrow files)."""
    if isinstance(spec, Source):
        return spec
    if hf_kind(spec) is not None:  # checked without importing datasets (absent unless the caller imported it)
        if tokenizer is not None:
            raise ValueError(f"open_source does not tokenize a Hugging Face dataset; {TOKENIZE_HINT}")
        return HFDatasetSource(spec, token_field=token_field)
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if os.path.isdir(path):
            return ShardSource(path)
        if not os.path.exists(path):
            raise ValueError(f"source {path} does not exist (expected a shard folder, a .jsonl file "
                             f"or a length file)")
        if path.endswith(".jsonl"):
            return JsonlSource(path, text_field=text_field, tokenizer=tokenizer)
        if path.endswith(LENGTH_SUFFIXES):
            # read_lengths checks the values (streamed, naming the file and line): not a second time
            return LengthSource(read_lengths(path), name=f"lengths file {path}", checked=True)
        raise ValueError(f"source {path}: unsupported file type; use a shard folder (balanced-loader "
                         f"build-shards), a .jsonl file or a length file (.npy, .txt, .txt.gz)")
    if isinstance(spec, (list, tuple, np.ndarray)):
        return LengthSource(spec)
    raise ValueError(f"cannot open a source from {type(spec).__name__}; pass a shard folder, a .jsonl "
                     f"path, a datasets.Dataset, or a list of lengths (wrap a torch Dataset with balanced_loader.wrap)")


def read_batch_source(lengths_path: str | None, source_path: str | None, *,
                      positive: bool = False) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Lengths from ``--lengths FILE`` or ``--source DIR``: ``([num_docs], shard bounds or None, label)``.

    ``positive``: a length of 0 or less in a lengths file is an error naming the doc and line
    (a source's empty docs are skipped later by the loader's rules instead).
    """
    if lengths_path:
        lengths = read_lengths(lengths_path, check=False)  # a memory map is checked where batching reads it
        if positive and not isinstance(lengths, np.memmap) and lengths.size and int(lengths.min()) <= 0:
            i = int(np.flatnonzero(lengths <= 0)[0])
            line = doc_line(lengths_path, i)
            where = f"doc {i}" + (f" (line {line})" if line is not None else "")
            raise ValueError(f"--lengths {lengths_path}: lengths must be positive; {where} "
                             f"has length {int(lengths[i])}")
        return lengths, None, lengths_path
    src = open_source(source_path)
    try:
        bounds = None if src.shard_bounds is None else np.asarray(src.shard_bounds, dtype=np.int64)
        return np.asarray(src.lengths, dtype=np.int64), bounds, str(source_path)
    finally:
        src.close()
