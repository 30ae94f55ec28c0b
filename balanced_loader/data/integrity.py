"""Integrity checks of shard folders (stdlib and numpy; of ours only release_pages from .lengths).

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
import zlib
from typing import IO, Any

import numpy as np

from balanced_loader.data.lengths import release_pages

CHECK_BLOCK_BYTES = 1024  # 0.4% of the token bytes; widens a partial read by ~1 KiB (4096 gave 1.3x bytes read)
TAR_BLOCK = 512
NPY_MAGIC = b"\x93NUMPY"
# the .npy header numpy writes for a 1-D array (version 1.0, padded to 64 bytes): 128 bytes
NPY_HEADER_GUESS = 128
_NPY_DICT = re.compile(rb"\{'descr': '([<>|=]?[a-z]\d+)', 'fortran_order': (True|False), 'shape': \((\d+),\), \}")


def num_blocks(nbytes: np.ndarray | int, block: int) -> np.ndarray | int:
    """Checksum blocks of docs of ``nbytes`` token bytes (0 for an empty doc)."""
    return -(-nbytes // block)


def lengths_fingerprint(lengths: np.ndarray) -> str:
    """A 32-hex-digit blake2b of a ``[num_docs]`` length array (as little-endian int64), in chunks
    so a memory-mapped index is never copied whole (and its pages are released as it goes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"lengths:{len(lengths)}:".encode())
    step = 1 << 20
    for i in range(0, len(lengths), step):
        h.update(np.ascontiguousarray(lengths[i:i + step], dtype="<i8").tobytes())
        release_pages(lengths)
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


_DTYPES: dict[bytes, np.dtype] = {}


def _dtype(descr: bytes) -> np.dtype:
    dt = _DTYPES.get(descr)
    if dt is None:
        dt = _DTYPES[descr] = np.dtype(descr.decode())
    return dt


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
        return _dtype(m.group(1)), (int(m.group(3)),), start + hlen
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
    member, size = tar_header(window[pos - TAR_BLOCK:pos], data_offset)
    try:
        dt, shape, hdr = parse_npy_header(window[pos:])
    except ValueError as e:
        raise ValueError(f"member {member}: {e}") from None
    if window_start + pos + hdr != data_offset:
        raise ValueError(f"member {member}'s token data starts at byte {window_start + pos + hdr}, "
                         f"the index says {data_offset}")
    if name is not None and member != name:
        raise ValueError(f"the member there is {member}, the index expects {name}")
    if len(member) < 99 and not member.endswith(".npy"):  # (a longer name may be cut short in this header)
        raise ValueError(f"the member there is {member}, not a .npy token array")
    if shape != (length,):
        raise ValueError(f"member {member} holds {shape[0] if len(shape) == 1 else shape} tokens, "
                         f"the index says {length}")
    if dt.newbyteorder("<") != dtype and dt != dtype:
        raise ValueError(f"member {member} has dtype {dt}, the index says {dtype}")
    if size != hdr + length * dtype.itemsize:
        raise ValueError(f"member {member} is {size} bytes, its .npy header implies "
                         f"{hdr + length * dtype.itemsize}")


def tar_header(block: bytes, where: int) -> tuple[str, int]:
    """``(name, size)`` of a 512-byte tar header whose checksum is right; ``ValueError`` otherwise.

    A small parser of the fields the check needs (``tarfile.TarInfo.frombuf`` costs ~10x more
    and this runs once per doc read).
    """

    def octal(field: bytes) -> int:
        if field[:1] and field[0] & 0x80:  # GNU base-256 for large values
            return int.from_bytes(field[1:], "big")
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)

    try:
        chksum = octal(block[148:156])
        size = octal(block[124:136])
    except ValueError:
        raise ValueError(f"no valid tar header in front of byte {where}") from None
    if chksum != sum(block) - sum(block[148:156]) + 8 * 32:  # the checksum counts its own field as spaces
        raise ValueError(f"no valid tar header in front of byte {where} (bad header checksum)")
    name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0] if block[257:263] == b"ustar\0" else b""  # POSIX long names
    if prefix:
        name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size
