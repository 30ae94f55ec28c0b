"""Byte ranges of plain data files (Megatron ``.bin``/``.idx``, datatrove ``.ds``/``.ds.index``), local or remote.

A shard folder's remote store (:class:`~balanced_loader.data.remote.RemoteStore`) checks that the
server honours ``Range`` by reading 16 bytes of ``index.json``; a folder of other tools' files has
no ``index.json``, so :class:`FileStore` probes a file the caller names instead (the ``.idx``, a
``.ds.index``). Everything else (exact range reads, concurrent prefetch, retries with backoff,
timeouts, the whole-file cache) is the shard folders' remote code, unchanged. Locally the store is
the shard folders' :class:`~balanced_loader.data.stores.LocalStore` (``os.pread``).

:func:`open_store` gives ``(store, name)`` for a path or URL; a store also answers ``size(name)``
and ``fetch(name)`` (a whole small file).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Any

from balanced_loader.data.remote import PROBE_BYTES, RemoteStore
from balanced_loader.data.stores import LocalStore, is_url

REMOTE_KEYS = ("cache_dir", "cache_shards", "storage_options", "read_timeout_s", "retries")


class LocalFiles(LocalStore):
    """A local folder's files: ``os.pread`` reads, ``size`` and ``fetch`` (one ``ValueError`` naming the file)."""

    def size(self, name: str) -> int:
        try:
            return os.path.getsize(self.path(name))
        except OSError as e:
            raise ValueError(f"{self.path(name)} cannot be read: {e.strerror}") from None

    def exists(self, name: str) -> bool:
        return os.path.isfile(self.path(name))

    def fetch(self, name: str) -> bytes:
        try:
            with open(self.path(name), "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{self.path(name)} cannot be read: {e.strerror}") from None

    def listdir(self) -> list[str]:
        return sorted(os.listdir(self.folder))

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "max_open_files": self.max_open_files}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["max_open_files"])  # type: ignore[misc]


class FileStore(RemoteStore):
    """A remote folder of plain files: the Range probe reads ``probe`` (one of its files); ``cache_dir`` with
    ``cache_shards=True`` keeps whole files there (checked against their size)."""

    def __init__(self, url: str, *, probe: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.probe = probe
        if self.cache_dir is not None:  # where RemoteStore._download keeps whole files
            key = hashlib.blake2b(self.url.encode(), digest_size=8).hexdigest()
            self._cache = os.path.join(self.cache_dir, key)
            try:
                os.makedirs(self._cache, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cache folder {self._cache} cannot be made: {e.strerror}") from None

    def _check_ranges(self) -> None:
        if self._ranges_checked:
            return
        got = self._fetch(self.probe, 0, PROBE_BYTES)
        if len(got) != PROBE_BYTES:
            raise ValueError(f"the server of {self.url} ignores HTTP range requests (asked for {PROBE_BYTES} bytes "
                             f"of {self.probe}, got {len(got)}): reading tokens would download whole files; serve "
                             f"them from a server that answers Range with 206 Partial Content, or pass "
                             f"cache_dir=DIR, cache_shards=True to download each file once")
        self._ranges_checked = True

    def size(self, name: str) -> int:
        url = self.path(name)
        try:
            return int(self._retrying(url, lambda fs: fs.size(f"{self._root}/{name}")))
        except FileNotFoundError:
            raise ValueError(f"{url} is not there (404)") from None

    def exists(self, name: str) -> bool:
        # through the size (HEAD over HTTP): fsspec's HTTP exists() GETs the whole file
        try:
            self._retrying(self.path(name), lambda fs: fs.size(f"{self._root}/{name}"))
        except (FileNotFoundError, ValueError):
            return False
        return True

    def fetch(self, name: str) -> bytes:
        return self._fetch(name, missing=f"{self.path(name)} is not there (404)")

    def listdir(self) -> list[str]:
        try:
            found = self._retrying(self.url, lambda fs: fs.ls(self._root, detail=False))
        except FileNotFoundError:
            raise ValueError(f"{self.url} is not a folder the server lists") from None
        return sorted(posixpath.basename(str(p).rstrip("/")) for p in found)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "probe": self.probe}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        url = state.pop("url")
        self.__init__(url, **state)  # type: ignore[misc]


def split_location(path: str) -> tuple[str, str]:
    """``(folder or folder URL, file name)`` of a local path or a URL."""
    if is_url(path):
        folder, _, name = path.rstrip("/").rpartition("/")
        return folder, name
    folder, name = os.path.split(os.path.abspath(path))
    return folder, name


def open_store(folder: str, probe: str, remote: dict[str, Any] | None = None) -> Any:
    """A store for the files of ``folder`` (a local folder or a folder URL); ``probe``: the file a remote
    store reads 16 bytes of to check that the server honours ``Range`` (before its first token read)."""
    if not is_url(folder):
        return LocalFiles(folder)
    opts = {k: v for k, v in (remote or {}).items() if k in REMOTE_KEYS and v is not None}
    return FileStore(folder, probe=probe, **opts)
