"""Integrity checks of shard folders (stdlib and numpy only; imports nothing of ours).

* **block checksums**: ``build-shards`` records a ``zlib.crc32`` of every ``CHECK_BLOCK_BYTES``
  block of each doc's token bytes (a doc of at most one block has one checksum, that of the
  whole doc). A read checks the blocks it covers, so a token range is verified without
  reading the whole doc (a read is widened to block bounds: at most two blocks more);
* **member headers**: the 512-byte tar header and the ``.npy`` header in front of a doc's token
  data must agree with the index (member name, member size, dtype, length, data offset);
* **shard checksums**: a ``crc32`` of each whole ``.tar`` (checked by ``balanced-loader verify``);
* **lengths fingerprint**: a hash of the length index, which the loader state carries.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
import zlib
from typing import IO, Any

import numpy as np

CHECK_BLOCK_BYTES = 1024  # 0.4% of the token bytes; widens a partial read by ~1 KiB (4096 gave 1.3x bytes read)
TAR_BLOCK = 512
NPY_MAGIC = b"\x93NUMPY"
# the .npy header numpy writes for a 1-D array (version 1.0, padded to 64 bytes): 128 bytes
NPY_HEADER_GUESS = 128
_NPY_DICT = re.compile(rb"\{'descr': '([<>|=]?[a-z]\d+)', 'fortran_order': (True|False), 'shape': \((\d+),\), \}")


def block_crcs(data: bytes | memoryview, block: int = CHECK_BLOCK_BYTES) -> np.ndarray:
    """``[ceil(len(data) / block)]`` uint32: the crc32 of each block of ``data``."""
    mv = memoryview(data).cast("B")
    return np.fromiter((zlib.crc32(mv[i:i + block]) for i in range(0, len(mv), block)), dtype=np.uint32,
                       count=-(-len(mv) // block))


def num_blocks(nbytes: np.ndarray | int, block: int) -> np.ndarray | int:
    """Checksum blocks of docs of ``nbytes`` token bytes (0 for an empty doc)."""
    return -(-nbytes // block)


def lengths_fingerprint(lengths: np.ndarray) -> str:
    """A 32-hex-digit blake2b of a ``[num_docs]`` length array (as little-endian int64), in chunks
    so a memory-mapped index is never copied whole."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"lengths:{len(lengths)}:".encode())
    step = 1 << 20
    for i in range(0, len(lengths), step):
        h.update(np.ascontiguousarray(lengths[i:i + step], dtype="<i8").tobytes())
    return h.hexdigest()


class CrcFile:
    """A write-only file wrapper that keeps the crc32 and size of everything written (for tarfile)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self.crc = zlib.crc32(b, self.crc)
        self.size += len(b)
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._f.flush()


def file_crc32(path: str, chunk: int = 1 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while b := f.read(chunk):
            crc = zlib.crc32(b, crc)
    return crc


def parse_npy_header(buf: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """``(dtype, shape, header bytes)`` of the ``.npy`` header at the start of ``buf``; ``ValueError`` if none."""
    if buf[:6] != NPY_MAGIC or len(buf) < 10:
        raise ValueError("no .npy header")
    major = buf[6]
    if major == 1:
        hlen, start = int.from_bytes(buf[8:10], "little"), 10
    elif major in (2, 3):
        hlen, start = int.from_bytes(buf[8:12], "little"), 12
    else:
        raise ValueError(f".npy version {major} is unknown")
    if start + hlen > len(buf):
        raise ValueError(".npy header is cut short")
    text = buf[start:start + hlen]
    m = _NPY_DICT.match(text)
    if m is not None:  # numpy's own layout: a regex instead of ast.literal_eval (this runs once per doc read)
        if m.group(2) == b"True":
            raise ValueError(".npy array is in Fortran order")
        return np.dtype(m.group(1).decode()), (int(m.group(3)),), start + hlen
    import io

    f = io.BytesIO(buf)
    np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return np.dtype(dtype), tuple(shape), f.tell()


def check_member(window: bytes, window_start: int, *, data_offset: int, length: int, dtype: np.dtype,
                 name: str | None) -> None:
    """Check the tar and ``.npy`` headers that end at ``data_offset`` (``window`` = file bytes from
    ``window_start`` to ``data_offset``) against the index: ``ValueError`` naming the first mismatch.

    ``name``: the member name the index implies (``None``: any ``*.npy`` name).
    """
    pos = window.rfind(NPY_MAGIC)
    if pos < TAR_BLOCK:
        raise ValueError(f"no tar member header with a .npy array ends at byte {data_offset}")
    try:
        info = tarfile.TarInfo.frombuf(window[pos - TAR_BLOCK:pos], "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:
        raise ValueError(f"no valid tar header in front of byte {data_offset} ({e})") from None
    try:
        dt, shape, hdr = parse_npy_header(window[pos:])
    except ValueError as e:
        raise ValueError(f"member {info.name}: {e}") from None
    if window_start + pos + hdr != data_offset:
        raise ValueError(f"member {info.name}'s token data starts at byte {window_start + pos + hdr}, "
                         f"the index says {data_offset}")
    if name is not None and info.name != name:
        raise ValueError(f"the member there is {info.name}, the index expects {name}")
    if not info.name.endswith(".npy"):
        raise ValueError(f"the member there is {info.name}, not a .npy token array")
    if shape != (length,):
        raise ValueError(f"member {info.name} holds {shape[0] if len(shape) == 1 else shape} tokens, "
                         f"the index says {length}")
    if dt.newbyteorder("<") != dtype and dt != dtype:
        raise ValueError(f"member {info.name} has dtype {dt}, the index says {dtype}")
    if info.size != hdr + length * dtype.itemsize:
        raise ValueError(f"member {info.name} is {info.size} bytes, its .npy header implies "
                         f"{hdr + length * dtype.itemsize}")
