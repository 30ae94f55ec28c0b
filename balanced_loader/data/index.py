"""The length index of a shard folder: ``index.json`` and its arrays, streamed by the writer, or scanned
from the tar headers by the explicit ``balanced-loader index DIR`` (:mod:`.reindex`); never built
implicitly on open: :func:`index_problems` lists how an index disagrees with its folder, and a reader
refuses such a folder naming the fix (:func:`reindex_hint`).

See :mod:`balanced_loader.data.shards` for the folder layout. Scanning (:func:`build_index`) reads
only the tar and ``.npy`` headers; the writer's checksums (``shards.crc.npy``) are taken over when
they cover every shard, and the lengths fingerprint is recorded for loader states. The writer
(:class:`IndexWriter`) knows every doc's length, shard and data offset as it writes, so it streams
the same arrays to their files (byte-identical to a scan) instead of reading its tars again.
"""

from __future__ import annotations

import json
import os
import tarfile
from typing import Any

import numpy as np

from balanced_loader.data.integrity import lengths_fingerprint, num_blocks
from balanced_loader.data.members import numpy_header
from balanced_loader.outputs.files import AtomicFile, atomic_write, write_json

META_FILE = "shards.json"
META_FORMAT = "balanced-loader/shards"
CRC_FILE = "shards.crc.npy"
INDEX_FILE = "index.json"
INDEX_FORMAT = "balanced-loader/shard-index"
INDEX_VERSION = 1
ARRAYS = ("lengths", "shard", "offset")
TOKEN_EXT = ".npy"
META_COPIED = ("part", "inputs")  # keys of shards.json that the index carries over


def reindex_hint(folder: str) -> str:
    """The fix named by every index error of a local folder."""
    return (f"rebuild the index with: balanced-loader index {folder} (it checks every shard against the "
            f"checksums the build recorded)")

def array_name(name: str) -> str:
    """The file name of index array ``name`` (``lengths``, ``shard``, ``offset``, ``crc_start``)."""
    return f"index.{name}.npy"


def array_path(folder: str, name: str) -> str:
    return os.path.join(folder, array_name(name))


def check_token_dtype(dtype: Any, where: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "u" or dt.itemsize not in (1, 2, 4):
        raise ValueError(f"{where}: token dtype must be uint8, uint16 or uint32, got {dt}")
    return dt.newbyteorder("<")


def save_array(path: str, arr: np.ndarray) -> None:
    with atomic_write(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


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
                dt = check_token_dtype(dt, f"member {m.name}")
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


def build_index(folder: str, *, write: bool = True, progress: bool = False,
                max_token_id: int | None = None) -> dict[str, Any]:
    """Scan every ``*.tar`` of a folder (headers only) and write the length index.

    Checks each shard against ``shards.json`` when the writer left one, and takes the writer's
    checksums. Returns the index JSON; with ``write=False`` the arrays come back under
    ``"_arrays"`` instead of files. ``max_token_id``: the largest token id, when the caller read the
    tokens (:mod:`.reindex`); a scan reads headers only. Only ``balanced-loader index`` (through
    :func:`.reindex.reindex_folder`) writes a scanned index; readers never do.
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
    index = index_json(dtype=dtype, meta=meta, num_docs=len(arrays["lengths"]),
                       num_tokens=int(arrays["lengths"].sum()), fingerprint=lengths_fingerprint(arrays["lengths"]),
                       named=named, block=block, shards=shards, max_token_id=max_token_id)
    if crc_start is not None:
        arrays["crc_start"] = crc_start
    if not write:
        index["_arrays"] = arrays
        return index
    for k, arr in arrays.items():
        save_array(array_path(folder, k), arr)
    write_json(os.path.join(folder, INDEX_FILE), index, indent=1)
    return index


def index_json(*, dtype: np.dtype, meta: dict[str, Any] | None, num_docs: int, num_tokens: int, fingerprint: str,
               named: bool, block: int | None, shards: list[dict[str, Any]],
               max_token_id: int | None = None) -> dict[str, Any]:
    """The JSON of ``index.json`` (one function for the scan and the writer: the same keys in the same order).

    ``max_token_id``: the largest token id in the data (None: not read), which a trainer checks
    against its model's vocabulary before any step."""
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": dtype.str,
             "tokenizer": meta.get("tokenizer") if meta else None,
             "num_docs": int(num_docs), "num_tokens": int(num_tokens), "lengths_fingerprint": fingerprint,
             "member_names": "doc_id" if named else "any", "check_block_bytes": block,
             "max_token_id": None if max_token_id is None or max_token_id < 0 else int(max_token_id),
             "shards": shards}
    for key in META_COPIED:  # what build-shards recorded about the build (part K/N, the input set)
        if meta and key in meta:
            index[key] = meta[key]
    return index


class NpyStream:
    """A 1-D ``.npy`` file written in pieces (its length unknown until the end), complete or not at all.

    A placeholder header goes first and the real one over it at ``commit()``: numpy's 1.0 header of
    a 1-D array is 128 bytes for any length (its dict is padded to 64-byte alignment), so the
    file is byte-identical to ``np.save`` of the whole array.
    """

    def __init__(self, path: str, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.n = 0
        self._out = AtomicFile(path)
        self._head = len(numpy_header(self.dtype, 0))
        self._out.file.write(b"\0" * self._head)

    @property
    def path(self) -> str:
        return self._out.path

    def write(self, values: Any) -> None:
        arr = np.ascontiguousarray(values, dtype=self.dtype)  # [k]
        self._out.file.write(arr.data)
        self.n += len(arr)

    def commit(self) -> None:
        head = numpy_header(self.dtype, self.n)
        assert len(head) == self._head, (len(head), self._head)  # see the class doc
        f = self._out.file
        f.seek(0)
        f.write(head)
        self._out.commit()

    def discard(self) -> None:
        self._out.discard()


class IndexWriter:
    """The index arrays of a folder being written, streamed to their files (``index.*.npy``) as docs arrive:
    memory is a buffer of ``CHUNK`` docs (a few MB of Python ints) whatever the number of docs; the disk
    takes 28 bytes per doc, as for a scanned index (no second copy: the buffers go to the files' own
    temporary files, renamed at ``commit``).

    ``add`` per doc (its length, shard, data offset and number of checksums); ``commit`` renames the
    arrays into place and writes ``index.json``: the same bytes as :func:`build_index` scanning the tars.
    """

    CHUNK = 1 << 16

    def __init__(self, folder: str) -> None:
        self.folder = folder
        kinds = {"lengths": np.int64, "shard": np.int32, "offset": np.int64, "crc_start": np.int64}
        self._streams: dict[str, NpyStream] = {}
        try:
            for k, dt in kinds.items():
                self._streams[k] = NpyStream(array_path(folder, k), dt)
        except BaseException:
            self.discard()
            raise
        self._streams["crc_start"].write([0])
        self._crc_end = 0
        self._buf: dict[str, list[int]] = {k: [] for k in kinds}

    def add(self, length: int, shard: int, offset: int, crcs: int) -> None:
        buf = self._buf
        buf["lengths"].append(length)
        buf["shard"].append(shard)
        buf["offset"].append(offset)
        self._crc_end += crcs
        buf["crc_start"].append(self._crc_end)
        if len(buf["lengths"]) >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        for k, values in self._buf.items():
            self._streams[k].write(values)
            values.clear()

    def commit(self, *, dtype: np.dtype, meta: dict[str, Any], num_tokens: int, shards: list[dict[str, Any]],
               max_token_id: int | None = None) -> dict[str, Any]:
        """Write the arrays and ``index.json`` (``meta``: the folder's ``shards.json`` content); returns the index."""
        self._flush()
        for s in self._streams.values():
            s.commit()
        # the fingerprint hashes the length count first, so it is taken from the finished file (in the page cache)
        lengths = np.load(array_path(self.folder, "lengths"), mmap_mode="r", allow_pickle=False)  # [num_docs] int64
        index = index_json(dtype=dtype, meta=meta, num_docs=len(lengths), num_tokens=num_tokens,
                           fingerprint=lengths_fingerprint(lengths), named=True,
                           block=int(meta["check_block_bytes"]), shards=shards, max_token_id=max_token_id)
        del lengths
        write_json(os.path.join(self.folder, INDEX_FILE), index, indent=1)
        return index

    def discard(self) -> None:
        for s in self._streams.values():
            s.discard()


def read_index_json(path: str) -> dict[str, Any]:
    """``index.json`` or ``shards.json`` of a shard folder; one ``ValueError`` when unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return parse_index_json(data, path, fix=reindex_hint(os.path.dirname(path) or "."))


def index_problems(folder: str, index: dict[str, Any]) -> list[str]:
    """How a local folder disagrees with its ``index.json`` (empty: it agrees), cheaply: every listed
    shard is there with its recorded size, no ``.tar`` is there that the index does not list (a stray
    shard), and ``shards.json`` (the build's record, when there) lists the same shards with the same
    docs, sizes and crc32s. Reading never re-indexes; these lines are errors (verify lists them all)."""
    out = []
    listed = [s["name"] for s in index.get("shards", [])]
    for s in index.get("shards", []):
        path = os.path.join(folder, s["name"])
        if not os.path.exists(path):
            out.append(f"shard {path} listed in {INDEX_FILE} is missing; restore it")
        elif os.path.getsize(path) != s["bytes"]:
            out.append(f"shard {path} has {os.path.getsize(path)} bytes but {INDEX_FILE} recorded {s['bytes']}: "
                       f"it is truncated or was rewritten; restore it")
    for name in sorted(set(list_shards(folder)) - set(listed)):
        out.append(f"shard {os.path.join(folder, name)} is not in {INDEX_FILE} (a stray or added shard); "
                   f"remove it")
    meta_path = os.path.join(folder, META_FILE)
    if os.path.exists(meta_path):
        try:
            meta = read_index_json(meta_path)
        except ValueError as e:
            return [*out, str(e)]
        recorded = {s["name"]: s for s in meta.get("shards", [])}
        if sorted(recorded) != sorted(listed):
            out.append(f"{INDEX_FILE} lists shards {_names(listed)} but {META_FILE} (the build's record) lists "
                       f"{_names(list(recorded))}")
        for s in index.get("shards", []):
            r = recorded.get(s["name"])
            if r is None:
                continue
            for key in ("docs", "bytes", "crc32"):
                if key in r and s.get(key) != r[key]:
                    out.append(f"{INDEX_FILE} records {key} {s.get(key)} for shard {s['name']} but {META_FILE} "
                               f"records {r[key]}: the index does not belong to these shards")
                    break
    return out


def _names(names: list[str]) -> str:
    names = sorted(names)
    return f"[{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}] ({len(names)})"


def parse_index_json(data: bytes, where: str, *, fix: str = "rebuild the index with balanced-loader index DIR"
                     ) -> dict[str, Any]:
    """The JSON of ``index.json`` / ``shards.json`` read from ``where`` (a path or URL); one
    ``ValueError`` ending in ``fix`` when it is not a shard index this reader knows."""
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where} is not JSON ({type(e).__name__}); {fix}") from None
    if not isinstance(d, dict) or d.get("format") not in (INDEX_FORMAT, META_FORMAT):
        raise ValueError(f"{where} is not a balanced-loader shard index; {fix}")
    if d.get("version") != INDEX_VERSION:
        raise ValueError(f"{where} has version {d.get('version')}, this reader knows {INDEX_VERSION}; {fix}")
    return d
