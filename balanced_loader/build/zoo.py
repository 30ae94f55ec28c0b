"""A corpus zoo from this machine's own files, for tests and benchmarks on data nobody tuned on.

Each corpus is a set of real files found at run time (nothing is downloaded or committed); a doc is
one file (``.gz`` files decompressed), or one line for ``lines``; lengths are byte-level token counts.
They differ in shape: code with generated files hundreds of times any context (``gcloud``,
``headers``), prose with multi-MB license collections (``licenses``), thousands of small man pages
(``man``), tens of thousands of tiny docs (``lines``), and the demo corpus (``stdlib``).
:func:`available` lists the corpora this machine has; a corpus whose folders are absent has no files.
"""

from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass

import numpy as np

from balanced_loader.build.corpus import stdlib_py_files


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooCorpus:
    name: str
    kind: str  # code / prose / tiny, for reports
    patterns: tuple[str, ...]  # recursive globs


CORPORA = {c.name: c for c in (
    ZooCorpus(name="stdlib", kind="code", patterns=()),  # the demo corpus: corpus.stdlib_py_files
    ZooCorpus(name="headers", kind="code", patterns=("/usr/include/**/*.h", "/usr/local/cuda*/include/**/*.h")),
    ZooCorpus(name="gcloud", kind="code", patterns=("/usr/lib/google-cloud-sdk/**/*.py",)),
    ZooCorpus(name="licenses", kind="prose", patterns=("/usr/share/common-licenses/*", "/usr/share/doc/*/copyright",
                                                       "/usr/lib/google-cloud-sdk/**/LICENSE*.txt")),
    ZooCorpus(name="man", kind="prose", patterns=("/usr/share/man/man*/*.gz",)),
    ZooCorpus(name="vimdoc", kind="prose", patterns=("/usr/share/vim/vim*/doc/*.txt",)),
    ZooCorpus(name="lines", kind="tiny", patterns=()),  # each non-empty line of the stdlib's first files
)}


def files(name: str, *, limit: int | None = None) -> list[str]:
    """The corpus's files on this machine, sorted (empty when its folders are absent)."""
    c = _corpus(name)
    if name in ("stdlib", "lines"):
        try:
            return stdlib_py_files(limit if name == "stdlib" else (limit or 200))
        except ValueError:
            return []
    out = sorted({p for pat in c.patterns for p in glob.glob(pat, recursive=True)
                  if os.path.isfile(p) and not os.path.islink(p)})
    return out[:limit] if limit is not None else out


def read_doc(path: str) -> bytes:
    """One file's bytes (a ``.gz`` decompressed)."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def docs(name: str, *, limit: int | None = None) -> list[bytes]:
    """The corpus's docs (``lines``: every non-empty line of its files)."""
    if name == "lines":
        return [ln for p in files(name, limit=limit) for ln in read_doc(p).splitlines() if ln.strip()]
    return [read_doc(p) for p in files(name, limit=limit)]


def lengths(name: str, *, limit: int | None = None) -> np.ndarray:
    """``[num_docs]`` byte-level token counts (files sized without reading them, but ``.gz`` and ``lines``)."""
    if name == "lines" or name == "man":
        return np.asarray([len(d) for d in docs(name, limit=limit)], dtype=np.int64)
    return np.asarray([os.path.getsize(p) for p in files(name, limit=limit)], dtype=np.int64)


def available(min_docs: int = 50) -> list[str]:
    """The corpora with at least ``min_docs`` docs on this machine."""
    return [n for n in CORPORA if len(files(n)) >= (1 if n == "lines" else min_docs)]


def _corpus(name: str) -> ZooCorpus:
    if name not in CORPORA:
        raise ValueError(f"unknown zoo corpus '{name}'; one of {', '.join(CORPORA)}")
    return CORPORA[name]
