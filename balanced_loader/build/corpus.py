"""The bundled real corpus: the CPython standard library's ``.py`` files, found at run time.

About 1.8k files, long-tailed (p50 6.5 KB, p99 160 KB, max 757 KB on CPython 3.11): with
the byte-level tokenizer that is code of ~6.5k tokens at p50 and ~160k at p99.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_py_files(limit: int | None = None) -> list[str]:
    """The standard library's ``*.py`` files (no site-packages), sorted by path relative to the root."""
    root = stdlib_root()
    if not os.path.isdir(root):
        raise ValueError(f"the standard library folder {root} does not exist in this Python")
    rel: list[str] = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        base = os.path.relpath(dirpath, root)
        rel.extend(os.path.normpath(os.path.join(base, f)) for f in files if f.endswith(".py"))
    rel.sort()
    if limit is not None:
        rel = rel[:limit]
    return [os.path.join(root, r) for r in rel]


def stdlib_shards(out_dir: str, *, limit: int | None = None, max_shard_bytes: int = 4 << 20,
                  progress: bool = False) -> Any:
    """Byte-level shards of the stdlib corpus in ``out_dir``, built once and reused (a ShardSource).

    A folder whose index holds the same number of docs from the byte-level tokenizer is
    reused; an incomplete or different folder is rebuilt (only shard and index files are removed).
    """
    from balanced_loader.build.builder import build_from_files
    from balanced_loader.data.index import INDEX_FILE, META_FILE
    from balanced_loader.data.shards import ShardSource

    files = stdlib_py_files(limit)
    if os.path.exists(os.path.join(out_dir, INDEX_FILE)):
        try:
            src = ShardSource(out_dir)
            if src.num_docs == len(files) and (src.tokenizer or {}).get("name") == "bytes" and src.has_checksums:
                return src
        except ValueError:
            pass
    if os.path.isdir(out_dir):  # the build publishes the folder whole: clear what an older build left
        for f in os.listdir(out_dir):
            if f.endswith((".tar", ".npy", ".tmp")) or f in (INDEX_FILE, META_FILE):
                os.remove(os.path.join(out_dir, f))
    build_from_files(files, out_dir, max_shard_bytes=max_shard_bytes, progress=progress)
    return ShardSource(out_dir)
