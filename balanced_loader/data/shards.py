"""Webdataset shards of tokenized docs, their length index, and random-access reads.

Layout of a shard folder::

    shard-000000.tar ...   plain tar; one member ``<key>.npy`` per doc (``key`` = 10-digit doc_id),
                           a 1-D little-endian unsigned array of token ids; readable by
                           ``webdataset.WebDataset(urls).decode()`` as sample["npy"]
    shards.json            written by the writer: tokenizer identity, dtype, docs and bytes per shard
    index.json             the length index: shard list (name, docs, bytes), dtype, tokenizer
    index.lengths.npy      [num_docs] int64 tokens per doc         (memory-mapped on open)
    index.shard.npy        [num_docs] int32 shard of each doc      (memory-mapped on open)
    index.offset.npy       [num_docs] int64 byte offset of the doc's token data inside its tar

doc_ids run in shard order, then member order, so the docs of shard ``s`` are
``shard_bounds[s]:shard_bounds[s + 1]``. A tar member's data is contiguous, so tokens
``[a, b)`` of a doc are one ``pread`` of ``(b - a) * itemsize`` bytes at ``offset + a * itemsize``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from balanced_loader.data.sources import Source, jsonl_text

log = logging.getLogger("balanced_loader")

META_FILE = "shards.json"
META_FORMAT = "balanced-loader/shards"
INDEX_FILE = "index.json"
INDEX_FORMAT = "balanced-loader/shard-index"
INDEX_VERSION = 1
_ARRAYS = ("lengths", "shard", "offset")
TOKEN_EXT = ".npy"


def _array_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"index.{name}.npy")


def _check_token_dtype(dtype: Any, where: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "u" or dt.itemsize not in (1, 2, 4):
        raise ValueError(f"{where}: token dtype must be uint8, uint16 or uint32, got {dt}")
    return dt.newbyteorder("<")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


class ShardWriter:
    """Writes docs into numbered tar shards, then the length index (``close()``).

    A shard is written under a temporary name and renamed when full, so a folder never
    holds a half-written ``.tar``; the index is written last, so its presence means the
    folder is complete.
    """

    def __init__(self, out_dir: str, *, dtype: Any, tokenizer: dict[str, Any] | None = None,
                 max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                 prefix: str = "shard") -> None:
        if max_shard_bytes < 1 or max_docs_per_shard < 1:
            raise ValueError("max_shard_bytes and max_docs_per_shard must be >= 1")
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
        self._tmp = ""
        self._docs = 0
        self._bytes = 0

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._tmp = os.path.join(self.out_dir, name + ".tmp")
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.GNU_FORMAT)  # noqa: SIM115 (closed in _finish)
        self._docs = 0
        self._bytes = 0
        self.shards.append({"name": name, "docs": 0, "bytes": 0})

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None
        final = self._tmp[: -len(".tmp")]
        os.replace(self._tmp, final)
        self.shards[-1].update(docs=self._docs, bytes=os.path.getsize(final))

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
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.ascontiguousarray(arr), version=(1, 0), allow_pickle=False)
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
        self._tar.addfile(info, io.BytesIO(payload))
        self._docs += 1
        self._bytes += len(payload) + 512
        self.num_docs += 1
        self.num_tokens += len(arr)
        return self.num_docs - 1

    def close(self) -> dict[str, Any]:
        """Finish the last shard, write ``shards.json`` and the length index; returns the metadata."""
        self._finish()
        meta = {"format": META_FORMAT, "version": INDEX_VERSION, "dtype": self.dtype.str,
                "tokenizer": self.tokenizer, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                "shards": self.shards}
        _write_json(os.path.join(self.out_dir, META_FILE), meta)
        build_index(self.out_dir)
        return meta

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._tar is not None:
            self._tar.close()
            self._tar = None
            os.remove(self._tmp)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The length index
# ---------------------------------------------------------------------------------------------


def _scan_shard(path: str) -> tuple[np.ndarray, np.ndarray, np.dtype | None]:
    """Lengths and token-data offsets (``[docs]`` each) of one tar, reading only headers."""
    size = os.path.getsize(path)
    lengths: list[int] = []
    offsets: list[int] = []
    dtype: np.dtype | None = None
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
                lengths.append(shape[0])
                offsets.append(data)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"shard {path} is not a readable tar file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"shard {path} is corrupt: {e}") from None
    return np.asarray(lengths, dtype=np.int64), np.asarray(offsets, dtype=np.int64), dtype


def list_shards(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".tar"))


def build_index(folder: str, *, write: bool = True, progress: bool = False) -> dict[str, Any]:
    """Scan every ``*.tar`` of a folder (headers only) and write the length index.

    Checks each shard against ``shards.json`` when the writer left one. Returns the index
    JSON; with ``write=False`` the arrays come back under ``"_arrays"`` instead of files.
    """
    names = list_shards(folder)
    if not names:
        raise ValueError(f"{folder} holds no .tar shards; build them with balanced-loader build-shards")
    meta = _read_json(os.path.join(folder, META_FILE)) if os.path.exists(os.path.join(folder, META_FILE)) else None
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
    for i, name in enumerate(it):
        path = os.path.join(folder, name)
        ln, off, dt = _scan_shard(path)
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
        shards.append({"name": name, "docs": len(ln), "bytes": nbytes})
    if dtype is None:
        raise ValueError(f"{folder}: no shard holds a {TOKEN_EXT} token member")
    arrays = {"lengths": np.concatenate(lengths), "shard": np.concatenate(shard_of), "offset": np.concatenate(offsets)}
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": dtype.str,
             "tokenizer": meta.get("tokenizer") if meta else None,
             "num_docs": int(len(arrays["lengths"])), "num_tokens": int(arrays["lengths"].sum()),
             "shards": shards}
    if not write:
        index["_arrays"] = arrays
        return index
    for k in _ARRAYS:
        tmp = _array_path(folder, k) + ".tmp"
        with open(tmp, "wb") as f:
            np.save(f, arrays[k], allow_pickle=False)
        os.replace(tmp, _array_path(folder, k))
    _write_json(os.path.join(folder, INDEX_FILE), index)
    return index


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); delete it to rebuild the index") from None
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
    """A shard folder: memory-mapped length index and one ``pread`` per token range.

    The index is built on first open when missing (or when the folder gained shards).
    A listed shard that is missing or changed size is one ``ValueError`` naming the file.
    File handles are cached (at most ``max_open_files``); reads are thread-safe.
    """

    def __init__(self, folder: str, *, max_open_files: int = 64, progress: bool = False) -> None:
        self.folder = os.fspath(folder)
        if not os.path.isdir(self.folder):
            raise ValueError(f"shard folder {self.folder} does not exist")
        self.max_open_files = max_open_files
        index_path = os.path.join(self.folder, INDEX_FILE)
        index = _read_json(index_path) if os.path.exists(index_path) else None
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
            for k in _ARRAYS:
                try:
                    arrays[k] = np.load(_array_path(self.folder, k), mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as e:
                    raise ValueError(f"index file {_array_path(self.folder, k)} cannot be read ({e}); "
                                     f"delete {index_path} to rebuild the index") from None
        n = int(index["num_docs"])
        if any(len(arrays[k]) != n for k in _ARRAYS):
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
        self.shard_bounds = np.concatenate([[0], np.cumsum([s["docs"] for s in index["shards"]])]).astype(np.int64)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_read = 0

    def describe(self) -> str:
        return f"shard folder {self.folder}"

    @property
    def num_tokens(self) -> int:
        return int(self.index["num_tokens"])

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

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        item = self.dtype.itemsize
        n = length * item
        shard = int(self._shard[d])
        off = int(self._offset[d]) + start * item
        with self._lock:
            fd = self._fd(shard)
            buf = os.pread(fd, n, off)
            self.bytes_read += n
        if len(buf) != n:
            raise ValueError(f"shard {self.shard_path(shard)} is truncated: doc {d} needs bytes "
                             f"[{off}, {off + n}) but the file ends first")
        return np.frombuffer(buf, dtype=self.dtype)  # [length]

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])

    def __del__(self, _close: Any = os.close) -> None:
        # may run at interpreter exit, when module globals (os, contextlib) are gone: os.close is bound
        # as a default argument and errors are not reported
        fds = getattr(self, "_fds", None)
        while fds:
            try:  # noqa: SIM105 - contextlib may already be torn down
                _close(fds.popitem()[1])
            except Exception:
                pass

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "max_open_files": self.max_open_files}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], max_open_files=state["max_open_files"])  # type: ignore[misc]


def write_shards(docs: Any, out_dir: str, *, dtype: Any = np.uint16, tokenizer: dict[str, Any] | None = None,
                 **kw: Any) -> ShardSource:
    """Write an iterable of token arrays as a shard folder and open it (for tests and tools)."""
    with ShardWriter(out_dir, dtype=dtype, tokenizer=tokenizer, **kw) as w:
        for toks in docs:
            w.add(toks)
    return ShardSource(out_dir)


# ---------------------------------------------------------------------------------------------
# Files to shards
# ---------------------------------------------------------------------------------------------


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
    from balanced_loader.data.tokenizers import get_tokenizer, token_dtype

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
    return _read_json(os.path.join(out_dir, META_FILE))
