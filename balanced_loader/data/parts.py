"""Several shard folders opened as one source: the parts of a ``build-shards --part K/N`` build, or
plain folders.

Folders built with ``--part`` are ordered by their recorded part index (not by argument order)
and must form one complete build: every part ``0..N-1`` once, the same ``N``, the same input set
(names and sizes, and a content hash of every input byte that each part computes), tokenizer and
dtype. A part alone is not a dataset: ``open_source(part)`` refuses it unless ``allow_part=True``.
Plain folders (built without ``--part``) are combined in argument order
(tokenizer and dtype must still agree). doc_id = the part's doc offset + its local doc_id, so with
the part rule of :mod:`.build` the combined source numbers docs exactly as one whole build would
(same lengths fingerprint). A part that got no docs holds only ``shards.json`` and counts as 0 docs.

``lengths`` is one in-memory ``[num_docs]`` int64 array, concatenated from the parts' memory maps
on first access (8 bytes per doc); reads, ``num_docs`` and ``shard_bounds`` do not need it.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from balanced_loader.data.index import INDEX_FILE, META_FILE, check_token_dtype, list_shards, read_index_json
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.sources import Source, tokenizer_key
from balanced_loader.data.stores import is_url


class _EmptyPart:
    """A part folder that got no docs: its ``shards.json`` only."""

    def __init__(self, folder: str, meta: dict[str, Any]) -> None:
        self.folder = folder
        self.index = meta
        self.tokenizer = meta.get("tokenizer")
        self.dtype = check_token_dtype(meta["dtype"], os.path.join(folder, META_FILE))
        self.lengths = np.zeros(0, dtype=np.int64)  # [0]
        self.shard_bounds = np.zeros(1, dtype=np.int64)  # [1]
        self.num_docs = 0
        self.num_tokens = 0
        self.bytes_read = 0
        self.has_checksums = True
        self.vocab_size = self.tokenizer.get("vocab_size") if isinstance(self.tokenizer, dict) else None
        self.max_token_id = None

    def tokens_fingerprint(self) -> str:
        return "empty"

    def close(self) -> None:
        pass


def _open_part(folder: str, remote: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A :class:`ShardSource` (``remote``: options of a URL's folder, see :func:`.remote.open_remote`), or
    an :class:`_EmptyPart` for a local part folder the writer left without docs."""
    if is_url(folder):
        from balanced_loader.data.remote import open_remote  # fsspec is imported only for URLs

        return open_remote(folder, verify=kw.get("verify", "full"), allow_part=True, **(remote or {}))
    if os.path.isfile(folder):
        raise ValueError(f"{folder} is a file; a list of sources must be shard folders (one source from a "
                         f".jsonl or length file: pass its path alone)")
    meta_path = os.path.join(folder, META_FILE)
    if (os.path.isdir(folder) and not os.path.exists(os.path.join(folder, INDEX_FILE))
            and not list_shards(folder) and os.path.exists(meta_path)):
        meta = read_index_json(meta_path)
        if meta.get("num_docs") == 0 and "part" in meta:
            return _EmptyPart(folder, meta)
    return ShardSource(folder, allow_part=True, **kw)


def _order_parts(folders: list[str], parts: list[Any]) -> list[int]:
    """The order to combine the folders in; one ``ValueError`` for an incomplete or mixed set."""
    info = [p.index.get("part") for p in parts]
    built = [f for f, i in zip(folders, info, strict=True) if i is not None]
    if not built:
        return list(range(len(folders)))  # plain folders: argument order
    if len(built) != len(folders):
        plain = next(f for f, i in zip(folders, info, strict=True) if i is None)
        raise ValueError(f"{built[0]} is one part of a build-shards --part build but {plain} is not; "
                         f"open the parts of one build, or only plain folders")
    first = info[0]
    for f, i, p in zip(folders, info, parts, strict=True):
        if i["count"] != first["count"]:
            raise ValueError(f"{folders[0]} is part {first['index']}/{first['count']} but {f} is part "
                             f"{i['index']}/{i['count']}: parts of builds with different N"
                             "; open the parts of one build")
        mine, first_in = p.index.get("inputs") or {}, parts[0].index.get("inputs") or {}
        for key, what in (("sha256", "input sets (file names and sizes)"),
                          ("content", "inputs of different content (the same file names and sizes, other bytes)")):
            if mine.get(key) != first_in.get(key):
                raise ValueError(f"{folders[0]} and {f} were built from {what}: {key} "
                                 f"{str(first_in.get(key))[:12]} vs {str(mine.get(key))[:12]}; open the parts of "
                                 f"one build (rebuild every part from the same input files)")
    seen: dict[int, str] = {}
    for f, i in zip(folders, info, strict=True):
        if i["index"] in seen:
            raise ValueError(f"part {i['index']}/{i['count']} is given twice: {seen[i['index']]} and {f}")
        seen[i["index"]] = f
    missing = [k for k in range(first["count"]) if k not in seen]
    if missing:
        word = "part" if len(missing) == 1 else "parts"
        raise ValueError(f"{word} {', '.join(map(str, missing))} of {first['count']} missing (got parts "
                         f"{', '.join(map(str, sorted(seen)))}); pass every part folder of the build")
    return sorted(range(len(folders)), key=lambda j: info[j]["index"])


class PartsSource(Source):
    """Shard folders opened as one source (see the module doc). ``verify``/``max_open_files``: as
    :class:`~balanced_loader.data.shards.ShardSource`, for each folder."""

    def __init__(self, folders: list[Any] | tuple[Any, ...], *, verify: str = "full", max_open_files: int = 64,
                 remote: dict[str, Any] | None = None) -> None:
        folders = [os.fspath(f) for f in folders]
        if not folders:
            raise ValueError("no shard folders given; pass one folder or the part folders of a build")
        self._args = {"folders": folders, "verify": verify, "max_open_files": max_open_files, "remote": remote}
        opened: list[Any] = []
        try:
            for f in folders:
                opened.append(_open_part(f, remote, verify=verify, max_open_files=max_open_files))
            order = _order_parts(folders, opened)
            self._check_same(folders, opened)
        except BaseException:
            for p in opened:
                p.close()
            raise
        self.folders = [folders[j] for j in order]
        self.parts = [opened[j] for j in order]
        self.dtype = self.parts[0].dtype
        self.tokenizer = self.parts[0].tokenizer
        sizes = [p.num_docs for p in self.parts]
        self.doc_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [parts + 1]
        bounds = [np.zeros(1, dtype=np.int64)]
        for off, p in zip(self.doc_offsets[:-1].tolist(), self.parts, strict=True):
            bounds.append(np.asarray(p.shard_bounds[1:], dtype=np.int64) + off)
        self.shard_bounds = np.concatenate(bounds)  # [num_shards + 1]
        self._lengths: np.ndarray | None = None

    @staticmethod
    def _check_same(folders: list[str], parts: list[Any]) -> None:
        for f, p in zip(folders[1:], parts[1:], strict=True):
            if tokenizer_key(p.tokenizer) != tokenizer_key(parts[0].tokenizer):
                raise ValueError(f"{folders[0]} was built with tokenizer {parts[0].tokenizer} but {f} with "
                                 f"{p.tokenizer}; combine folders of one tokenizer")
            if p.dtype != parts[0].dtype:
                raise ValueError(f"{folders[0]} stores {parts[0].dtype} tokens but {f} stores {p.dtype}; "
                                 f"combine folders of one dtype")

    @property
    def lengths(self) -> np.ndarray:  # type: ignore[override]
        if self._lengths is None:
            out = np.empty(int(self.doc_offsets[-1]), dtype=np.int64)  # [num_docs], filled part by part
            for off, p in zip(self.doc_offsets[:-1].tolist(), self.parts, strict=True):
                out[off:off + p.num_docs] = p.lengths
            self._lengths = out
        return self._lengths

    @property
    def num_docs(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def num_tokens(self) -> int:
        return sum(int(p.num_tokens) for p in self.parts)

    @property
    def has_checksums(self) -> bool:
        return all(p.has_checksums for p in self.parts)

    @property
    def bytes_read(self) -> int:  # type: ignore[override]
        return sum(p.bytes_read for p in self.parts)

    def describe(self) -> str:
        return f"{len(self.parts)} shard folders ({self.folders[0]} ...)"

    def tokens_fingerprint(self) -> str | None:
        fps = [p.tokens_fingerprint() for p in self.parts]
        if any(fp is None for fp in fps):
            return None
        return hashlib.blake2b(("parts:" + ",".join(fps)).encode(), digest_size=16).hexdigest()

    @property
    def vocab_size(self) -> int | None:
        return self.parts[0].vocab_size  # the parts share a tokenizer (checked on open)

    @property
    def max_token_id(self) -> int | None:
        ids = [p.max_token_id for p in self.parts if p.num_docs]
        return None if not ids or any(i is None for i in ids) else max(ids)

    def _locate(self, doc_id: int) -> tuple[Any, int]:
        d = int(doc_id)
        if not 0 <= d < self.num_docs:
            raise ValueError(f"doc_id {d} is outside 0..{self.num_docs - 1} of {self.describe()}")
        j = int(np.searchsorted(self.doc_offsets, d, side="right")) - 1  # skips empty parts
        return self.parts[j], d - int(self.doc_offsets[j])

    def tokens(self, doc_id: int) -> np.ndarray:
        part, d = self._locate(doc_id)
        return part.tokens(d)

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        part, d = self._locate(doc_id)
        return part.read(d, start, length)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._args)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folders"], verify=state["verify"], max_open_files=state["max_open_files"],  # type: ignore[misc]
                      remote=state.get("remote"))
