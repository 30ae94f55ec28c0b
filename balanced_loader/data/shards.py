"""Webdataset shards of tokenized docs, their length index, and checked random-access reads.

Layout of a shard folder::

    shard-000000.tar ...   plain tar; one member ``<key>.npy`` per doc (``key`` = 10-digit doc_id),
                           a 1-D little-endian unsigned array of token ids; readable by
                           ``webdataset.WebDataset(urls).decode()`` as sample["npy"]
    shards.json            written by the writer: tokenizer identity, dtype, docs, bytes and crc32 per
                           shard, the checksum block size
    shards.crc.npy         written by the writer: uint32 checksums in doc order; per doc the crc32 of
                           all its token bytes, then the crc32 of each CHECK_BLOCK_BYTES block
    index.json             the length index: shard list (name, docs, bytes, crc32), dtype, tokenizer,
                           lengths fingerprint, whether member names are the doc_ids
    index.lengths.npy      [num_docs] int64 tokens per doc         (memory-mapped on open)
    index.shard.npy        [num_docs] int32 shard of each doc      (memory-mapped on open)
    index.offset.npy       [num_docs] int64 byte offset of the doc's token data inside its tar
    index.crc_start.npy    [num_docs + 1] int64 where each doc's checksums start in shards.crc.npy

doc_ids run in shard order, then member order, so the docs of shard ``s`` are
``shard_bounds[s]:shard_bounds[s + 1]``. A tar member's data is contiguous, so tokens
``[a, b)`` of a doc are one ``pread`` of ``(b - a) * itemsize`` bytes at ``offset + a * itemsize``.

Reads are checked (:mod:`.integrity`): the first read of a doc checks its tar and ``.npy``
headers against the index, and every read checks the block checksums it covers
(``verify="full"``, the default; ``"header"`` skips the checksums, ``"off"`` both). A mismatch
is one ``ValueError`` naming the shard file and the doc_id: wrong tokens are never returned.
Every file is written complete or not at all (:func:`~balanced_loader.data.files.atomic_write`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tarfile
import threading
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

from balanced_loader.data.files import atomic_write, write_error, write_json
from balanced_loader.data.integrity import (
    CHECK_BLOCK_BYTES,
    NPY_HEADER_GUESS,
    TAR_BLOCK,
    CrcFile,
    block_crcs,
    check_member,
    lengths_fingerprint,
    num_blocks,
)
from balanced_loader.data.sources import Source

log = logging.getLogger("balanced_loader")

META_FILE = "shards.json"
META_FORMAT = "balanced-loader/shards"
CRC_FILE = "shards.crc.npy"
INDEX_FILE = "index.json"
INDEX_FORMAT = "balanced-loader/shard-index"
INDEX_VERSION = 1
_ARRAYS = ("lengths", "shard", "offset")
TOKEN_EXT = ".npy"
VERIFY_MODES = ("full", "header", "off")


def _array_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"index.{name}.npy")


def _check_token_dtype(dtype: Any, where: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "u" or dt.itemsize not in (1, 2, 4):
        raise ValueError(f"{where}: token dtype must be uint8, uint16 or uint32, got {dt}")
    return dt.newbyteorder("<")


def _save_array(path: str, arr: np.ndarray) -> None:
    with atomic_write(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


class _Abort(Exception):
    """Thrown into an open :func:`atomic_write` to discard its temporary file."""


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


class ShardWriter:
    """Writes docs into numbered tar shards, then the checksums and the length index (``close()``).

    A shard is written to a temporary file and renamed when full, so a folder never holds a
    half-written ``.tar``; the index is written last, so its presence means the folder is
    complete. A failure (an exception inside ``with``, a full disk) removes every file this
    writer made, so a failed build leaves no shards that could be indexed as a partial dataset.
    """

    def __init__(self, out_dir: str, *, dtype: Any, tokenizer: dict[str, Any] | None = None,
                 max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                 prefix: str = "shard", check_block_bytes: int = CHECK_BLOCK_BYTES) -> None:
        if max_shard_bytes < 1 or max_docs_per_shard < 1:
            raise ValueError("max_shard_bytes and max_docs_per_shard must be >= 1")
        if not 64 <= check_block_bytes <= 1 << 30:
            raise ValueError(f"check_block_bytes must be in 64..2**30, got {check_block_bytes}")
        self.check_block_bytes = int(check_block_bytes)
        self.out_dir = out_dir
        self.dtype = _check_token_dtype(dtype, "shard writer")
        self.tokenizer = tokenizer
        self.max_shard_bytes = int(max_shard_bytes)
        self.max_docs_per_shard = int(max_docs_per_shard)
        self.prefix = prefix
        os.makedirs(out_dir, exist_ok=True)
        existing = [f for f in os.listdir(out_dir) if f.endswith(".tar") or f in (INDEX_FILE, META_FILE)]
        if existing:
            raise ValueError(f"{out_dir} already holds shards ({sorted(existing)[0]} ...); "
                             f"choose an empty folder or remove them first")
        self.shards: list[dict[str, Any]] = []
        self.num_docs = 0
        self.num_tokens = 0
        self._tar: tarfile.TarFile | None = None
        self._file: contextlib.ExitStack | None = None  # the open atomic_write of the current shard
        self._crc_file: CrcFile | None = None
        self._crcs: list[np.ndarray] = []  # per doc: [1 + blocks] uint32, whole doc then blocks
        self._written: list[str] = []  # files this writer completed (removed again on failure)
        self._docs = 0
        self._bytes = 0

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        stack = contextlib.ExitStack()
        f = stack.enter_context(atomic_write(os.path.join(self.out_dir, name), "wb"))
        self._file = stack
        self._crc_file = CrcFile(f)
        self._tar = tarfile.open(fileobj=self._crc_file, mode="w", format=tarfile.GNU_FORMAT)  # noqa: SIM115
        self._docs = 0
        self._bytes = 0
        self.shards.append({"name": name, "docs": 0, "bytes": 0})

    def _finish(self) -> None:
        if self._tar is None:
            return
        assert self._file is not None and self._crc_file is not None
        path = os.path.join(self.out_dir, self.shards[-1]["name"])
        try:
            self._tar.close()  # the end-of-archive blocks (may fail: disk full)
        except OSError as e:
            self._discard()
            raise write_error(path, e) from None
        except BaseException:
            self._discard()
            raise
        self._tar = None
        stack, self._file = self._file, None
        stack.close()  # fsync and rename; on failure atomic_write removed the temporary file
        self._written.append(path)
        self.shards[-1].update(docs=self._docs, bytes=self._crc_file.size, crc32=self._crc_file.crc)

    def _discard(self) -> None:
        """Drop the shard being written (its temporary file) and every file already completed."""
        self._tar = None
        if self._file is not None:
            stack, self._file = self._file, None
            with contextlib.suppress(_Abort):
                stack.__exit__(_Abort, _Abort(), None)
        for path in self._written:
            with contextlib.suppress(OSError):
                os.remove(path)
        self._written.clear()

    def add(self, tokens: Any) -> int:
        """Append one doc; returns its doc_id."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"doc {self.num_docs}: tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0
                             or int(arr.max()) > np.iinfo(self.dtype).max):
                raise ValueError(f"doc {self.num_docs}: token ids do not fit {self.dtype}")
            arr = arr.astype(self.dtype)
        arr = np.ascontiguousarray(arr)
        buf = io.BytesIO()
        np.lib.format.write_array(buf, arr, version=(1, 0), allow_pickle=False)
        payload = buf.getvalue()
        if self._tar is not None and self._docs and (
                self._bytes + len(payload) + 512 > self.max_shard_bytes or self._docs >= self.max_docs_per_shard):
            self._finish()
        if self._tar is None:
            self._open()
        info = tarfile.TarInfo(f"{self.num_docs:010d}{TOKEN_EXT}")
        info.size = len(payload)
        info.mtime = 0
        info.mode = 0o644
        assert self._tar is not None
        try:
            self._tar.addfile(info, io.BytesIO(payload))
        except OSError as e:  # the with-block's exit removes this writer's files
            raise write_error(os.path.join(self.out_dir, self.shards[-1]["name"]), e) from None
        raw = memoryview(arr).cast("B")
        doc_crc = np.array([zlib.crc32(raw)], dtype=np.uint32)
        self._crcs.append(np.concatenate([doc_crc, block_crcs(raw, self.check_block_bytes)]))
        self._docs += 1
        self._bytes += len(payload) + 512
        self.num_docs += 1
        self.num_tokens += len(arr)
        return self.num_docs - 1

    def close(self) -> dict[str, Any]:
        """Finish the last shard, write the checksums, ``shards.json`` and the length index; returns
        the metadata. On failure every file of this writer is removed."""
        try:
            self._finish()
            crcs = np.concatenate(self._crcs) if self._crcs else np.zeros(0, dtype=np.uint32)
            _save_array(os.path.join(self.out_dir, CRC_FILE), crcs)
            self._written.append(os.path.join(self.out_dir, CRC_FILE))
            meta = {"format": META_FORMAT, "version": INDEX_VERSION, "dtype": self.dtype.str,
                    "tokenizer": self.tokenizer, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                    "check_block_bytes": self.check_block_bytes, "shards": self.shards}
            write_json(os.path.join(self.out_dir, META_FILE), meta, indent=1)
            self._written.append(os.path.join(self.out_dir, META_FILE))
            self._written += [_array_path(self.out_dir, k) for k in (*_ARRAYS, "crc_start")]
            self._written.append(os.path.join(self.out_dir, INDEX_FILE))
            build_index(self.out_dir)
        except BaseException:
            self._discard()
            raise
        return meta

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._discard()


# ---------------------------------------------------------------------------------------------
# The length index
# ---------------------------------------------------------------------------------------------


def _scan_shard(path: str, first_doc: int) -> tuple[np.ndarray, np.ndarray, np.dtype | None, bool]:
    """Lengths and token-data offsets (``[docs]`` each) of one tar, reading only headers, and
    whether every member is named by its doc_id (``first_doc`` + member index)."""
    size = os.path.getsize(path)
    lengths: list[int] = []
    offsets: list[int] = []
    dtype: np.dtype | None = None
    named = True
    try:
        with tarfile.open(path, "r:") as tar, open(path, "rb") as f:
            for m in tar:
                if not m.isfile() or not m.name.endswith(TOKEN_EXT):
                    continue
                if m.offset_data + m.size > size:
                    raise ValueError(f"member {m.name} ends past the end of the file (truncated)")
                f.seek(m.offset_data)
                try:
                    major, _ = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if major == 1
                                   else np.lib.format.read_array_header_2_0)
                    shape, fortran, dt = read_header(f)
                except ValueError as e:
                    raise ValueError(f"member {m.name} is not a .npy array ({e})") from None
                if len(shape) != 1:
                    raise ValueError(f"member {m.name} holds shape {shape}; token arrays must be 1-D")
                dt = _check_token_dtype(dt, f"member {m.name}")
                if dtype is None:
                    dtype = dt
                elif dt != dtype:
                    raise ValueError(f"member {m.name} has dtype {dt}, earlier docs {dtype}")
                data = f.tell()
                if data - m.offset_data + shape[0] * dt.itemsize != m.size:
                    raise ValueError(f"member {m.name}: {m.size} bytes do not match its header")
                named = named and m.name == f"{first_doc + len(lengths):010d}{TOKEN_EXT}"
                lengths.append(shape[0])
                offsets.append(data)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"shard {path} is not a readable tar file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"shard {path} is corrupt: {e}") from None
    return np.asarray(lengths, dtype=np.int64), np.asarray(offsets, dtype=np.int64), dtype, named


def list_shards(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".tar"))


def _writer_checksums(folder: str, meta: dict[str, Any] | None, lengths: np.ndarray, itemsize: int
                      ) -> tuple[np.ndarray | None, int | None]:
    """``(crc_start [num_docs + 1] int64, block bytes)`` when the writer left checksums for these docs
    (per doc: one whole-doc crc32, then one per block)."""
    path = os.path.join(folder, CRC_FILE)
    if meta is None or "check_block_bytes" not in meta or not os.path.exists(path):
        return None, None
    block = int(meta["check_block_bytes"])
    start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(1 + num_blocks(lengths * itemsize, block), out=start[1:])
    try:
        crcs = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"checksum file {path} cannot be read ({e}); rebuild the shards") from None
    if crcs.dtype != np.uint32 or crcs.ndim != 1 or len(crcs) != start[-1]:
        raise ValueError(f"checksum file {path} holds {len(crcs)} checksums but the shards' docs need "
                         f"{int(start[-1])}: the shards or {CRC_FILE} were changed; rebuild the shards")
    return start, block


def build_index(folder: str, *, write: bool = True, progress: bool = False) -> dict[str, Any]:
    """Scan every ``*.tar`` of a folder (headers only) and write the length index.

    Checks each shard against ``shards.json`` when the writer left one, and takes the writer's
    checksums. Returns the index JSON; with ``write=False`` the arrays come back under
    ``"_arrays"`` instead of files.
    """
    names = list_shards(folder)
    if not names:
        raise ValueError(f"{folder} holds no .tar shards; build them with balanced-loader build-shards")
    meta = read_index_json(os.path.join(folder, META_FILE)) if os.path.exists(os.path.join(folder, META_FILE)) \
        else None
    expected = {s["name"]: s for s in meta["shards"]} if meta else {}
    for name in expected:
        if name not in names:
            raise ValueError(f"shard {os.path.join(folder, name)} listed in {META_FILE} is missing")
    it = names
    if progress:
        from tqdm import tqdm

        it = tqdm(names, desc="indexing shards", unit="shard")
    lengths, shard_of, offsets, shards = [], [], [], []
    dtype: np.dtype | None = None
    named = True
    first = 0
    for i, name in enumerate(it):
        path = os.path.join(folder, name)
        ln, off, dt, nm = _scan_shard(path, first)
        first += len(ln)
        named = named and nm
        nbytes = os.path.getsize(path)
        if name in expected and (expected[name]["docs"] != len(ln) or expected[name]["bytes"] != nbytes):
            raise ValueError(f"shard {path} is corrupt: {len(ln)} docs / {nbytes} bytes, but {META_FILE} "
                             f"recorded {expected[name]['docs']} docs / {expected[name]['bytes']} bytes")
        if dt is not None:
            if dtype is not None and dt != dtype:
                raise ValueError(f"shard {path} stores {dt} tokens, earlier shards {dtype}")
            dtype = dt
        lengths.append(ln)
        offsets.append(off)
        shard_of.append(np.full(len(ln), i, dtype=np.int32))
        entry = {"name": name, "docs": len(ln), "bytes": nbytes}
        if "crc32" in expected.get(name, {}):
            entry["crc32"] = int(expected[name]["crc32"])
        shards.append(entry)
    if dtype is None:
        raise ValueError(f"{folder}: no shard holds a {TOKEN_EXT} token member")
    arrays = {"lengths": np.concatenate(lengths), "shard": np.concatenate(shard_of), "offset": np.concatenate(offsets)}
    checked = meta is not None and len(expected) == len(names)  # the writer's checksums cover every shard
    crc_start, block = _writer_checksums(folder, meta, arrays["lengths"], dtype.itemsize) if checked else (None, None)
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": dtype.str,
             "tokenizer": meta.get("tokenizer") if meta else None,
             "num_docs": int(len(arrays["lengths"])), "num_tokens": int(arrays["lengths"].sum()),
             "lengths_fingerprint": lengths_fingerprint(arrays["lengths"]),
             "member_names": "doc_id" if named else "any",
             "check_block_bytes": block, "shards": shards}
    if crc_start is not None:
        arrays["crc_start"] = crc_start
    if not write:
        index["_arrays"] = arrays
        return index
    for k, arr in arrays.items():
        _save_array(_array_path(folder, k), arr)
    write_json(os.path.join(folder, INDEX_FILE), index, indent=1)
    return index


def read_index_json(path: str) -> dict[str, Any]:
    """``index.json`` or ``shards.json`` of a shard folder; one ``ValueError`` when unreadable."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not JSON ({type(e).__name__}); delete it to rebuild the index") from None
    if not isinstance(d, dict) or d.get("format") not in (INDEX_FORMAT, META_FORMAT):
        raise ValueError(f"{path} is not a balanced-loader shard index; delete it to rebuild the index")
    if d.get("version") != INDEX_VERSION:
        raise ValueError(f"{path} has version {d.get('version')}, this reader knows {INDEX_VERSION}; "
                         f"delete it to rebuild the index")
    return d


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


class ShardSource(Source):
    """A shard folder: memory-mapped length index and one checked ``pread`` per token range.

    The index is built on first open when missing (or when the folder gained shards).
    A listed shard that is missing or changed size is one ``ValueError`` naming the file.
    ``verify``: ``"full"`` (default: member headers once per doc, block checksums on every
    read), ``"header"`` (headers only) or ``"off"``. Folders written before checksums existed
    are read with the header check. File handles are cached (at most ``max_open_files``);
    reads are thread-safe.
    """

    def __init__(self, folder: str, *, max_open_files: int = 64, progress: bool = False,
                 verify: str = "full") -> None:
        self.folder = os.fspath(folder)
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.verify = verify
        if not os.path.isdir(self.folder):
            raise ValueError(f"shard folder {self.folder} does not exist")
        self.max_open_files = max_open_files
        index_path = os.path.join(self.folder, INDEX_FILE)
        index = read_index_json(index_path) if os.path.exists(index_path) else None
        if index is not None and index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{index_path} is not a shard index; delete it to rebuild the index")
        if index is not None:
            listed = {s["name"] for s in index["shards"]}
            for s in index["shards"]:
                path = os.path.join(self.folder, s["name"])
                if not os.path.exists(path):
                    raise ValueError(f"shard {path} listed in the index is missing; restore it, or delete "
                                     f"{index_path} to re-index the remaining shards")
                size = os.path.getsize(path)
                if size != s["bytes"]:
                    raise ValueError(f"shard {path} has {size} bytes but the index recorded {s['bytes']}: "
                                     f"it is truncated or was rewritten; rebuild it, or delete {index_path}")
            if set(list_shards(self.folder)) != listed:
                log.info("%s: the set of shards changed; rebuilding the length index", self.folder)
                index = None
        arrays: dict[str, np.ndarray] | None = None
        if index is None:
            writable = os.access(self.folder, os.W_OK)
            index = build_index(self.folder, write=writable, progress=progress)
            if not writable:
                log.warning("%s is read-only: the length index is kept in memory", self.folder)
                arrays = index.pop("_arrays")
        if arrays is None:
            arrays = {}
            for k in (*_ARRAYS, "crc_start") if index.get("check_block_bytes") else _ARRAYS:
                try:
                    arrays[k] = np.load(_array_path(self.folder, k), mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as e:
                    raise ValueError(f"index file {_array_path(self.folder, k)} cannot be read ({e}); "
                                     f"delete {index_path} to rebuild the index") from None
        n = int(index["num_docs"])
        if any(len(arrays[k]) != n for k in _ARRAYS) or ("crc_start" in arrays and len(arrays["crc_start"]) != n + 1):
            raise ValueError(f"the index arrays of {self.folder} do not match {INDEX_FILE}; "
                             f"delete {index_path} to rebuild the index")
        self.index = index
        self.dtype = _check_token_dtype(index["dtype"], index_path)
        self.tokenizer = index.get("tokenizer")
        self.shard_names = [s["name"] for s in index["shards"]]
        # plain ndarray views of the memory maps (np.memmap's Python-level indexing is slow)
        self.lengths = np.asarray(arrays["lengths"])  # [num_docs] int64, memory-mapped
        self._shard = np.asarray(arrays["shard"])  # [num_docs] int32, memory-mapped
        self._offset = np.asarray(arrays["offset"])  # [num_docs] int64, memory-mapped
        self._crc_start: np.ndarray | None = None  # [num_docs + 1] int64 where each doc's checksums start
        self._crc: np.ndarray | None = None  # [num_docs + num_blocks] uint32: per doc, whole doc then blocks
        self._block = int(index.get("check_block_bytes") or 0)
        if "crc_start" in arrays:
            self._crc_start = np.asarray(arrays["crc_start"])
            crc_path = os.path.join(self.folder, CRC_FILE)
            try:
                self._crc = np.asarray(np.load(crc_path, mmap_mode="r", allow_pickle=False))
            except (OSError, ValueError) as e:
                raise ValueError(f"checksum file {crc_path} cannot be read ({e}); rebuild the shards") from None
            if len(self._crc) != int(self._crc_start[-1]):
                raise ValueError(f"checksum file {crc_path} does not match {INDEX_FILE}; rebuild the shards")
        self._names_are_ids = index.get("member_names") == "doc_id"
        self._header_ok: np.ndarray | None = None  # [num_docs] bool, docs whose headers were checked
        self.shard_bounds = np.concatenate([[0], np.cumsum([s["docs"] for s in index["shards"]])]).astype(np.int64)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_read = 0
        self._fingerprint: str | None = index.get("lengths_fingerprint")

    def describe(self) -> str:
        return f"shard folder {self.folder}"

    @property
    def num_tokens(self) -> int:
        return int(self.index["num_tokens"])

    @property
    def has_checksums(self) -> bool:
        return self._crc is not None

    def index_arrays(self) -> dict[str, np.ndarray]:
        """The memory-mapped index: ``lengths`` [num_docs] int64, ``shard`` [num_docs] int32,
        ``offset`` [num_docs] int64."""
        return {"lengths": self.lengths, "shard": self._shard, "offset": self._offset}

    def shard_path(self, shard: int) -> str:
        return os.path.join(self.folder, self.shard_names[shard])

    def location(self, doc_id: int) -> tuple[str, int]:
        """(shard path, byte offset of the doc's token data)."""
        d = self._check_doc(doc_id)
        return self.shard_path(int(self._shard[d])), int(self._offset[d])

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        path = self.shard_path(shard)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ValueError(f"shard {path} cannot be opened: {e.strerror}") from None
        self._fds[shard] = fd
        while len(self._fds) > self.max_open_files:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _pread(self, shard: int, n: int, off: int) -> bytes:
        with self._lock:
            buf = os.pread(self._fd(shard), n, off)
            self.bytes_read += len(buf)
        return buf

    def _mismatch(self, d: int, shard: int, what: str) -> ValueError:
        return ValueError(f"shard {self.shard_path(shard)} does not match the index at doc {d}: {what}; "
                          f"the shard or the index was changed, rebuild the shards (balanced-loader verify "
                          f"{self.folder} lists every problem)")

    def _check_header(self, d: int, shard: int, base: int) -> None:
        """The tar and ``.npy`` headers in front of the doc's token data agree with the index."""
        n = int(self.lengths[d])
        name = f"{d:010d}{TOKEN_EXT}" if self._names_are_ids else None
        for before in (TAR_BLOCK + NPY_HEADER_GUESS, TAR_BLOCK + 4096):  # numpy's usual header, then a wider look
            lo = max(0, base - before)
            window = self._pread(shard, base - lo, lo)
            try:
                check_member(window, lo, data_offset=base, length=n, dtype=self.dtype, name=name)
                return
            except ValueError as e:
                err = e
            if lo == 0:
                break
        raise self._mismatch(d, shard, str(err))

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        item = self.dtype.itemsize
        shard = int(self._shard[d])
        base = int(self._offset[d])
        if self.verify != "off":
            if self._header_ok is None:
                self._header_ok = np.zeros(self.num_docs, dtype=bool)
            if not self._header_ok[d]:
                self._check_header(d, shard, base)
                self._header_ok[d] = True
        lo, hi = start * item, (start + length) * item  # bytes of the doc's token data
        crc = self._crc is not None and self.verify == "full" and hi > lo
        if crc:
            b = self._block
            nbytes = int(self.lengths[d]) * item
            k0, k1 = self._crc_start[d:d + 2].tolist()
            if k1 - k0 - 1 != -(-nbytes // b):
                raise self._mismatch(d, shard, f"its length {nbytes // item} disagrees with its checksums")
            whole = lo == 0 and hi == nbytes  # the whole doc: one crc32 call
            if not whole:  # widen to whole checksum blocks
                first, last = lo // b, -(-hi // b)
                lo, hi = first * b, min(last * b, nbytes)
        buf = self._pread(shard, hi - lo, base + lo)
        if len(buf) != hi - lo:
            raise ValueError(f"shard {self.shard_path(shard)} is truncated: doc {d} needs bytes "
                             f"[{base + lo}, {base + hi}) but the file ends first")
        if crc and whole:
            if zlib.crc32(buf) != int(self._crc[k0]):
                raise self._mismatch(d, shard, "the checksum of its token bytes differs (the token data is corrupt)")
        elif crc:  # a plain loop: reads cover few blocks, and numpy calls would cost more than the crc32s
            mv = memoryview(buf)
            for i, want in enumerate(self._crc[k0 + 1 + first:k0 + 1 + last].tolist()):
                if zlib.crc32(mv[i * b:(i + 1) * b]) != want:
                    at = (first + i) * b
                    raise self._mismatch(d, shard, f"the checksum of token bytes [{at}, {min(at + b, hi)}) "
                                                   f"differs (the token data is corrupt)")
        skip = start * item - lo
        return np.frombuffer(buf, dtype=self.dtype, count=length, offset=skip)  # [length]

    def fingerprint(self) -> str:
        """The lengths fingerprint recorded in ``index.json`` at build time (computed for older indexes)."""
        if self._fingerprint is None:
            self._fingerprint = lengths_fingerprint(self.lengths)
        return self._fingerprint

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])

    def __del__(self) -> None:
        fds = getattr(self, "_fds", None)
        while fds:
            os.close(fds.popitem()[1])

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "max_open_files": self.max_open_files, "verify": self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], max_open_files=state["max_open_files"],  # type: ignore[misc]
                      verify=state.get("verify", "full"))


def write_shards(docs: Any, out_dir: str, *, dtype: Any = np.uint16, tokenizer: dict[str, Any] | None = None,
                 **kw: Any) -> ShardSource:
    """Write an iterable of token arrays as a shard folder and open it (for tests and tools)."""
    with ShardWriter(out_dir, dtype=dtype, tokenizer=tokenizer, **kw) as w:
        for toks in docs:
            w.add(toks)
    return ShardSource(out_dir)
