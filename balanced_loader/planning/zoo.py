"""A zoo of real length corpora from this machine's own files, and global batches cut as the loader cuts them.

Planners are tuned on Wikipedia; these corpora are what they were not tuned on (byte-level token
counts, the project's default tokenizer: one token per byte of the file, ``.gz`` files decompressed):

==========  =====================================================  ======================================
name        files                                                  character
==========  =====================================================  ======================================
wikipedia   ``data/wikipedia_lengths.txt.gz`` (FlexSP's 1M docs)   prose, short-tailed (the tuned regime)
stdlib      the CPython standard library's ``*.py``                code, ~1.8K docs, p99 ~160K tokens
headers     every file under ``/usr/include``                      code, ~8K docs, up to ~2.5M tokens
man         every page under ``/usr/share/man`` (gunzipped)        thousands of tiny docs
pkgdocs     every file under ``/usr/share/doc`` (gunzipped)        changelogs and copyrights, up to ~8M
licenses    ``/usr/share/common-licenses``                         14 mid-size docs
==========  =====================================================  ======================================

:func:`step_batches` cuts global batches the way the loader does with ``long_docs: split``: each doc
becomes sequences of at most ``max_seq_len`` tokens (``max_seq_len`` pieces and the rest), the
sequences are shuffled (seeded), and a step takes consecutive sequences while the next one still fits
the token budget. Docs hundreds of times the context become many equal ``max_seq_len`` sequences.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sysconfig

import numpy as np

ROOTS = {
    "stdlib": None,  # sysconfig's stdlib of the running Python
    "headers": "/usr/include",
    "man": "/usr/share/man",
    "pkgdocs": "/usr/share/doc",
    "licenses": "/usr/share/common-licenses",
}
CORPORA = ("wikipedia", *ROOTS)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _files(name: str) -> list[str]:
    root = ROOTS[name] or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"corpus '{name}': folder {root} does not exist on this machine")
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            if name == "stdlib" and not f.endswith(".py"):
                continue
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            out.append(p)
    return out


def _byte_length(path: str) -> int:
    """Tokens of one file with the byte-level tokenizer: its bytes (decompressed for ``.gz``)."""
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                n = 0
                while chunk := f.read(1 << 20):
                    n += len(chunk)
                return n
        except (OSError, EOFError):  # not really gzip: count the file as it is
            pass
    return os.path.getsize(path)


def corpus_lengths(name: str, *, wikipedia: str | None = None, cache_dir: str | None = None) -> np.ndarray:
    """``[docs]`` int64 token lengths of one corpus of the zoo (empty files dropped), in file order.

    ``wikipedia``: the path of ``wikipedia_lengths.txt.gz`` (needed for that corpus). ``cache_dir``: keep
    each file corpus's lengths there as ``.npy``, keyed by its file list and sizes (reading ~25K files and
    gunzipping the man pages takes a few seconds)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus '{name}'; choose one of: {', '.join(CORPORA)}")
    if name == "wikipedia":
        if not wikipedia or not os.path.exists(wikipedia):
            raise ValueError(f"corpus 'wikipedia' needs the lengths file (got {wikipedia!r})")
        with gzip.open(wikipedia) as f:
            out = np.loadtxt(f, dtype=np.int64)
        return out[out > 0]
    files = _files(name)
    key = hashlib.sha256("\n".join(f"{p}:{os.path.getsize(p)}" for p in files).encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir, f"zoo-{name}-{key}.npy") if cache_dir else None
    if cached and os.path.exists(cached):
        return np.load(cached)
    out = np.asarray([_byte_length(p) for p in files], dtype=np.int64)
    out = out[out > 0]
    if cached:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp.npy"
        np.save(tmp, out)
        os.replace(tmp, cached)
    return out


def sequences(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """``[sequences]`` each doc cut into ``max_seq_len`` pieces and its rest (``long_docs: split``), doc order."""
    ln = np.asarray(lengths, dtype=np.int64)
    full = ln // max_seq_len  # [docs] whole pieces
    rest = ln % max_seq_len  # [docs]
    count = full + (rest > 0)
    out = np.full(int(count.sum()), max_seq_len, dtype=np.int64)
    last = np.cumsum(count) - 1  # [docs] index of each doc's last sequence
    has_rest = rest > 0
    out[last[has_rest]] = rest[has_rest]
    return out


def step_batches(lengths: np.ndarray, max_seq_len: int, budget: int, count: int, seed: int = 0
                 ) -> list[np.ndarray]:
    """The first ``count`` global batches (``[sequences]`` lengths each) of a seeded shuffle of the sequences:
    each the consecutive sequences while the next still fits ``budget`` tokens (fewer when the corpus ends)."""
    seq = sequences(lengths, max_seq_len)
    seq = seq[np.random.default_rng(seed).permutation(len(seq))]
    cum = np.cumsum(seq)  # [sequences]
    out, pos, base = [], 0, 0
    for _ in range(count):
        if pos >= len(seq):
            break
        end = int(np.searchsorted(cum, base + budget, side="right"))
        end = max(end, pos + 1)
        out.append(seq[pos:end])
        base = int(cum[end - 1])
        pos = end
    return out
