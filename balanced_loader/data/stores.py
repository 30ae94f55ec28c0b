"""Where a shard folder's bytes come from: :class:`LocalStore` (``os.pread``) and the store protocol.

:class:`~balanced_loader.data.shards.ShardSource` reads through a store, so the checks (tar and
``.npy`` headers, checksums) and their errors are one code path for every kind of folder. A store
gives byte ranges of the folder's files by name and loads the small index arrays:

* ``path(name)``: the file's path or URL (for messages);
* ``pread(name, n, offset)``: up to ``n`` bytes at ``offset`` (fewer only at the end of the file);
* ``load_array(name, what, fix)``: a ``.npy`` file of the folder as an array (memory-mapped where possible);
* ``close()``: release open files (reads reopen them).

A remote store (:mod:`.remote`) also has ``open_index()`` and ``pread_many(ranges)`` (concurrent).
Stdlib and numpy only; imports nothing of ours.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(spec: Any) -> bool:
    """Whether ``spec`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(spec, str) and _URL.match(spec) is not None


class LocalStore:
    """A local folder: cached file descriptors (at most ``max_open_files``) and ``os.pread``; thread-safe."""

    remote = False

    def __init__(self, folder: str, max_open_files: int = 64) -> None:
        self.folder = folder
        self.max_open_files = max_open_files
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ValueError(f"shard {path} cannot be opened: {e.strerror}") from None
        self._fds[name] = fd
        while len(self._fds) > self.max_open_files:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def pread(self, name: str, n: int, offset: int) -> bytes:
        with self._lock:
            return os.pread(self._fd(name), n, offset)

    def load_array(self, name: str, what: str, fix: str) -> np.ndarray:
        """A memory-mapped ``.npy`` of the folder; one ``ValueError`` (``what PATH cannot be read (...); fix``)."""
        path = self.path(name)
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{what} {path} cannot be read ({e}); {fix}") from None

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])

    def __del__(self, _close: Any = os.close) -> None:
        # may run at interpreter exit, when module globals (os, contextlib) are gone: os.close is bound
        # as a default argument and errors are not reported
        fds = getattr(self, "_fds", None)
        while fds:
            try:  # noqa: SIM105 - contextlib may already be torn down
                _close(fds.popitem()[1])
            except Exception:
                pass
