"""The bytes of a shard's tar members, built directly (stdlib and numpy only; imports nothing of ours).

:class:`~balanced_loader.data.shards.ShardWriter` writes one member per doc: a 512-byte GNU tar
header, a version 1.0 ``.npy`` header, the token bytes, NUL padding to 512 bytes; and the tar's end
(two zero blocks, NUL padding to a 10 KiB record). These functions give exactly the bytes that
``tarfile`` (``GNU_FORMAT``, a ``TarInfo`` with mode 0o644, mtime 0, uid/gid 0, no user or group
names) and ``numpy.lib.format.write_array(version=(1, 0))`` write, at a fraction of the cost
(``tarfile.TarInfo.tobuf`` was a third of a byte-tokenizer build). ``tests/balanced_loader/build/test_writer.py``
compares them with ``tarfile`` and numpy.
"""

from __future__ import annotations

import io

import numpy as np

TAR_BLOCK = 512
TAR_RECORD = 20 * TAR_BLOCK  # tarfile pads a closed archive to whole records
_NUL = b"\0"
# the fixed fields of a regular-file member header, around name [0:100], size [124:136] and checksum [148:156]
_MODE_UID_GID = b"0000644\0" + b"0000000\0" * 2  # [100:124]
_MTIME = b"00000000000\0"  # [136:148]
# [156:512]: type "0" (a regular file), linkname, GNU magic, uname, gname, devmajor, devminor (empty for a
# regular file), prefix, then NUL to the end of the block
_TAIL = b"0" + _NUL * 100 + b"ustar  \0" + _NUL * (32 + 32 + 8 + 8 + 155) + _NUL * 12
_FIXED_SUM = sum(_MODE_UID_GID) + sum(_MTIME) + sum(_TAIL) + 8 * ord(" ")  # the checksum counts its field as spaces


def size_field(n: int) -> bytes:
    """A 12-byte tar number field: 11 octal digits and a NUL, or GNU base-256 from 8 GiB on."""
    if 0 <= n < 8 ** 11:
        return b"%011o\0" % n
    if n < 256 ** 11:
        return bytes([0o200]) + n.to_bytes(11, "big")
    raise ValueError(f"a tar member of {n} bytes is too large")


def tar_member_header(name: str, size: int) -> bytes:
    """The 512-byte header of a regular file ``name`` (at most 100 bytes) of ``size`` bytes."""
    raw = name.encode()
    if len(raw) > 100:
        raise ValueError(f"tar member name {name!r} is longer than 100 bytes")
    sz = size_field(size)
    chk = _FIXED_SUM + sum(raw) + sum(sz)
    return b"".join((raw, _NUL * (100 - len(raw)), _MODE_UID_GID, sz, _MTIME, b"%06o\0 " % chk, _TAIL))


def tar_padding(size: int) -> bytes:
    """The NUL bytes after a member's ``size`` data bytes, up to the next 512-byte block."""
    return _NUL * (-size % TAR_BLOCK)


def tar_end(offset: int) -> bytes:
    """The end of an archive whose members end at ``offset``: two zero blocks, then NUL up to a whole record."""
    return _NUL * (2 * TAR_BLOCK + (-(offset + 2 * TAR_BLOCK) % TAR_RECORD))


def numpy_header(dtype: np.dtype, n: int) -> bytes:
    """The ``.npy`` version 1.0 header of a ``[n]`` C-order array of ``dtype``, as numpy writes it."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue()


class NpyHeaders:
    """``.npy`` headers of 1-D arrays of one dtype, fast: numpy's header depends on the length only through its
    decimal digits, so one numpy call per digit count gives a template; each header is then one formatting."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self._parts: dict[int, tuple[bytes, bytes]] = {}  # digits -> (before, after) the length

    def __call__(self, n: int) -> bytes:
        digits = b"%d" % n
        parts = self._parts.get(len(digits))
        if parts is None:
            probe = b"%d" % 10 ** (len(digits) - 1)  # a length with this many digits
            text = numpy_header(self.dtype, int(probe))
            key = b"'shape': ("
            assert text.count(key + probe + b",)") == 1, text  # numpy's dict layout, as write_array_header_1_0 has it
            at = text.find(key) + len(key)
            parts = self._parts[len(digits)] = (text[:at], text[at + len(probe):])
        return parts[0] + digits + parts[1]
