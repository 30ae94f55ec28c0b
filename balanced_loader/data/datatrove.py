"""datatrove token files as a source: a folder (local or remote) of ``NAME.ds`` + ``NAME.ds.index``.

What datatrove's ``DocumentTokenizer`` (``pipeline/tokens/tokenizer.py``) and its merger write:

* ``NAME.ds``: every doc's token ids back to back, ``uint16`` (token size 2) or, for vocabularies over
  65,536 ids, ``uint32`` (token size 4), little-endian;
* ``NAME.ds.index``: ``uint64`` little-endian, each doc's end offset in tokens (no header; doc ``i`` is
  ``[ends[i - 1], ends[i])``, the first starting at 0);
* ``NAME.ds.metadata`` (optional): text lines ``TOKENIZER|TOKEN_SIZE``, the token count, and the count in
  words (older datatrove wrote only ``TOKENIZER``: 2-byte tokens); ``NAME.ds.loss`` (optional) is ignored.

The files of a folder are one source, in name order (doc ids end to end); lengths are the index's
differences (``[num_docs]`` int64 in memory, 8 bytes a doc). Opening reads the indexes and checks each
``.ds`` size against its last end and its token size, so a truncated file, a token size that does not
divide a file or a missing index is one ``ValueError`` naming the file. The token size comes from the
metadata, else from ``token_size=``, else from the file size over the last end (2 or 4). A doc's tokens
are one read (``os.pread``, or one byte range of a remote file through :mod:`.filestores`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from balanced_loader.data.filestores import open_store, split_location
from balanced_loader.data.sources import Source, tokenizer_key
from balanced_loader.data.stores import is_url

TOKEN_SIZES = {2: "<u2", 4: "<u4"}
INDEX_SUFFIX = ".index"
META_SUFFIX = ".metadata"


def is_datatrove_folder(path: str) -> bool:
    """Whether a local folder holds datatrove token files (``*.ds``) and no shard index."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith(".ds") for n in names) and "index.json" not in names


def parse_metadata(text: str, where: str) -> tuple[str | None, int | None]:
    """``(tokenizer name, token size)`` from a ``.ds.metadata`` (token size ``None`` when the line has none)."""
    first = text.splitlines()[0].strip() if text.strip() else ""
    if not first:
        return None, None
    name, bar, size = first.rpartition("|")
    if not bar:
        return first, 2  # datatrove before token sizes: uint16 only
    if size not in ("2", "4"):
        raise ValueError(f"{where}: token size {size!r} in its first line '{first}' is not 2 or 4")
    return name, int(size)


class _File:
    """One ``.ds`` file: its lengths (from the index), token dtype and store."""

    def __init__(self, path: str, remote: dict[str, Any] | None, token_size: int | None) -> None:
        folder, name = split_location(path)
        if not name.endswith(".ds"):
            raise ValueError(f"{path} is not a datatrove token file (NAME.ds)")
        self.name = name
        self.store = open_store(folder, name + INDEX_SUFFIX, remote)
        self.path = self.store.path(name)
        index_name = name + INDEX_SUFFIX
        where = self.store.path(index_name)
        if not self.store.exists(name):
            raise ValueError(f"datatrove token file {self.path} does not exist")
        if not self.store.exists(index_name):
            raise ValueError(f"{where} is missing: datatrove writes NAME.ds.index beside NAME.ds (its doc ends); "
                             f"copy it with the .ds, or re-run the tokenizer with save_index=True")
        raw = self.store.fetch(index_name)
        if len(raw) % 8:
            raise ValueError(f"{where} is {len(raw):,} bytes, not a whole number of uint64 doc ends; it is "
                             f"truncated or not a datatrove index")
        ends = np.frombuffer(raw, dtype="<u8")  # [num_docs]
        lengths = np.diff(ends.astype(np.int64), prepend=np.int64(0))  # [num_docs]
        if ends.size and (int(ends[-1]) >= 1 << 62 or lengths.min() < 0):
            bad = int(np.flatnonzero(lengths < 0)[0]) if lengths.min() < 0 else len(ends) - 1
            raise ValueError(f"{where}: doc end {bad} ({int(ends[bad]):,}) is before the previous one; the index "
                             f"is damaged (or not a datatrove index)")
        self.lengths = lengths
        self.tokenizer: str | None = None
        size_from = "token_size="
        meta_name = name + META_SUFFIX
        if self.store.exists(meta_name):
            meta = self.store.fetch(meta_name).decode("utf-8", errors="replace")
            self.tokenizer, meta_size = parse_metadata(meta, self.store.path(meta_name))
            if meta_size is not None:
                token_size, size_from = meta_size, self.store.path(meta_name)
        nbytes = self.store.size(name)
        tokens = int(ends[-1]) if ends.size else 0
        if token_size is None:
            if tokens == 0 or nbytes % tokens or nbytes // tokens not in TOKEN_SIZES:
                raise ValueError(f"{self.path}: no {meta_name} names its token size and {nbytes:,} bytes over "
                                 f"{tokens:,} tokens is not 2 or 4; pass token_size=2 or 4")
            token_size, size_from = nbytes // tokens, "the file size"
        if token_size not in TOKEN_SIZES:
            raise ValueError(f"token_size must be 2 or 4, got {token_size!r}")
        if nbytes % token_size:
            raise ValueError(f"{self.path} is {nbytes:,} bytes, not a multiple of its token size {token_size} "
                             f"(from {size_from}): the file is damaged, or the token size is wrong")
        if nbytes != tokens * token_size:
            what = "truncated" if nbytes < tokens * token_size else "longer than its index"
            raise ValueError(f"{self.path} holds {nbytes // token_size:,} tokens of {token_size} bytes but "
                             f"{index_name} ends at {tokens:,}: the file is {what} (or the index is another "
                             f"file's); re-copy or re-tokenize it")
        self.token_size = token_size
        self.dtype = np.dtype(TOKEN_SIZES[token_size])
        self.starts = (ends.astype(np.int64) - lengths) * token_size  # [num_docs] byte offset of each doc

    @property
    def num_docs(self) -> int:
        return len(self.lengths)


class DatatroveSource(Source):
    """datatrove token files as one source (see the module doc).

    ``spec``: a folder (path or URL; every ``*.ds`` in it, name order) or a list of ``.ds`` files (in the
    order given). ``token_size``: 2 or 4 where no metadata names it. ``remote``: options of URLs (see
    :func:`balanced_loader.data.open.open_source`)."""

    def __init__(self, spec: str | Sequence[str], *, token_size: int | None = None,
                 remote: dict[str, Any] | None = None) -> None:
        self._args = {"spec": spec, "token_size": token_size, "remote": remote}
        paths = self._paths(spec, remote)
        self.files: list[_File] = []
        try:
            for p in paths:
                self.files.append(_File(p, remote, token_size))
        except BaseException:
            self.close()
            raise
        first = self.files[0]
        for f in self.files[1:]:
            if f.token_size != first.token_size:
                raise ValueError(f"{first.path} holds {first.token_size}-byte tokens but {f.path} "
                                 f"{f.token_size}-byte ones; combine files of one tokenizer")
            if f.tokenizer and first.tokenizer and tokenizer_key(f.tokenizer) != tokenizer_key(first.tokenizer):
                raise ValueError(f"{first.path} was tokenized with {first.tokenizer} but {f.path} with "
                                 f"{f.tokenizer}; combine files of one tokenizer")
        self.dtype = first.dtype
        self.tokenizer = first.tokenizer
        self.doc_offsets = np.concatenate([[0], np.cumsum([f.num_docs for f in self.files])]).astype(np.int64)
        self.shard_bounds = self.doc_offsets.copy()  # [files + 1]: each file a shard for the shuffle
        self.lengths = np.concatenate([f.lengths for f in self.files]) if self.files else np.zeros(0, np.int64)
        self._lock = threading.Lock()
        self._prefetched: dict[tuple[int, int, int], bytes] = {}
        self.bytes_read = 0

    @staticmethod
    def _paths(spec: Any, remote: dict[str, Any] | None) -> list[str]:
        if isinstance(spec, (list, tuple)):
            if not spec:
                raise ValueError("no datatrove .ds files given")
            return [os.fspath(s) for s in spec]
        spec = os.fspath(spec)
        if spec.endswith(".ds"):
            return [spec]
        folder = spec.rstrip("/") if is_url(spec) else spec
        store = open_store(folder, "", remote)
        try:
            names = [n for n in store.listdir() if n.endswith(".ds")]
        finally:
            store.close()
        if not names:
            raise ValueError(f"{folder} holds no datatrove token files (NAME.ds + NAME.ds.index)")
        sep = "/" if is_url(folder) else os.sep
        return [f"{folder}{sep}{n}" for n in names]

    def describe(self) -> str:
        more = f" (and {len(self.files) - 1} more)" if len(self.files) > 1 else ""
        return f"datatrove files {self.files[0].path}{more}"

    @property
    def vocab_size(self) -> int | None:
        return None

    def locate(self, doc_id: int) -> tuple[int, int]:
        d = self._check_doc(doc_id)
        j = int(np.searchsorted(self.doc_offsets, d, side="right")) - 1
        return j, d - int(self.doc_offsets[j])

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:
        """Fetch the byte ranges of these reads concurrently (remote files only)."""
        if not any(f.store.remote for f in self.files):
            return
        want: dict[int, list[tuple[int, int]]] = {}
        for doc_id, start, length in reads:
            try:
                d, start, length = self._check_range(doc_id, start, length)
            except ValueError:
                continue
            j, i = self.locate(d)
            f = self.files[j]
            if length and f.store.remote:
                want.setdefault(j, []).append((length * f.token_size, int(f.starts[i]) + start * f.token_size))
        got: dict[tuple[int, int, int], bytes] = {}
        for j, ranges in want.items():
            f = self.files[j]
            bufs = f.store.pread_many([(f.name, n, off) for n, off in ranges])
            got.update({(j, n, off): b for (n, off), b in zip(ranges, bufs, strict=True) if b is not None})
        self._prefetched = got

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        j, i = self.locate(d)
        f = self.files[j]
        n, off = length * f.token_size, int(f.starts[i]) + start * f.token_size
        buf = self._prefetched.pop((j, n, off), None) if self._prefetched else None
        if buf is None:
            buf = f.store.pread(f.name, n, off) if n else b""
        with self._lock:
            self.bytes_read += len(buf)
        if len(buf) != n:
            raise ValueError(f"{f.path} is truncated: doc {d} needs bytes [{off:,}, {off + n:,}) but the file ends "
                             f"first; re-copy it")
        return np.frombuffer(buf, dtype=f.dtype)  # [length]

    def close(self) -> None:
        for f in getattr(self, "files", []):
            f.store.close()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._args)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"], token_size=state["token_size"], remote=state["remote"])  # type: ignore[misc]


def write_datatrove(folder: str, name: str, docs: Iterable[Any], *, token_size: int = 2,
                    tokenizer: str | None = "gpt2") -> str:
    """Write ``docs`` (token arrays) as ``folder/NAME.ds`` + ``.ds.index`` (+ ``.ds.metadata`` unless
    ``tokenizer`` is None), as datatrove's ``TokenizedFile`` does; returns the ``.ds`` path (tests, tools)."""
    from balanced_loader.outputs.files import atomic_write

    dt = np.dtype(TOKEN_SIZES[token_size])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name if name.endswith(".ds") else name + ".ds")
    ends, total = [], 0
    with atomic_write(path, "wb") as f:
        for doc in docs:
            a = np.ascontiguousarray(doc, dtype=dt)
            f.write(a.tobytes())
            total += len(a)
            ends.append(total)
    with atomic_write(path + INDEX_SUFFIX, "wb") as f:
        f.write(np.asarray(ends, dtype="<u8").tobytes())
    if tokenizer is not None:
        with atomic_write(path + META_SUFFIX, "w") as f:
            f.write("\n".join([f"{tokenizer}|{token_size}", str(total), f"{total}T"]))
    return path
