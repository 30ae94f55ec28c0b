"""Reading length files: ``.txt`` (one integer a line, optionally ``.gz``) or ``.npy``.

Every failure is one ``ValueError`` line naming the file and, where it applies, the line.
"""

from __future__ import annotations

import gzip
import io
import mmap
import os
import re
import warnings
import zlib
from typing import Any

import numpy as np

LENGTH_SUFFIXES = (".txt", ".txt.gz", ".gz", ".npy")
MAX_DOC_TOKENS = 1 << 40  # longest doc a length file may give (~1.1e12 tokens): sums stay far inside int64
_BLOCK = 1 << 22  # bytes of text parsed at a time
_MAX_LINE = 1 << 20  # a longer line is not a length
CHECK_DOCS = 1 << 20  # docs of an int64 length array checked or summed at a time (8 MB)


def read_lengths(path: str | os.PathLike[str], *, check: bool = True) -> np.ndarray:
    """Token lengths from ``path`` as ``[num_docs]`` int64, indexed by doc_id (file order).

    ``.npy``: a 1-D integer array (or floats with integer values); int64 is memory-mapped
    (read-only; ``check=False`` leaves its values to be checked where they are read, as batching
    does, since a full check touches every page), other dtypes are converted. Anything else is text:
    one integer per line (doc id = its line among the lengths), ``#`` comments ignored; a blank line
    before a later length is an error naming it (it would shift the ids of every doc below it: an
    empty doc is written ``0``); a name ending in ``.gz`` is gunzipped first. Lengths must be
    non-negative (0 marks an empty doc, which batching skips); whether they must be positive is the
    caller's rule.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ValueError(f"length file {p} does not exist")
    if os.path.isdir(p):
        raise ValueError(f"length file {p} is a directory; give a .txt, .txt.gz or .npy file "
                         f"(or --source for a shard folder)")
    if p.endswith(".npy"):
        arr = _read_npy(p)
        if isinstance(arr, np.memmap) and not check:
            return arr
    else:
        arr = _read_text(p)
    negative, over, _ = scan_lengths(arr)  # in blocks: a memory map's pages are released as it goes
    if negative is not None:
        i = negative
        raise ValueError(f"length file {p}: doc {i} has a negative length {int(arr[i])}")
    if over is not None:
        i = over
        raise ValueError(f"length file {p}: doc {i} has length {int(arr[i])}, over the limit of "
                         f"{MAX_DOC_TOKENS:,} tokens a doc")
    return arr


def release_pages(arr: Any) -> None:
    """Drop this process's mapping of a read-only memory-mapped array's pages (no-op otherwise).

    Touched pages of a mapped file count as resident memory; a streaming pass over a large
    length index calls this every so often so resident memory stays bounded (the pages stay
    in the page cache and map back in on the next touch).
    """
    base = arr
    while base is not None and not isinstance(base, mmap.mmap):
        if isinstance(base, np.memmap) and base.mode != "r":
            return  # a writable or copy-on-write map: dropping pages could lose data
        base = getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)


def scan_lengths(arr: np.ndarray) -> tuple[int | None, int | None, int]:
    """``(first negative doc, first doc over MAX_DOC_TOKENS, first doc of the largest length)`` of a
    ``[num_docs]`` integer array (None: no such doc; the last is 0 when empty).

    One pass in blocks of ``CHECK_DOCS`` docs with no full-size temporary; a memory map's pages are
    released after each block, so resident memory does not grow with the number of docs.
    """
    negative = over = None
    best, arg = None, 0
    for a in range(0, len(arr), CHECK_DOCS):
        block = np.asarray(arr[a:a + CHECK_DOCS])  # [<= CHECK_DOCS]
        lo, hi = int(block.min()), int(block.max())
        if negative is None and lo < 0:
            negative = a + int(np.flatnonzero(block < 0)[0])
        if over is None and hi > MAX_DOC_TOKENS:
            over = a + int(np.flatnonzero(block > MAX_DOC_TOKENS)[0])
        if best is None or hi > best:
            best, arg = hi, a + int(np.argmax(block))
        release_pages(arr)
    return negative, over, arg


def sum_lengths(arr: np.ndarray) -> int:
    """The total of a ``[num_docs]`` length array, in blocks (no full-size temporary; pages released)."""
    total = 0
    for a in range(0, len(arr), CHECK_DOCS):
        total += int(np.asarray(arr[a:a + CHECK_DOCS]).sum(dtype=np.int64))
        release_pages(arr)
    return total


def _read_npy(p: str) -> np.ndarray:
    try:
        raw = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"length file {p} is not a readable .npy array: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, np.ndarray) or raw.ndim != 1:
        shape = getattr(raw, "shape", None)
        raise ValueError(f"length file {p}: expected a 1-D array of lengths, got shape {shape}")
    if raw.dtype == np.dtype(np.int64):
        return raw  # [num_docs] memory-mapped: planning reads only the docs it batches
    if raw.dtype.kind in "iu":
        if raw.dtype.kind == "u" and raw.size and int(raw.max()) > MAX_DOC_TOKENS:  # before a wrapping cast
            i = int(np.argmax(raw))
            raise ValueError(f"length file {p}: doc {i} has length {int(raw[i])}, over the limit of "
                             f"{MAX_DOC_TOKENS:,} tokens a doc")
        return raw.astype(np.int64, copy=False)
    if raw.dtype.kind == "f":
        ok = np.isfinite(raw) & (raw == np.round(raw)) & (np.abs(raw) <= MAX_DOC_TOKENS)
        if raw.size and not np.all(ok):
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"length file {p}: doc {i} has a non-integer or out-of-range length {raw[i]!r}")
        return raw.astype(np.int64)
    raise ValueError(f"length file {p}: expected integer lengths, got dtype {raw.dtype}")


def _read_text(p: str) -> np.ndarray:
    """Stream the file in blocks of whole lines, parsing each into an array: peak memory is about
    twice the result plus one block, never the whole file as a string."""
    parts: list[np.ndarray] = []
    lines = 0  # lines before the current block
    blank: int | None = None  # a blank line no length has followed yet (fine at the end of the file)
    try:
        with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as f:
            rest = b""
            while True:
                chunk = f.read(_BLOCK)
                data = rest + chunk if rest else chunk
                cut = data.rfind(b"\n") + 1 if chunk else len(data)
                if chunk and cut == 0:  # no line end yet in this block
                    if len(data) > _MAX_LINE:
                        raise ValueError(f"length file {p}, line {lines + 1} is over {_MAX_LINE >> 20} MiB long; "
                                         f"expected one integer a line (or a .npy file)")
                    rest = data
                    continue
                block, rest = data[:cut], data[cut:]
                if block:
                    blank = _check_blank(p, block, lines, blank)
                    parts.append(_parse_block(p, block, lines))
                    lines += block.count(b"\n")
                if not chunk:
                    break
    except (OSError, EOFError, zlib.error) as e:
        msg = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"cannot read length file {p}: {msg}") from None
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


_BLANK_LINE = re.compile(rb"(?:^|\n)[ \t\r]*(?=\n)")  # a line of nothing but spaces, ended by its newline
_LENGTH_LINE = re.compile(rb"(?m)^[ \t\r]*[^#\s]")  # a line with something that is not a comment


def _check_blank(p: str, block: bytes, first_line: int, pending: int | None) -> int | None:
    """The line of a blank line no length has followed yet (``pending``: one from an earlier block);
    ValueError naming the blank line as soon as a length follows one. Why: doc ids are lines among the
    lengths, so skipping a blank line would silently give every doc below it its neighbour's id."""
    if pending is None and not (b"\n\n" in block or block.startswith(b"\n")
                                or any(c in block for c in (b" ", b"\t", b"\r"))):
        return None
    if pending is not None and _LENGTH_LINE.search(block):
        raise _blank_error(p, pending)
    if pending is None:
        m = _BLANK_LINE.search(block)
        if m is None:
            return None
        pending = first_line + block.count(b"\n", 0, m.end()) + 1
        if _LENGTH_LINE.search(block, m.end()):
            raise _blank_error(p, pending)
    return pending


def _blank_error(p: str, line: int) -> ValueError:
    return ValueError(f"length file {p}, line {line} is blank: every line gives one doc's length (doc id = its "
                      f"line among the lengths), so a skipped line would shift the ids of every doc below it; "
                      f"write 0 for an empty doc or remove the line")


def _parse_block(p: str, block: bytes, first_line: int) -> np.ndarray:
    """``[docs]`` int64 of one block of whole lines; errors name the file's line number."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"length file {p} is not text (expected one integer a line, or a .npy file)") from None
    lines = block.count(b"\n") + (not block.endswith(b"\n"))
    if not any(c in block for c in (b"#", b" ", b"\t", b"\r", b"\n\n")) and not block.startswith(b"\n"):
        # fastest path: one bare integer on every line, so the count below proves nothing was merged or skipped
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # numpy warns (or raises) on text it could not parse
                arr = np.fromstring(text, dtype=np.int64, sep="\n")  # saturates on overflow: the range check sees it
            if len(arr) == lines and (arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) <= MAX_DOC_TOKENS)):
                return arr
        except (ValueError, DeprecationWarning):
            pass
    try:  # fast path: numpy's C parser (skips blank lines and # comments)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data" for comment-only blocks
            arr = np.loadtxt(io.StringIO(text), dtype=np.int64, comments="#", ndmin=2)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.shape[1] == 1 and int(arr.min()) >= 0 and int(arr.max()) <= MAX_DOC_TOKENS:
            return arr.reshape(-1)
    except ValueError:
        pass
    # slow path, only for a block with a problem: find its line (numpy's row numbers skip comments)
    out: list[int] = []
    for k, line in enumerate(text.split("\n"), start=first_line + 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            v = int(s)
        except ValueError:
            raise ValueError(f"length file {p}, line {k}: {s[:40]!r} is not an integer length") from None
        if v < 0:
            raise ValueError(f"length file {p}, line {k}: negative length {v}")
        if v > MAX_DOC_TOKENS:
            raise ValueError(f"length file {p}, line {k}: length {v} is over the limit of {MAX_DOC_TOKENS:,} "
                             f"tokens a doc")
        out.append(v)
    return np.asarray(out, dtype=np.int64)


def doc_line(path: str | os.PathLike[str], doc: int) -> int | None:
    """The 1-based line of doc ``doc`` in a text length file (blank and comment lines skipped);
    ``None`` for ``.npy`` or when the file has fewer docs. For error messages only (re-reads the file)."""
    p = os.fspath(path)
    if p.endswith(".npy"):
        return None
    n = -1
    with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as f:
        for k, line in enumerate(f, start=1):
            if line.split(b"#", 1)[0].strip():
                n += 1
                if n == doc:
                    return k
    return None
