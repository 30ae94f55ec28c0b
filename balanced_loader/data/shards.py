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

The writer (:mod:`balanced_loader.build.writer`) streams the index as it writes and publishes the
folder whole; a folder without an index (tars of another tool) is
indexed only by the explicit ``balanced-loader index DIR`` (:mod:`.reindex`), never on open. Reads
are checked (:mod:`.integrity`): the first read of a doc checks its tar and ``.npy`` headers against
the index (fetched with the doc's first bytes when that read starts at the doc's start: one
request), and every read checks the checksums it covers, the whole-doc crc32 or the 1 KiB block crc32s of a partial read
(``verify="full"``, the default; ``"header"`` skips the checksums, ``"off"`` both). A mismatch
is one ``ValueError`` naming the shard file and the doc_id: wrong tokens are never returned.
Every file is written complete or not at all (:func:`~balanced_loader.outputs.files.atomic_write`).
Bytes come from a store (:mod:`.stores`): the local folder, or a remote one (:mod:`.remote`,
fsspec byte ranges), with the same checks.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from balanced_loader.data.index import (
    ARRAYS,
    CRC_FILE,
    INDEX_FILE,
    INDEX_FORMAT,
    TOKEN_EXT,
    array_path,
    check_token_dtype,
    index_problems,
    list_shards,
    read_index_json,
    reindex_hint,
)
from balanced_loader.data.integrity import (
    NPY_HEADER_GUESS,
    TAR_BLOCK,
    check_member,
)
from balanced_loader.data.sources import Source
from balanced_loader.data.stores import LocalStore

VERIFY_MODES = ("full", "header", "off")


class ShardSource(Source):
    """A shard folder: memory-mapped length index and one checked ``pread`` per token range.

    The index is never built or rebuilt on open: a folder without one, or whose index disagrees
    with the shards there (a missing or stray ``.tar``, a changed size, a ``shards.json`` that
    records other shards), is one ``ValueError`` naming the file and the fix (``balanced-loader
    index DIR``, which rebuilds it explicitly against every recorded checksum). A part of a
    ``--part K/N`` build (N > 1) opens alone only with ``allow_part=True``.
    ``verify``: ``"full"`` (default: member headers once per doc, block checksums on every
    read), ``"header"`` (headers only) or ``"off"``. Folders written before checksums existed
    are read with the header check. File handles are cached (at most ``max_open_files``);
    reads are thread-safe.

    ``store``: where the bytes come from (default: the local ``folder``); a remote store
    (:func:`balanced_loader.data.remote.open_remote`) serves its complete index and byte ranges,
    read and checked here exactly as local files are.
    """

    def __init__(self, folder: str, *, max_open_files: int = 64,
                 verify: str = "full", store: Any = None, allow_part: bool = False) -> None:
        self.folder = os.fspath(folder)
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.verify = verify
        self.max_open_files = max_open_files
        if store is None:
            if not os.path.isdir(self.folder):
                raise ValueError(f"shard folder {self.folder} does not exist")
            store = LocalStore(self.folder, max_open_files)
            index, arrays = self._local_index()
        else:
            index, arrays = store.open_index()  # a complete index, fetched (never built over the network)
        self._store = store
        index_path = store.path(INDEX_FILE)
        n = int(index["num_docs"])
        if any(len(arrays[k]) != n for k in ARRAYS) or ("crc_start" in arrays and len(arrays["crc_start"]) != n + 1):
            fix = "upload the folder's index files again" if store.remote else reindex_hint(self.folder)
            raise ValueError(f"the index arrays of {self.folder} do not match {INDEX_FILE}; {fix}")
        part = index.get("part")
        if isinstance(part, dict) and int(part.get("count", 1)) > 1 and not allow_part:
            raise ValueError(f"{self.folder} is part {part.get('index')}/{part['count']} of a build-shards --part "
                             f"build, not a whole dataset: open all {part['count']} parts together "
                             f"(open_source([part0, part1, ...]), or --source DIR0 DIR1 ...), or pass "
                             f"allow_part=True to read this part alone")
        self.index = index
        self.allow_part = bool(allow_part)
        self.dtype = check_token_dtype(index["dtype"], index_path)
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
            self._crc = np.asarray(store.load_array(CRC_FILE, "checksum file", "rebuild the shards"))
            if len(self._crc) != int(self._crc_start[-1]):
                raise ValueError(f"checksum file {store.path(CRC_FILE)} does not match {INDEX_FILE}; "
                                 f"rebuild the shards")
        self._names_are_ids = index.get("member_names") == "doc_id"
        self._header_ok: np.ndarray | None = None  # [num_docs] bool, docs whose headers were checked
        self.shard_bounds = np.concatenate([[0], np.cumsum([s["docs"] for s in index["shards"]])]).astype(np.int64)
        self._lock = threading.Lock()
        self._prefetched: dict[tuple[int, int, int], bytes] = {}  # (shard, n, offset) -> bytes, see prefetch
        self.bytes_read = 0
        # recorded at build time; Source.fingerprint computes it (once) for older indexes
        self._fingerprint: str | None = index.get("lengths_fingerprint")

    def _local_index(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The index of a local folder and its arrays (memory-mapped), checked against the shards.

        Never built or rebuilt here: a folder without an index, or whose index disagrees with its
        shards (:func:`~.index.index_problems`), is one ``ValueError`` naming ``balanced-loader index``."""
        index_path = os.path.join(self.folder, INDEX_FILE)
        fix = reindex_hint(self.folder)
        if not os.path.exists(index_path):
            if not list_shards(self.folder):
                raise ValueError(f"{self.folder} holds no .tar shards and no length index; build shards with "
                                 f"balanced-loader build-shards (an empty part of a --part build opens only with "
                                 f"the other parts)")
            raise ValueError(f"shard folder {self.folder} has no length index ({INDEX_FILE}); {fix}")
        index = read_index_json(index_path)
        if index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{index_path} is not a shard index; {fix}")
        problems = index_problems(self.folder, index)
        if problems:
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise ValueError(f"{problems[0]}{more}; the index does not match the folder: {fix}")
        arrays = {}
        for k in (*ARRAYS, "crc_start") if index.get("check_block_bytes") else ARRAYS:
            try:
                arrays[k] = np.load(array_path(self.folder, k), mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise ValueError(f"index file {array_path(self.folder, k)} cannot be read ({e}); {fix}") from None
        return index, arrays

    def describe(self) -> str:
        return f"shard folder {self.folder}"

    def tokens_fingerprint(self) -> str | None:
        """A hash of the shards' crc32s (from the index: no read), their doc counts and the dtype: it changes
        when any token byte does. ``None`` when some shard has no recorded crc32 (another tool's tars)."""
        shards = self.index["shards"]
        if not shards or not all("crc32" in sh for sh in shards):
            return None
        h = hashlib.blake2b(digest_size=16)
        h.update(f"shards:{self.dtype.str}:{self.num_docs}:".encode())
        for sh in shards:
            h.update(f"{sh['docs']}:{sh['bytes']}:{sh['crc32']};".encode())
        return h.hexdigest()

    @property
    def vocab_size(self) -> int | None:
        v = (self.tokenizer or {}).get("vocab_size") if isinstance(self.tokenizer, dict) else None
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    @property
    def max_token_id(self) -> int | None:
        v = self.index.get("max_token_id")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

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

    @property
    def remote(self) -> bool:
        """Whether the folder is read through a remote store (a URL)."""
        return bool(self._store.remote)

    def shard_path(self, shard: int) -> str:
        """The shard's path (its URL for a remote folder)."""
        return self._store.path(self.shard_names[shard])

    def location(self, doc_id: int) -> tuple[str, int]:
        """(shard path, byte offset of the doc's token data)."""
        d = self._check_doc(doc_id)
        return self.shard_path(int(self._shard[d])), int(self._offset[d])

    def _pread(self, shard: int, n: int, off: int) -> bytes:
        buf = self._prefetched.pop((shard, n, off), None) if self._prefetched else None
        if buf is None:
            buf = self._store.pread(self.shard_names[shard], n, off)  # the store is thread-safe
        with self._lock:
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

    def _headers_match(self, d: int, window: bytes | memoryview, base: int) -> bool:
        """Whether ``window`` (the bytes just before the doc's token data) holds headers that agree with the index."""
        name = f"{d:010d}{TOKEN_EXT}" if self._names_are_ids else None
        try:
            check_member(bytes(window), base - len(window), data_offset=base, length=int(self.lengths[d]),
                         dtype=self.dtype, name=name)
        except ValueError:
            return False
        return True

    def _span(self, d: int, start: int, length: int) -> tuple[int, int]:
        """Bytes ``[lo, hi)`` of doc ``d``'s token data that reading tokens ``[start, start + length)`` fetches:
        widened to whole checksum blocks when they are checked (a whole doc is one crc32)."""
        item = self.dtype.itemsize
        lo, hi = start * item, (start + length) * item
        if self._crc is not None and self.verify == "full" and hi > lo:
            b = self._block
            nbytes = int(self.lengths[d]) * item
            if not (lo == 0 and hi == nbytes):
                lo, hi = lo // b * b, min(-(-hi // b) * b, nbytes)
        return lo, hi

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:
        """Fetch the byte ranges of these reads concurrently (remote folders; a local one reads on demand).

        The ranges are exactly those :meth:`read` will ask for (headers on a doc's first read
        included), kept until read; the reads themselves check them as always. Replaces the
        ranges of an earlier call that were not read.
        """
        if not self._store.remote:
            return
        checked = set()  # docs whose headers a read before this one in the list fetches
        want: list[tuple[int, int, int]] = []  # (shard, n, offset) in read order
        for doc_id, start, length in reads:
            try:
                d, start, length = self._check_range(doc_id, start, length)
                lo, hi = self._span(d, start, length)
            except ValueError:
                continue  # the read itself reports it
            shard, base = int(self._shard[d]), int(self._offset[d])
            pre = 0
            if self.verify != "off" and (self._header_ok is None or not self._header_ok[d]) and d not in checked:
                checked.add(d)
                pre = min(base, TAR_BLOCK + NPY_HEADER_GUESS)
                if lo > 0:  # the headers on their own (see read)
                    want.append((shard, pre, base - pre))
                    pre = 0
            if pre + hi - lo > 0:
                want.append((shard, pre + hi - lo, base + lo - pre))
        got = self._store.pread_many([(self.shard_names[s], n, off) for s, n, off in want])
        self._prefetched = {key: buf for key, buf in zip(want, got, strict=True) if buf is not None}

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        item = self.dtype.itemsize
        shard = int(self._shard[d])
        base = int(self._offset[d])
        check = False  # the doc's headers still need their check
        if self.verify != "off":
            if self._header_ok is None:
                self._header_ok = np.zeros(self.num_docs, dtype=bool)
            check = not self._header_ok[d]
        lo, hi = self._span(d, start, length)  # bytes of the doc's token data to read
        crc = self._crc is not None and self.verify == "full" and hi > lo
        if crc:
            b = self._block
            nbytes = int(self.lengths[d]) * item
            k0, k1 = self._crc_start[d:d + 2].tolist()
            if k1 - k0 - 1 != -(-nbytes // b):
                raise self._mismatch(d, shard, f"its length {nbytes // item} disagrees with its checksums")
            whole = start == 0 and length * item == nbytes  # the whole doc: one crc32 call
            first, last = lo // b, -(-hi // b)  # the checksum blocks covered (the span is widened to them)
        if check and lo > 0:
            self._check_header(d, shard, base)
            self._header_ok[d] = True
            check = False
        # a read from the doc's start takes the headers in front of it along: the same bytes, one request
        # fewer (what counts for a remote folder)
        pre = min(base, TAR_BLOCK + NPY_HEADER_GUESS) if check else 0
        buf: bytes | memoryview = self._pread(shard, pre + hi - lo, base + lo - pre)
        if check:
            if not self._headers_match(d, buf[:pre], base):
                self._check_header(d, shard, base)  # a wider look (an unusual .npy header), or the mismatch
            self._header_ok[d] = True
            buf = memoryview(buf)[pre:]
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

    def close(self) -> None:
        self._store.close()

    def __getstate__(self) -> dict[str, Any]:
        state = {"folder": self.folder, "max_open_files": self.max_open_files, "verify": self.verify,
                 "allow_part": self.allow_part}
        if self._store.remote:  # its configuration (URL, cache folder, options); it reconnects when unpickled
            state["store"] = self._store
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], max_open_files=state["max_open_files"],  # type: ignore[misc]
                      verify=state.get("verify", "full"), store=state.get("store"),
                      allow_part=state.get("allow_part", False))
