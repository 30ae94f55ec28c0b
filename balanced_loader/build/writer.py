"""The shard writer (:class:`ShardWriter`, :func:`write_shards`): docs into a shard folder whole.

The folder's layout and its checked reads are :mod:`balanced_loader.data.shards`; the writer streams
the index as it writes (:class:`~balanced_loader.data.index.IndexWriter`; the member bytes come from
:mod:`balanced_loader.data.members`) and publishes the folder whole
(:class:`~balanced_loader.outputs.files.StagedFolder`).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from typing import Any

import numpy as np

from balanced_loader.data.index import (
    CRC_FILE,
    INDEX_VERSION,
    META_FILE,
    META_FORMAT,
    TOKEN_EXT,
    IndexWriter,
    NpyStream,
    check_token_dtype,
)
from balanced_loader.data.integrity import CHECK_BLOCK_BYTES, CrcFile
from balanced_loader.data.members import NpyHeaders, tar_end, tar_member_header, tar_padding
from balanced_loader.data.shards import ShardSource
from balanced_loader.outputs.files import AtomicFile, StagedFolder, write_error, write_json


class ShardWriter:
    """Writes docs into numbered tar shards, then the checksums and the length index (``close()``).

    Everything is written into a hidden staging folder beside ``out_dir``
    (:class:`~balanced_loader.outputs.files.StagedFolder`), renamed to ``out_dir`` by ``close()`` once
    the shards, checksums, ``shards.json`` and the index are all written: ``out_dir`` is complete
    or absent. A failure (an exception inside ``with``, a full disk, Ctrl-C) removes the staging
    folder, so a failed build leaves nothing that could be opened or indexed as a partial dataset.
    ``out_dir`` must not exist or be an empty folder.

    Each member's bytes are built directly (:mod:`.members`: the bytes ``tarfile`` and numpy
    would write), and the checksums and the length index are streamed to their (temporary) files
    as docs arrive: memory stays a few buffered chunks for any number of docs, and ``close()``
    does not read the tars again (the index equals a scan, :func:`~.index.build_index`, byte for byte).

    ``extra``: more JSON keys for ``shards.json`` (``build-shards`` records ``part`` and ``inputs``;
    the index copies them). ``allow_empty``: a writer given no docs writes only ``shards.json``
    and the empty checksum file (an empty part of a ``--part K/N`` build) instead of failing.
    """

    CRC_CHUNK = 1 << 16  # checksums buffered before they go to the checksum file

    def __init__(self, out_dir: str, *, dtype: Any, tokenizer: dict[str, Any] | None = None,
                 max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                 prefix: str = "shard", check_block_bytes: int = CHECK_BLOCK_BYTES,
                 extra: dict[str, Any] | None = None, allow_empty: bool = False) -> None:
        if max_shard_bytes < 1 or max_docs_per_shard < 1:
            raise ValueError("max_shard_bytes and max_docs_per_shard must be >= 1")
        if not 64 <= check_block_bytes <= 1 << 30:
            raise ValueError(f"check_block_bytes must be in 64..2**30, got {check_block_bytes}")
        self.check_block_bytes = int(check_block_bytes)
        self.out_dir = out_dir
        self.dtype = check_token_dtype(dtype, "shard writer")
        self.tokenizer = tokenizer
        self.max_shard_bytes = int(max_shard_bytes)
        self.max_docs_per_shard = int(max_docs_per_shard)
        self.prefix = prefix
        self.extra = dict(extra or {})
        self.allow_empty = bool(allow_empty)
        self._stage = StagedFolder(out_dir, "shard folder")  # ValueError when out_dir holds files
        self._dir = self._stage.path  # where the files are written until close() publishes them
        self.max_token_id = -1  # the largest token id written (recorded in the index)
        self.shards: list[dict[str, Any]] = []
        self.num_docs = 0
        self.num_tokens = 0
        self._npy_header = NpyHeaders(self.dtype)
        self._out: AtomicFile | None = None  # the shard being written
        self._crc_file: CrcFile | None = None  # its bytes go through this (size and crc32 of the whole shard)
        self._docs = 0
        self._bytes = 0
        self._crc_buf: list[int] = []  # checksums not yet in the checksum file
        self._crcs: NpyStream | None = None
        self._index: IndexWriter | None = None
        self._meta: dict[str, Any] | None = None  # set by close()
        try:
            self._crcs = NpyStream(os.path.join(self._dir, CRC_FILE), np.uint32)
            self._index = IndexWriter(self._dir)
        except BaseException:
            self._discard()
            raise

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._out = AtomicFile(os.path.join(self._dir, name))
        self._crc_file = CrcFile(self._out.file)
        self._docs = 0
        self._bytes = 0
        self.shards.append({"name": name, "docs": 0, "bytes": 0})

    def _finish(self) -> None:
        if self._out is None:
            return
        assert self._crc_file is not None
        try:
            self._crc_file.write(tar_end(self._crc_file.size))  # the end-of-archive blocks (may fail: disk full)
        except OSError as e:
            path = self._out.path
            self._discard()
            raise write_error(path, e) from None
        out, self._out = self._out, None
        out.commit()  # fsync and rename; on failure the temporary file is removed
        self.shards[-1].update(docs=self._docs, bytes=self._crc_file.size, crc32=self._crc_file.crc)

    def _discard(self) -> None:
        """Drop everything written: the open files, then the whole staging folder (a file that cannot be
        closed on a full disk raises while closing; that must not keep the folder)."""
        for part in (self._out, self._crcs, self._index):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.discard()
        self._out = self._crcs = self._index = None
        self._stage.discard()

    def _named(self, e: OSError) -> OSError:
        """A write error that names ``out_dir`` (not the staging folder) and says nothing was kept."""
        msg = str(e.strerror or e).replace(self._dir, self.out_dir)
        return OSError(e.errno, f"{msg} (the partial build was removed; nothing was written to {self.out_dir})")

    def add(self, tokens: Any) -> int:
        """Append one doc; returns its doc_id."""
        if self._index is None:
            raise ValueError("this shard writer is closed" if self._meta is not None else
                             "this shard writer failed; its files were removed")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"doc {self.num_docs}: tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0
                             or int(arr.max()) > np.iinfo(self.dtype).max):
                raise ValueError(f"doc {self.num_docs}: token ids do not fit {self.dtype}")
            arr = arr.astype(self.dtype)
        arr = np.ascontiguousarray(arr)
        raw = memoryview(arr).cast("B")
        n = len(arr)
        npy = self._npy_header(n)
        size = len(npy) + len(raw)  # the member's data: .npy header and token bytes
        if self._out is not None and self._docs and (
                self._bytes + size + 512 > self.max_shard_bytes or self._docs >= self.max_docs_per_shard):
            self._finish()
        if self._out is None:
            self._open()
        assert self._crc_file is not None
        head = tar_member_header(f"{self.num_docs:010d}{TOKEN_EXT}", size) + npy
        offset = self._crc_file.size + len(head)  # where the token data lands
        try:  # one write (and one crc32 of the shard) per doc: the copy costs less than more calls
            self._crc_file.write(b"".join((head, raw, tar_padding(size))))
        except OSError as e:  # the with-block's exit removes this writer's files
            raise write_error(self._out.path, e) from None
        # checksums: the whole doc's, then each block's (a doc of one block: the same value twice)
        b = self.check_block_bytes
        whole = zlib.crc32(raw)
        if len(raw) <= b:
            crcs = [whole, whole] if len(raw) else [whole]
        else:
            crcs = [whole, *(zlib.crc32(raw[i:i + b]) for i in range(0, len(raw), b))]
        self._crc_buf += crcs
        if len(self._crc_buf) >= self.CRC_CHUNK:
            self._flush_crcs()
        self._index.add(n, len(self.shards) - 1, offset, len(crcs))
        if n:
            self.max_token_id = max(self.max_token_id, int(arr.max()))
        self._docs += 1
        self._bytes += size + 512
        self.num_docs += 1
        self.num_tokens += n
        return self.num_docs - 1

    def _flush_crcs(self) -> None:
        assert self._crcs is not None
        try:
            self._crcs.write(self._crc_buf)
        except OSError as e:
            raise write_error(self._crcs.path, e) from None
        self._crc_buf.clear()

    def close(self) -> dict[str, Any]:
        """Finish the last shard, write the checksums, ``shards.json`` and the length index; returns
        the metadata. On failure every file of this writer is removed."""
        if self._meta is not None:
            return self._meta
        if self._index is None:
            raise ValueError("this shard writer failed; its files were removed")
        try:
            self._finish()
            self._flush_crcs()
            assert self._crcs is not None
            self._crcs.commit()
            self._crcs = None
            meta = {"format": META_FORMAT, "version": INDEX_VERSION, "dtype": self.dtype.str,
                    "tokenizer": self.tokenizer, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                    "check_block_bytes": self.check_block_bytes, "shards": self.shards, **self.extra}
            write_json(os.path.join(self._dir, META_FILE), meta, indent=1)
            if not self.num_docs:
                if not self.allow_empty:
                    raise ValueError(f"{self.out_dir} holds no .tar shards: the shard writer was given no docs")
                self._index.discard()  # no shards, so no length index: a reader of parts counts this folder as 0 docs
                self._index = None
            else:
                self._index.commit(dtype=self.dtype, meta=meta, num_tokens=self.num_tokens, shards=self.shards,
                                   max_token_id=self.max_token_id)
                self._index = None
            self._stage.publish()  # the whole folder appears at once
        except OSError as e:
            self._discard()
            raise self._named(e) from None
        except BaseException:
            self._discard()
            raise
        self._meta = meta
        return meta

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._discard()
        if isinstance(exc, OSError):  # name out_dir, not the staging folder that is gone now
            raise self._named(exc) from None


def write_shards(docs: Any, out_dir: str, *, dtype: Any = np.uint16, tokenizer: dict[str, Any] | None = None,
                 **kw: Any) -> ShardSource:
    """Write an iterable of token arrays as a shard folder and open it (for tests and tools)."""
    with ShardWriter(out_dir, dtype=dtype, tokenizer=tokenizer, **kw) as w:
        for toks in docs:
            w.add(toks)
    return ShardSource(out_dir)
