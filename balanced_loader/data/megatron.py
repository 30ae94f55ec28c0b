r"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) as a source: one doc per sequence.

The format (megatron-core ``datasets/indexed_dataset.py``; datatrove's Megatron tokenizer, NeMo and
Megatron's ``tools/preprocess_data.py`` write the same), little-endian:

* ``.idx``: ``b"MMIDIDX\x00\x00"`` (9 bytes), version ``<Q`` = 1, dtype code ``<B``, sequence count
  ``S`` ``<Q``, document count ``D`` ``<Q`` (34 bytes so far), then ``int32[S]`` sequence lengths,
  ``int64[S]`` sequence pointers (byte offsets into the ``.bin``), ``int64[D]`` document indices (the
  sequence index where each document ends, first 0, last ``S``: ``D - 1`` documents) and, in a
  multimodal dataset, ``int8[S]`` sequence modes (read past, the file size tells);
* dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
  (``preprocess_data.py`` writes 8 for vocabularies under 65,500, else 4);
* ``.bin``: every sequence's tokens back to back, ``pointers[i] = sum(lengths[:i]) * itemsize``.

A doc of this source is one *sequence* of the index (what Megatron's ``GPTDataset`` trains on).
Opening reads the 34-byte header and the file sizes and memory-maps the ``.idx``: ``lengths`` is its
``int32`` array itself (:class:`MappedLengths`, whose ``sum()`` streams and releases pages), never a
pass over the ``.bin``; a doc's tokens are one read (``os.pread``, or one HTTP/S3 byte range through
:mod:`.filestores`). A remote ``.idx`` is fetched once (into memory, or ``cache_dir``).

Several prefixes are parts of one source (doc ids end to end, in the order given). The format has
no checksums: ``balanced-loader verify PREFIX --write-checksums`` writes ``PREFIX.crc32.npy``
(``uint32[S]``, the crc32 of each sequence's bytes), which reads then check (a partial read of a doc
fetches the whole doc to check it; ``verify="off"`` skips the check).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.data.filestores import open_store, split_location
from balanced_loader.data.lengths import sum_lengths
from balanced_loader.data.sources import Source
from balanced_loader.data.stores import is_url

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
CRC_SUFFIX = ".crc32.npy"
CHECKSUM_HINT = "balanced-loader verify PREFIX --write-checksums"
_CACHED_DOCS = 4  # whole docs kept after a checked partial read (the next piece of the doc is often next)


class MappedLengths(np.ndarray):
    """``[num_docs]`` lengths memory-mapped from an ``.idx`` (``int32``): a plain array except that a whole-array
    ``sum()`` streams in blocks and releases the pages it touched, so resident memory stays bounded."""

    def sum(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False,
            **kw: Any) -> Any:
        if axis is None and out is None and not keepdims and not kw and self.ndim == 1:
            total = sum_lengths(self)
            return np.int64(total) if dtype is None else np.asarray(total).astype(dtype)[()]
        return np.asarray(self).sum(axis=axis, dtype=dtype, out=out, keepdims=keepdims, **kw)


@dataclass(frozen=True, kw_only=True, slots=True)
class IdxHeader:
    """What the 34-byte header of an ``.idx`` says, checked against the file size."""

    dtype: np.dtype
    sequences: int  # S
    documents: int  # D (document indices, D - 1 documents)
    modes: bool  # a multimodal dataset: int8[S] modes after the document indices

    @property
    def lengths_at(self) -> int:
        return HEADER_BYTES

    @property
    def pointers_at(self) -> int:
        return HEADER_BYTES + 4 * self.sequences

    @property
    def documents_at(self) -> int:
        return HEADER_BYTES + 12 * self.sequences

    @property
    def size(self) -> int:
        return HEADER_BYTES + 12 * self.sequences + 8 * self.documents + (self.sequences if self.modes else 0)


def parse_header(head: bytes, file_size: int, where: str) -> IdxHeader:
    """The header of an ``.idx`` of ``file_size`` bytes; one ``ValueError`` naming ``where`` if it is not one."""
    fix = "it is not a Megatron indexed dataset index, or it is damaged; rebuild it (tools/preprocess_data.py)"
    if len(head) < HEADER_BYTES:
        raise ValueError(f"{where} is {file_size} bytes, shorter than the {HEADER_BYTES}-byte header of an .idx; {fix}")
    if head[:9] != MAGIC:
        raise ValueError(f"{where} does not start with the .idx magic {MAGIC!r} (found {head[:9]!r}); {fix}")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:HEADER_BYTES])
    if version != VERSION:
        raise ValueError(f"{where} is .idx version {version}; only version {VERSION} exists (megatron-core "
                         f"indexed_dataset.py); {fix}")
    if code not in DTYPES:
        raise ValueError(f"{where} has dtype code {code}, outside 1..8 (1 uint8, 2 int8, 3 int16, 4 int32, "
                         f"5 int64, 6 float64, 7 float32, 8 uint16); {fix}")
    h = IdxHeader(dtype=np.dtype(DTYPES[code]).newbyteorder("<"), sequences=seqs, documents=docs, modes=False)
    if file_size == h.size + seqs and seqs:
        h = IdxHeader(dtype=h.dtype, sequences=seqs, documents=docs, modes=True)
    if file_size != h.size:
        raise ValueError(f"{where} is {file_size:,} bytes but its header announces {seqs:,} sequences and {docs:,} "
                         f"document indices ({h.size:,} bytes, or {h.size + seqs:,} with modes): truncated or "
                         f"damaged; rebuild it")
    if docs < 1:
        raise ValueError(f"{where} has no document indices (at least the leading 0); {fix}")
    return h


def resolve_prefix(spec: Any) -> str | None:
    """The prefix of a Megatron dataset named by ``spec`` (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``, a
    path or URL), or ``None`` when ``spec`` is not one (a local ``PREFIX`` must have its ``.idx``)."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    s = os.fspath(spec)
    if s.endswith((".idx", ".bin")):
        return s[:-4]
    if is_url(s):
        return None  # a bare URL prefix is tried after a shard folder (open_source)
    return s if os.path.isfile(s + ".idx") else None


class _Part:
    """One prefix: its header, memory-mapped arrays and a store for its ``.bin``."""

    def __init__(self, prefix: str, remote: dict[str, Any] | None, verify: str) -> None:
        self.prefix = prefix
        folder, base = split_location(prefix)
        self.idx_name, self.bin_name = base + ".idx", base + ".bin"
        self.store = open_store(folder, self.idx_name, remote)
        self.idx_path, self.bin_path = self.store.path(self.idx_name), self.store.path(self.bin_name)
        buf = self._idx_buffer(remote)
        self.header = h = parse_header(bytes(buf[:HEADER_BYTES]), len(buf), self.idx_path)
        self.dtype = h.dtype
        self.itemsize = h.dtype.itemsize
        self.lengths = buf[h.lengths_at:h.pointers_at].view("<i4").view(MappedLengths)  # [S] int32
        self.pointers = buf[h.pointers_at:h.documents_at].view("<i8")  # [S] int64 byte offsets
        self.doc_index = buf[h.documents_at:h.documents_at + 8 * h.documents].view("<i8")  # [D] int64
        if int(self.doc_index[0]) != 0 or int(self.doc_index[-1]) != h.sequences:
            raise ValueError(f"{self.idx_path}: its document indices run from {int(self.doc_index[0])} to "
                             f"{int(self.doc_index[-1])}, not 0 to its {h.sequences:,} sequences; the index is "
                             f"damaged, rebuild it")
        self.bin_size = self.store.size(self.bin_name) if self.store.exists(self.bin_name) else None
        if self.bin_size is None:
            raise ValueError(f"{self.bin_path} is missing: a Megatron dataset is PREFIX.bin + PREFIX.idx "
                             f"(found {self.idx_path} only)")
        want = 0
        if h.sequences:
            want = int(self.pointers[-1]) + int(self.lengths[-1]) * self.itemsize
        if self.bin_size != want:
            short = "shorter" if self.bin_size < want else "longer"
            raise ValueError(f"{self.bin_path} is {self.bin_size:,} bytes, {short} than the {want:,} its index "
                             f"{self.idx_name} describes (it is truncated, or the two files are from different "
                             f"builds); rebuild or re-copy the pair")
        self.crc = self._checksums() if verify != "off" else None  # [S] uint32 or None

    def _idx_buffer(self, remote: dict[str, Any] | None) -> np.ndarray:
        """``[size]`` uint8 of the ``.idx``: memory-mapped (local, or a remote one cached in ``cache_dir``)."""
        if not self.store.remote:
            path = self.store.path(self.idx_name)
            try:
                size = os.path.getsize(path)
                if size == 0:
                    return np.zeros(0, dtype=np.uint8)
                return np.memmap(path, dtype=np.uint8, mode="r")  # [size]
            except OSError as e:
                raise ValueError(f"{path} cannot be read: {e.strerror}") from None
        cache = (remote or {}).get("cache_dir")
        if cache is None:
            return np.frombuffer(self.store.fetch(self.idx_name), dtype=np.uint8)
        from balanced_loader.outputs.files import atomic_write

        size = self.store.size(self.idx_name)
        key = hashlib.blake2b(f"{self.idx_path}:{size}".encode(), digest_size=8).hexdigest()
        local = os.path.join(os.fspath(cache), f"{key}-{self.idx_name}")
        if not os.path.exists(local) or os.path.getsize(local) != size:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with atomic_write(local, "wb") as f:
                f.write(self.store.fetch(self.idx_name))
        return np.memmap(local, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)

    def _checksums(self) -> np.ndarray | None:
        name = self.idx_name[:-4] + CRC_SUFFIX
        if not self.store.exists(name):
            return None
        import io

        where = self.store.path(name)
        try:
            arr = np.load(io.BytesIO(self.store.fetch(name)), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"checksum file {where} cannot be read ({e}); rewrite it ({CHECKSUM_HINT})") from None
        if arr.dtype != np.uint32 or arr.shape != (self.header.sequences,):
            raise ValueError(f"checksum file {where} holds {arr.shape} {arr.dtype}, not one uint32 per sequence of "
                             f"{self.idx_name} ({self.header.sequences:,}); rewrite it ({CHECKSUM_HINT})")
        return arr

    @property
    def num_docs(self) -> int:
        return self.header.sequences


class MegatronSource(Source):
    """Megatron indexed datasets as one source (see the module doc): ``prefixes`` in order, doc ids end to end.

    ``verify``: ``"full"`` checks each read against ``PREFIX.crc32.npy`` when it exists; ``"off"`` never
    does. ``remote``: options of URL prefixes (``cache_dir``, ``cache_shards``, ``storage_options``,
    ``read_timeout_s``, ``retries``; see :func:`balanced_loader.data.open.open_source`).
    """

    def __init__(self, prefixes: str | Sequence[str], *, verify: str = "full",
                 remote: dict[str, Any] | None = None) -> None:
        if verify not in ("full", "off"):
            raise ValueError(f"verify must be 'full' or 'off', got {verify!r}")
        items = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes)
        if not items:
            raise ValueError("no Megatron prefixes given")
        self.prefixes = [p if (p := resolve_prefix(x)) is not None else os.fspath(x) for x in items]
        self._args = {"prefixes": self.prefixes, "verify": verify, "remote": remote}
        self.parts: list[_Part] = []
        try:
            for p in self.prefixes:
                self.parts.append(_Part(p, remote, verify))
        except BaseException:
            self.close()
            raise
        kinds = {p.dtype for p in self.parts}
        if len(kinds) > 1:
            a, b = self.parts[0], next(p for p in self.parts if p.dtype != self.parts[0].dtype)
            raise ValueError(f"{a.idx_path} stores {a.dtype} tokens but {b.idx_path} stores {b.dtype}; combine "
                             f"prefixes of one tokenizer (one dtype)")
        self.dtype = self.parts[0].dtype
        self.verify = verify
        self.doc_offsets = np.concatenate([[0], np.cumsum([p.num_docs for p in self.parts])]).astype(np.int64)
        self.shard_bounds = self.doc_offsets.copy()  # [parts + 1]: each prefix is a shard for the shuffle
        if len(self.parts) == 1:
            self.lengths = self.parts[0].lengths  # [num_docs] int32, memory-mapped: no copy
        else:
            self.lengths = np.concatenate([p.lengths for p in self.parts]).view(MappedLengths)  # [num_docs] int32
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()  # doc -> whole checked tokens
        self._prefetched: dict[tuple[int, int, int], bytes] = {}  # (part, n, offset) -> bytes
        self.bytes_read = 0

    def describe(self) -> str:
        more = f" (and {len(self.prefixes) - 1} more)" if len(self.prefixes) > 1 else ""
        return f"Megatron dataset {self.prefixes[0]}{more}"

    @property
    def num_docs(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def has_checksums(self) -> bool:
        return all(p.crc is not None for p in self.parts)

    @property
    def remote(self) -> bool:
        return any(p.store.remote for p in self.parts)

    def tokens_fingerprint(self) -> str | None:
        """From the checksum sidecars (no read of the ``.bin``); ``None`` without them."""
        if not self.has_checksums:
            return None
        h = hashlib.blake2b(digest_size=16)
        h.update(f"megatron:{self.dtype.str}:".encode())
        for p in self.parts:
            h.update(np.ascontiguousarray(p.crc).tobytes())
        return h.hexdigest()

    def locate(self, doc_id: int) -> tuple[int, int]:
        """``(part, sequence index in that prefix)`` of a doc id."""
        d = self._check_doc(doc_id)
        j = int(np.searchsorted(self.doc_offsets, d, side="right")) - 1
        return j, d - int(self.doc_offsets[j])

    def _span(self, j: int, i: int, start: int, length: int) -> tuple[int, int, bool]:
        """Bytes ``(offset, n)`` of the ``.bin`` that a read fetches, and whether it is the whole doc checked."""
        part = self.parts[j]
        base, item = int(part.pointers[i]), part.itemsize
        full = int(part.lengths[i]) * item
        if base < 0 or base + full > part.bin_size:
            raise ValueError(f"{part.idx_path}: sequence {i} points at bytes [{base:,}, {base + full:,}) outside "
                             f"{part.bin_path} ({part.bin_size:,} bytes); the index is damaged, rebuild it")
        if part.crc is not None:
            return base, full, True
        return base + start * item, length * item, False

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:
        """Fetch the byte ranges of these reads concurrently (remote prefixes only)."""
        if not self.remote:
            return
        want: dict[int, dict[tuple[int, int], None]] = {}  # part -> unique (n, offset), in read order
        for doc_id, start, length in reads:
            try:
                d, start, length = self._check_range(doc_id, start, length)
                j, i = self.locate(d)
                off, n, whole = self._span(j, i, start, length)
            except ValueError:
                continue  # the read itself reports it
            if whole and d in self._cache:
                continue  # a checked doc already in memory: its pieces need no bytes
            if n and self.parts[j].store.remote:  # the pieces of one checked doc share one whole-doc range
                want.setdefault(j, {})[(n, off)] = None
        got: dict[tuple[int, int, int], bytes] = {}
        for j, ranges in want.items():
            part = self.parts[j]
            keys = list(ranges)
            bufs = part.store.pread_many([(part.bin_name, n, off) for n, off in keys])
            got.update({(j, n, off): b for (n, off), b in zip(keys, bufs, strict=True) if b is not None})
        self._prefetched = got

    def _pread(self, j: int, n: int, off: int) -> bytes:
        buf = self._prefetched.pop((j, n, off), None) if self._prefetched else None
        part = self.parts[j]
        if buf is None:
            buf = part.store.pread(part.bin_name, n, off) if n else b""
        with self._lock:
            self.bytes_read += len(buf)
        if len(buf) != n:
            raise ValueError(f"{part.bin_path} is truncated: bytes [{off:,}, {off + n:,}) are past its end; "
                             f"re-copy it (or rebuild the dataset)")
        return buf

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        j, i = self.locate(d)
        part = self.parts[j]
        off, n, checked = self._span(j, i, start, length)
        if not checked:
            return np.frombuffer(self._pread(j, n, off), dtype=part.dtype)  # [length]
        with self._lock:
            toks = self._cache.get(d)
            if toks is not None:
                self._cache.move_to_end(d)
        if toks is None:
            buf = self._pread(j, n, off)
            got, want = zlib.crc32(buf), int(part.crc[i])
            if got != want:
                raise ValueError(f"{part.bin_path}: sequence {i} (doc {d}) has crc32 {got:08x}, its checksum file says "
                                 f"{want:08x}: the .bin is corrupt or changed since the checksums were written "
                                 f"(balanced-loader verify {part.prefix} lists every bad sequence)")
            toks = np.frombuffer(buf, dtype=part.dtype)  # [doc length]
            with self._lock:
                self._cache[d] = toks
                while len(self._cache) > _CACHED_DOCS:
                    self._cache.popitem(last=False)
        return toks[start:start + length]

    def close(self) -> None:
        for p in self.parts:
            p.store.close()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._args)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefixes"], verify=state["verify"], remote=state["remote"])  # type: ignore[misc]


def write_indexed_dataset(prefix: str, documents: Iterable[Any], *, dtype: Any = np.uint16) -> None:
    """Write ``documents`` as ``PREFIX.bin`` + ``PREFIX.idx`` (for tests and tools; megatron-core not needed).

    Each document is a token array (one sequence) or a list of token arrays (its sequences). The layout
    is Megatron's ``IndexedDatasetBuilder`` + ``_IndexWriter`` byte for byte (tests compare them)."""
    from balanced_loader.outputs.files import atomic_write

    dt = np.dtype(dtype)
    if dt not in CODES:
        raise ValueError(f"dtype {dt} has no Megatron dtype code (codes: {sorted(map(str, CODES))})")
    lengths: list[int] = []
    doc_index = [0]
    with atomic_write(prefix + ".bin", "wb") as f:
        for doc in documents:
            seqs = doc if isinstance(doc, (list, tuple)) else [doc]
            for seq in seqs:
                a = np.ascontiguousarray(seq, dtype=dt)
                f.write(a.tobytes())
                lengths.append(len(a))
            doc_index.append(len(lengths))
    ln = np.asarray(lengths, dtype="<i4")  # [S]
    ptr = np.concatenate([[0], np.cumsum(ln.astype(np.int64) * dt.itemsize)[:-1]]).astype("<i8") if len(ln) else \
        np.zeros(0, dtype="<i8")
    with atomic_write(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[dt], len(ln), len(doc_index)))
        f.write(ln.tobytes())
        f.write(ptr.tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())


def prefixes_in(folder: str) -> list[str]:
    """The prefixes of a local folder holding Megatron ``.idx`` + ``.bin`` pairs and no shard index, in name
    order (datatrove's Megatron tokenizer writes one pair per task); empty for any other folder."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        return []
    if "index.json" in names or any(n.endswith(".tar") for n in names):
        return []
    return [os.path.join(folder, n[:-4]) for n in sorted(names) if n.endswith(".idx") and n[:-4] + ".bin" in names]


def parse_data_path(text: str | Sequence[str]) -> list[tuple[float | None, str]]:
    """Megatron's ``--data-path`` form: ``"W1 PREFIX1 W2 PREFIX2 ..."`` (weights: non-negative numbers, normalized
    later, at least one positive) or ``"PREFIX1 PREFIX2 ..."`` (no weights: each prefix weighs its size, as
    Megatron blends unweighted prefixes). ``[(weight or None, prefix), ...]``; one ``ValueError`` otherwise."""
    parts = text.split() if isinstance(text, str) else [str(t) for t in text]
    if not parts:
        raise ValueError("the data path is empty; give 'W1 PREFIX1 W2 PREFIX2 ...' or 'PREFIX1 PREFIX2 ...'")

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    weights = [number(x) for x in parts[0::2]]
    if len(parts) % 2 == 0 and all(w is not None for w in weights):
        bad = [w for w in weights if not (np.isfinite(w) and w >= 0)]
        if bad or not any(w > 0 for w in weights):
            raise ValueError(f"data path '{' '.join(parts)}': weights must be finite, non-negative and not all 0 "
                             f"(got {bad[0] if bad else 0})")
        return list(zip(weights, parts[1::2], strict=True))
    if any(number(x) is not None for x in parts):
        raise ValueError(f"data path '{' '.join(parts)}': weights and prefixes must alternate ('W1 PREFIX1 W2 "
                         f"PREFIX2 ...'), or give prefixes only")
    return [(None, p) for p in parts]


def data_path_sources(text: str | Sequence[str]) -> tuple[dict[str, str], dict[str, float] | None]:
    """``({name: prefix}, {name: weight} or None)`` of a data path (:func:`parse_data_path`); a source's name is
    its prefix's base name (``web_text_document``), made unique with ``-2``, ``-3`` ... when repeated."""
    entries = parse_data_path(text)
    sources: dict[str, str] = {}
    weights: dict[str, float] = {}
    for w, prefix in entries:
        base = os.path.basename(resolve_prefix(prefix) or prefix.rstrip("/")) or "source"
        base = "".join("_" if c in "=:,@ " else c for c in base)
        name, k = base, 1
        while name in sources:
            k += 1
            name = f"{base}-{k}"
        sources[name] = prefix
        if w is not None:
            weights[name] = float(w)
    return sources, (weights if weights else None)
