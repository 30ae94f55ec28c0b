"""A corpus zoo from this machine's own files, for tests and benchmarks on data nobody tuned on.

Each corpus is a set of real files found at run time (nothing is downloaded or committed); a doc is
one file (``.gz`` files decompressed), or one line for ``lines``; lengths are byte-level token counts
(the project's default tokenizer: one token per byte). The planners were tuned on Wikipedia; these
differ in shape:

=============  ======================================================  ==================================
name           files                                                   character
=============  ======================================================  ==================================
wikipedia      the project's ``data/wikipedia_lengths.txt.gz``         prose, short-tailed (lengths only)
stdlib         the CPython standard library's ``*.py``                 code, ~1.8K docs, p99 ~160K
headers        every file under ``/usr/include``                       code, up to ~2.5M tokens
c_headers      the ``*.h`` files of ``/usr/include`` and CUDA          code, generated headers of ~1M
gcloud         the Google Cloud SDK's ``*.py``                         code, generated clients of ~6M
man            every page under ``/usr/share/man`` (gunzipped)         thousands of small prose docs
pkgdocs        every file under ``/usr/share/doc`` (gunzipped)         changelogs and copyrights, ~8M max
licenses       ``/usr/share/common-licenses``                          14 mid-size docs
license_texts  licenses, Debian copyrights, the SDK's ``LICENSE*.txt``  prose, one doc of ~2M
vimdoc         Vim's help files                                        prose, 151 docs, up to 1.6M
lines          each non-empty line of the stdlib's first 200 files     64K tiny docs
=============  ======================================================  ==================================

:func:`available` lists the corpora this machine has; a corpus whose folders are absent has no files.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from balanced_loader.build.corpus import stdlib_py_files


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooCorpus:
    name: str
    kind: str  # code / prose / tiny, for reports
    patterns: tuple[str, ...] = ()  # recursive globs
    walk: str | None = None  # every file under this folder


CORPORA = {c.name: c for c in (
    ZooCorpus(name="wikipedia", kind="prose"),  # a length file: lengths(..., wikipedia=PATH)
    ZooCorpus(name="stdlib", kind="code"),  # corpus.stdlib_py_files
    ZooCorpus(name="headers", kind="code", walk="/usr/include"),
    ZooCorpus(name="c_headers", kind="code", patterns=("/usr/include/**/*.h", "/usr/local/cuda*/include/**/*.h")),
    ZooCorpus(name="gcloud", kind="code", patterns=("/usr/lib/google-cloud-sdk/**/*.py",)),
    ZooCorpus(name="man", kind="prose", walk="/usr/share/man"),
    ZooCorpus(name="pkgdocs", kind="prose", walk="/usr/share/doc"),
    ZooCorpus(name="licenses", kind="prose", walk="/usr/share/common-licenses"),
    ZooCorpus(name="license_texts", kind="prose", patterns=("/usr/share/common-licenses/*", "/usr/share/doc/*/copyright",
                                                            "/usr/lib/google-cloud-sdk/**/LICENSE*.txt")),
    ZooCorpus(name="vimdoc", kind="prose", patterns=("/usr/share/vim/vim*/doc/*.txt",)),
    ZooCorpus(name="lines", kind="tiny"),  # each non-empty line of the stdlib's first files
)}


def files(name: str, *, limit: int | None = None) -> list[str]:
    """The corpus's files on this machine, sorted (empty when its folders are absent)."""
    c = _corpus(name)
    if name in ("stdlib", "lines"):
        try:
            return stdlib_py_files(limit if name == "stdlib" else (limit or 200))
        except ValueError:
            return []
    if name == "wikipedia":
        return []
    if c.walk is not None:
        out = []
        for dirpath, dirs, names in os.walk(c.walk):
            dirs.sort()
            out += [p for p in (os.path.join(dirpath, f) for f in sorted(names))
                    if os.path.isfile(p) and not os.path.islink(p)]
    else:
        out = sorted({p for pat in c.patterns for p in glob.glob(pat, recursive=True)
                      if os.path.isfile(p) and not os.path.islink(p)})
    return out[:limit] if limit is not None else out


def read_doc(path: str) -> bytes:
    """One file's bytes (a ``.gz`` decompressed; a file named ``.gz`` that is not gzip as it is)."""
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                return f.read()
        except (OSError, EOFError):
            pass
    with open(path, "rb") as f:
        return f.read()


def docs(name: str, *, limit: int | None = None) -> list[bytes]:
    """The corpus's docs (``lines``: every non-empty line of its files)."""
    if name == "lines":
        return [ln for p in files(name, limit=limit) for ln in read_doc(p).splitlines() if ln.strip()]
    return [read_doc(p) for p in files(name, limit=limit)]


def _length(path: str) -> int:
    """Byte-level tokens of one file (streamed through gzip for ``.gz``, else its size)."""
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                n = 0
                while chunk := f.read(1 << 20):
                    n += len(chunk)
                return n
        except (OSError, EOFError):
            pass
    return os.path.getsize(path)


def lengths(name: str, *, limit: int | None = None, wikipedia: str | None = None,
            cache_dir: str | None = None) -> np.ndarray:
    """``[num_docs]`` byte-level token counts in file order (empty files kept: they are docs of length 0).

    ``wikipedia``: the path of ``wikipedia_lengths.txt.gz`` (that corpus only). ``cache_dir``: keep a file
    corpus's lengths there as ``.npy``, keyed by its file list and sizes (gunzipping every man page takes
    a few seconds)."""
    _corpus(name)
    if name == "wikipedia":
        if not wikipedia or not os.path.exists(wikipedia):
            raise ValueError(f"corpus 'wikipedia' needs the lengths file (got {wikipedia!r})")
        with gzip.open(wikipedia) as f:
            return np.loadtxt(f, dtype=np.int64)
    if name == "lines":
        return np.asarray([len(d) for d in docs(name, limit=limit)], dtype=np.int64)
    paths = files(name, limit=limit)
    cached = None
    if cache_dir:
        key = hashlib.sha256("\n".join(f"{p}:{os.path.getsize(p)}" for p in paths).encode()).hexdigest()[:16]
        cached = os.path.join(cache_dir, f"zoo-{name}-{key}.npy")
        if os.path.exists(cached):
            return np.load(cached)
    out = np.asarray([_length(p) for p in paths], dtype=np.int64)
    if cached:
        os.makedirs(cache_dir, exist_ok=True)  # type: ignore[arg-type]
        tmp = f"{cached}.{os.getpid()}.tmp.npy"
        np.save(tmp, out)
        os.replace(tmp, cached)
    return out


def available(min_docs: int = 50) -> list[str]:
    """The file corpora with at least ``min_docs`` docs on this machine."""
    return [n for n in CORPORA if n != "wikipedia" and len(files(n)) >= (1 if n == "lines" else min_docs)]


def _corpus(name: str) -> ZooCorpus:
    if name not in CORPORA:
        raise ValueError(f"unknown zoo corpus '{name}'; one of {', '.join(CORPORA)}")
    return CORPORA[name]
