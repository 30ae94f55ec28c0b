"""Opening data: :func:`open_source` (any source spec) and :func:`read_batch_source` (the CLI's
``--lengths FILE | --source DIR``).

The one module that knows every source type, so ``sources``, ``shards`` and ``lengths`` need not
import each other (``shards`` imports ``sources`` and ``stores``; ``lengths`` imports nothing of ours;
``remote``, which imports fsspec, is imported only when a URL is opened).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from balanced_loader.data.hf_datasets import TOKENIZE_HINT, HFDatasetSource, hf_kind
from balanced_loader.data.index import META_FILE, read_index_json
from balanced_loader.data.lengths import LENGTH_SUFFIXES, doc_line, read_lengths
from balanced_loader.data.parts import PartsSource
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.sources import JsonlSource, LengthSource, Source
from balanced_loader.data.stores import is_url


def open_source(spec: Any, *, text_field: str = "text", tokenizer: Any = None, token_field: str = "input_ids",
                cache_dir: str | None = None, cache_shards: bool = False,
                storage_options: dict[str, Any] | None = None, allow_part: bool = False,
                read_timeout_s: float | None = None, retries: int | None = None) -> Source:
    """Open a source: a shard folder (local, or a URL: ``http(s)://``, ``s3://``, ``gs://``, any fsspec
    URL), a ``.jsonl`` file, a length file (``.npy``, ``.txt``, ``.txt.gz``; planning only), a list/tuple
    of shard folders (str or PathLike: one source, see :mod:`.parts`), a list/array of lengths, or a
    Hugging Face ``datasets.Dataset`` whose ``token_field`` column holds token ids (read zero-copy from
    its Arrow files).

    Remote folders only (see :mod:`balanced_loader.data.remote`): ``cache_dir`` keeps the fetched
    index files (and, with ``cache_shards=True``, whole shards on first read) in a local folder;
    ``storage_options`` go to fsspec (credentials, endpoints); ``read_timeout_s`` (default 60) is how
    long a read waits for a stalled server, ``retries`` (default 3) how often a transient failure
    (HTTP 5xx, a dropped connection) is retried with backoff.

    A shard folder opens only with a complete index that agrees with its shards (it is never built
    on open: ``balanced-loader index DIR``); a part of a ``--part K/N`` build opens alone only with
    ``allow_part=True``.
    """
    if isinstance(spec, Source):
        return spec
    if hf_kind(spec) is not None:  # checked without importing datasets (absent unless the caller imported it)
        if tokenizer is not None:
            raise ValueError(f"open_source does not tokenize a Hugging Face dataset; {TOKENIZE_HINT}")
        return HFDatasetSource(spec, token_field=token_field)
    remote: dict[str, Any] = {"cache_dir": cache_dir, "cache_shards": cache_shards,
                              "storage_options": storage_options}
    remote.update({k: v for k, v in (("read_timeout_s", read_timeout_s), ("retries", retries)) if v is not None})
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, (str, os.PathLike)) for s in spec):
        other = _other_format(list(spec), remote)  # Megatron prefixes or datatrove .ds files
        if other is not None:
            return other
        if len(spec) == 1 and (is_url(spec[0]) or not _is_part(spec[0])):
            return open_source(spec[0], text_field=text_field, tokenizer=tokenizer, allow_part=allow_part, **remote)
        return PartsSource(list(spec), remote=remote)
    if isinstance(spec, str) and spec.startswith("file://"):
        spec = spec[len("file://"):]
    if is_url(spec):
        from balanced_loader.data.remote import open_remote  # fsspec is imported only for URLs

        other = _other_format([spec], remote)
        if other is not None:
            return other
        try:
            return open_remote(spec, allow_part=allow_part, **remote)
        except ValueError as e:  # no index.json there: a Megatron prefix or a datatrove folder?
            other = _remote_other(spec, remote) if "not found" in str(e) else None
            if other is None:
                raise
            return other
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        other = _other_format([path], remote)
        if other is not None:
            return other
        if os.path.isdir(path):
            return ShardSource(path, allow_part=allow_part)
        if not os.path.exists(path):
            raise ValueError(f"source {path} does not exist (expected a shard folder, a Megatron dataset PREFIX "
                             f"of PREFIX.bin + PREFIX.idx, a folder of datatrove .ds files, a .jsonl file or a "
                             f"length file)")
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


def _other_format(specs: list[Any], remote: dict[str, Any]) -> Source | None:
    """A Megatron indexed dataset (every spec a prefix, or a local folder of ``.idx`` + ``.bin`` pairs) or
    datatrove token files (``.ds`` files, or a local folder of them); ``None`` for anything else."""
    from balanced_loader.data.datatrove import DatatroveSource, is_datatrove_folder
    from balanced_loader.data.megatron import MegatronSource, prefixes_in, resolve_prefix

    paths = [os.fspath(s) for s in specs]
    if all(resolve_prefix(p) is not None for p in paths):
        return MegatronSource(paths, remote=remote)
    if all(p.endswith(".ds") for p in paths):
        return DatatroveSource(paths, remote=remote)
    if len(paths) == 1 and not is_url(paths[0]) and os.path.isdir(paths[0]):
        if is_datatrove_folder(paths[0]):
            return DatatroveSource(paths[0], remote=remote)
        found = prefixes_in(paths[0])
        if found:
            return MegatronSource(found, remote=remote)
    return None


def _remote_other(url: str, remote: dict[str, Any]) -> Source | None:
    """A URL without ``index.json``: a Megatron prefix (``URL.idx`` exists) or a folder of datatrove files."""
    from balanced_loader.data.datatrove import DatatroveSource
    from balanced_loader.data.filestores import open_store, split_location
    from balanced_loader.data.megatron import MegatronSource

    folder, name = split_location(url)
    store = open_store(folder, name + ".idx", remote)
    try:
        if store.exists(name + ".idx"):
            return MegatronSource([url], remote=remote)
    finally:
        store.close()
    try:
        return DatatroveSource(url, remote=remote)
    except ValueError:
        return None


def _is_part(path: Any) -> bool:
    """Whether a one-element folder list is a part folder (then it must be checked as a whole build)."""
    meta = os.path.join(os.fspath(path), META_FILE)
    return os.path.exists(meta) and "part" in read_index_json(meta)


def read_batch_source(lengths_path: str | None, source_path: str | list[str] | None, *, positive: bool = False,
                      cache_dir: str | None = None) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Lengths from ``--lengths FILE`` or ``--source DIR|URL [...]``: ``([num_docs], shard bounds or None, label)``.

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
    if isinstance(source_path, (list, tuple)):  # --source DIR [DIR ...]
        label = " ".join(map(str, source_path))
        spec: Any = source_path[0] if len(source_path) == 1 else list(source_path)
    else:
        label, spec = str(source_path), source_path
    src = open_source(spec, cache_dir=cache_dir)
    try:
        bounds = None if src.shard_bounds is None else np.asarray(src.shard_bounds, dtype=np.int64)
        return np.asarray(src.lengths, dtype=np.int64), bounds, label
    finally:
        src.close()
