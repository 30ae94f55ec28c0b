"""Reading length files: ``.txt`` (one integer a line, optionally ``.gz``) or ``.npy``.

Every failure is one ``ValueError`` line naming the file and, where it applies, the line.
"""

from __future__ import annotations

import gzip
import io
import os
import warnings

import numpy as np

LENGTH_SUFFIXES = (".txt", ".txt.gz", ".gz", ".npy")


def read_lengths(path: str | os.PathLike[str]) -> np.ndarray:
    """Token lengths from ``path`` as ``[num_docs]`` int64, indexed by doc_id (file order).

    ``.npy``: a 1-D integer array (or floats with integer values). Anything else is text:
    one integer per line, blank lines and ``#`` comments ignored; a name ending in ``.gz``
    is gunzipped first. Lengths must be non-negative (0 marks an empty doc, which batching
    skips); whether they must be positive is the caller's rule.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ValueError(f"length file {p} does not exist")
    if os.path.isdir(p):
        raise ValueError(f"length file {p} is a directory; give a .txt, .txt.gz or .npy file "
                         f"(or --source for a shard folder)")
    if p.endswith(".npy"):
        arr = _read_npy(p)
    else:
        arr = _read_text(p)
    if arr.size and int(arr.min()) < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"length file {p}: doc {i} has a negative length {int(arr[i])}")
    return arr


def _read_npy(p: str) -> np.ndarray:
    try:
        raw = np.load(p, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"length file {p} is not a readable .npy array: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, np.ndarray) or raw.ndim != 1:
        shape = getattr(raw, "shape", None)
        raise ValueError(f"length file {p}: expected a 1-D array of lengths, got shape {shape}")
    if raw.dtype.kind in "iu":
        return raw.astype(np.int64, copy=False)
    if raw.dtype.kind == "f":
        if raw.size and not np.all(np.isfinite(raw) & (raw == np.round(raw))):
            i = int(np.flatnonzero(~(np.isfinite(raw) & (raw == np.round(raw))))[0])
            raise ValueError(f"length file {p}: doc {i} has a non-integer length {raw[i]!r}")
        return raw.astype(np.int64)
    raise ValueError(f"length file {p}: expected integer lengths, got dtype {raw.dtype}")


def _read_text(p: str) -> np.ndarray:
    try:
        if p.endswith(".gz"):
            with gzip.open(p, "rb") as f:
                data = f.read()
        else:
            with open(p, "rb") as f:
                data = f.read()
    except (OSError, EOFError) as e:
        msg = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"cannot read length file {p}: {msg}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"length file {p} is not text (expected one integer a line, or a .npy file)") from None
    if not text.strip():
        return np.zeros(0, dtype=np.int64)
    try:  # fast path: plain integers, one a line
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data" for comment-only files
            arr = np.loadtxt(io.StringIO(text), dtype=np.int64, comments="#", ndmin=1)
        if arr.ndim == 1:
            return arr
    except ValueError:
        pass
    out: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            out.append(int(s))
        except ValueError:
            raise ValueError(f"length file {p}, line {lineno}: {s[:40]!r} is not an integer length") from None
    return np.asarray(out, dtype=np.int64)
