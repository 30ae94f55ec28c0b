"""Remote shard folders (``http(s)://``, ``s3://``, ``gs://``, any fsspec URL): byte-range reads.

:func:`open_remote` opens a folder written by ``balanced-loader build-shards`` and uploaded as is.
A :class:`RemoteStore` gives :class:`~balanced_loader.data.shards.ShardSource` the same byte
ranges a local folder gives through ``os.pread``, so the header and checksum checks are the
local ones:

* ``index.json``, the index arrays (``index.*.npy``) and ``shards.crc.npy`` are fetched once,
  into memory or, with ``cache_dir``, into a cache folder keyed by the URL and the exact
  ``index.json`` (a re-uploaded folder gets a fresh cache entry; stale ones are never read);
* every token read is one ``fs.cat_file(path, start, end)``: exactly the bytes asked for, no
  file object and so no read-ahead or block cache; the loader announces a step's reads
  (``ShardSource.prefetch``), which are then fetched concurrently (``fs.cat_ranges``);
* ``cache_shards=True`` (with ``cache_dir``) downloads a shard whole on its first read, checks
  its size and crc32, and reads it locally from then on. A rank that needs a few docs of a
  shard then transfers all of it: worth it when the cache is shared by several runs or epochs,
  not for one pass where each rank reads a fraction of each shard.

The index is never built over the network: a folder without one is a ``ValueError`` saying how
to write it. A server that ignores ``Range`` (fsspec's ``cat_file`` would silently download the
whole file for every read) is detected by a 16-byte probe before the first token read and by the
length of every read; reading only the index (planning, ``analyze``) works on such a server.

Every request has a read timeout of its own (``read_timeout_s``, default 60 s: a stalled server
fails a read in that time, one line) and transient failures (HTTP 5xx and 429, a dropped or reset
connection) are retried ``retries`` times (default 3) with exponential backoff (0.5 s, 1 s, 2 s ...)
before one line names the URL and the last error. fsspec (and aiohttp for HTTP) is imported only
here, when a URL is opened.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from typing import Any

import numpy as np

from balanced_loader.data.index import ARRAYS, INDEX_FILE, INDEX_FORMAT, array_name, parse_index_json
from balanced_loader.data.integrity import file_crc32
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.stores import LocalStore
from balanced_loader.outputs.files import atomic_path, atomic_write

REMOTE_EXTRA = "pip install 'balanced-loader[remote]'"
# the package a URL scheme's fsspec backend lives in (fsspec's own message names it too, not always this plainly)
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko",
            "oci": "ocifs", "oss": "ossfs", "hdfs": "pyarrow", "webhdfs": "requests", "dropbox": "dropboxdrivefs"}
PROBE_BYTES = 16  # a range read of index.json on opening: a longer answer means the server ignores Range
CONNECT_TIMEOUT_S = 30.0  # HTTP: a host that does not answer fails in this time, not aiohttp's 5 minutes
READ_TIMEOUT_S = 60.0  # HTTP: a server that stops sending fails a read in this time (read_timeout_s)
RETRIES = 3  # transient failures (5xx, 429, dropped connections) retried this often (retries)
BACKOFF_S = 0.5  # the first retry waits this long, each next one twice as long
INDEX_HOWTO = ("build it on the local folder (balanced-loader index DIR; build-shards writes it), then upload "
               "index.json and index.*.npy next to the shards")


def _status(e: BaseException) -> int | None:
    s = getattr(e, "status", None) or getattr(e, "code", None)
    return s if isinstance(s, int) else None


def _is_timeout(e: BaseException) -> bool:
    import asyncio

    return isinstance(e, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(e).__name__


def _is_transient(e: BaseException) -> bool:
    """A failure worth retrying: HTTP 5xx / 429, or a connection that was dropped or reset mid-answer."""
    status = _status(e)
    if status is not None:
        return status >= 500 or status == 429
    if _is_timeout(e):
        return False  # a stalled server: the read timeout already waited; fail now
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ClientConnectionError",
                         "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "IncompleteRead"})


def _reach_hint(url: str) -> str:
    return (f"cannot reach {url}: check the URL, that the server is up and reachable from this machine "
            f"(network, proxy, firewall) and your credentials")


class RemoteStore:
    """A shard folder at an fsspec URL: its index, fetched once (optionally cached), and exact range reads.

    Picklable (its URL and options; it reconnects where it is unpickled, e.g. in DataLoader
    workers), and it reconnects in a forked child. ``bytes_fetched`` counts every byte
    transferred, the index files included.
    """

    remote = True

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None, cache_shards: bool = False,
                 storage_options: dict[str, Any] | None = None, read_timeout_s: float = READ_TIMEOUT_S,
                 retries: int = RETRIES) -> None:
        if cache_shards and cache_dir is None:
            raise ValueError("cache_shards=True needs a cache_dir to keep the shards in")
        if (isinstance(read_timeout_s, bool) or not isinstance(read_timeout_s, (int, float))
                or not 0 < read_timeout_s <= 1e6):
            raise ValueError(f"read_timeout_s must be a number of seconds in (0, 1e6], got {read_timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
            raise ValueError(f"retries must be an integer in 0..10, got {retries!r}")
        self.read_timeout_s = float(read_timeout_s)
        self.retries = retries
        self._ranges_checked = False  # the Range probe runs before the first token read, not on opening
        self.url = url.rstrip("/")
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_shards = bool(cache_shards)
        self.storage_options = dict(storage_options or {})
        self.bytes_fetched = 0
        self._fs: Any = None
        self._pid = 0  # the process that made self._fs
        self._root = ""
        self._cache: str | None = None  # this index version's cache folder
        self._shards: dict[str, dict[str, Any]] = {}  # shard name -> its index entry (bytes, crc32)
        self._local: LocalStore | None = None  # reads of cached shards
        self._lock = threading.Lock()
        self._downloads: dict[str, threading.Lock] = {}

    def path(self, name: str) -> str:
        return f"{self.url}/{name}"

    # -- connecting and fetching ------------------------------------------------------------

    def _connect(self) -> Any:
        if self._fs is not None and self._pid == os.getpid():
            return self._fs
        # (re)connect: first use, or a forked child (DataLoader workers), where fsspec's async
        # filesystems refuse to run ("not fork-safe") and a fresh instance is needed
        self._pid = os.getpid()
        scheme = self.url.split("://", 1)[0].lower()
        try:
            import fsspec  # an optional dependency: imported only when a URL is opened
        except ImportError:
            raise ValueError(f"reading {self.url} needs fsspec: {REMOTE_EXTRA}") from None
        opts = dict(self.storage_options)
        if scheme in ("http", "https") and "client_kwargs" not in opts:
            try:
                import aiohttp
            except ImportError:
                raise ValueError(f"reading {self.url} needs aiohttp: {REMOTE_EXTRA}") from None
            opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=min(CONNECT_TIMEOUT_S, self.read_timeout_s), sock_read=self.read_timeout_s)}
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **opts)
        except ImportError as e:
            pkg = BACKENDS.get(scheme)
            if scheme in ("http", "https"):
                hint = REMOTE_EXTRA
            else:
                hint = f"pip install {pkg}" if pkg else f"install the fsspec backend for {scheme}://"
            raise ValueError(f"reading {scheme}:// URLs ({self.url}) needs fsspec's {scheme} backend, which is not "
                             f"installed ({e}): {hint}") from None
        except ValueError as e:
            raise ValueError(f"{self.url}: fsspec cannot open this URL ({e}); use http(s)://, s3://, gs:// "
                             f"or another fsspec protocol") from None
        self._fs, self._root = fs, root.rstrip("/")
        return fs

    def _fetch(self, name: str, start: int | None = None, end: int | None = None, *,
               missing: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file of the folder (all of it without a range); transient failures are
        retried with backoff, then every failure is one ``ValueError`` naming the URL (``missing``: the
        message for a file that is not there)."""
        url = self.path(name)
        try:
            buf = self._retrying(url, lambda fs: fs.cat_file(f"{self._root}/{name}", start=start, end=end))
        except FileNotFoundError:
            raise ValueError(missing or f"{url} is not there (404): the folder on the server is incomplete; "
                                        f"upload it again whole") from None
        if buf is None:  # 416: a range past the end: the file is shorter than the index says
            return b""
        with self._lock:
            self.bytes_fetched += len(buf)
        return buf

    def _retrying(self, url: str, call: Any) -> Any:
        """``call(fs)``, retried with backoff on transient failures; a ``FileNotFoundError`` propagates,
        HTTP 416 returns ``None``, any other failure is one ``ValueError`` (:meth:`_failure`)."""
        for attempt in range(self.retries + 1):
            fs = self._connect()
            try:
                return call(fs)
            except FileNotFoundError:
                raise
            except Exception as e:  # a network library's errors, translated into one line for the user
                if _status(e) == 416:
                    return None
                if _is_transient(e) and attempt < self.retries:
                    time.sleep(BACKOFF_S * 2 ** attempt)
                    continue
                raise self._failure(url, e, attempt + 1) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _failure(self, url: str, e: BaseException, attempts: int) -> BaseException:
        """One line for a request that failed for good (after ``attempts`` tries)."""
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        status = _status(e)
        if status is not None:
            hint = ("the server is failing or overloaded: try again later, or raise retries" if _is_transient(e)
                    else "check the URL and your access to it")
            return ValueError(f"{url}: the server answered HTTP {status} ({getattr(e, 'message', e)}){tries}; {hint}")
        if isinstance(e, PermissionError):
            return ValueError(f"{url}: access denied ({e}); check your credentials (storage_options)")
        if _is_timeout(e):
            return ValueError(f"{url}: no answer within the read timeout of {self.read_timeout_s:g} s (a stalled "
                              f"server or network); check the server, or raise read_timeout_s "
                              f"(data.read_timeout_s in a recipe)")
        if isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("aiohttp", "fsspec"):
            return ValueError(f"{_reach_hint(url)} ({type(e).__name__}: {e}){tries}"[:600])
        return e

    # -- the index --------------------------------------------------------------------------

    def open_index(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The index JSON and its arrays; the index must be complete (it is never built remotely)."""
        where = self.path(INDEX_FILE)
        raw = self._fetch(INDEX_FILE, missing=f"{where} not found: a remote shard folder needs its length index "
                                              f"(build-shards writes it); {INDEX_HOWTO}")
        index = parse_index_json(raw, where, fix=f"upload the folder's own {INDEX_FILE} ({INDEX_HOWTO})")
        if index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{where} is not a shard index; {INDEX_HOWTO}")
        self._index_bytes = len(raw)
        self._shards = {s["name"]: s for s in index["shards"]}
        if self.cache_dir is not None:
            key = hashlib.blake2b(self.url.encode(), digest_size=8).hexdigest()
            self._cache = os.path.join(self.cache_dir, key, hashlib.blake2b(raw, digest_size=8).hexdigest())
            try:
                os.makedirs(self._cache, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cache folder {self._cache} cannot be made: {e.strerror}") from None
        names = (*ARRAYS, "crc_start") if index.get("check_block_bytes") else ARRAYS
        arrays = {k: self.load_array(array_name(k), "index file", f"upload the folder's index again ({INDEX_HOWTO})")
                  for k in names}
        if self._cache is not None:
            with atomic_write(os.path.join(self._cache, INDEX_FILE), "wb") as f:  # last: this entry is complete
                f.write(raw)
        return index, arrays

    def _check_ranges(self) -> None:
        """Before the first token read (not on opening: planning reads only the index, which needs no
        ranges): a 16-byte range of ``index.json`` must come back as 16 bytes."""
        if self._ranges_checked:
            return
        n = min(PROBE_BYTES, getattr(self, "_index_bytes", PROBE_BYTES))
        got = self._fetch(INDEX_FILE, 0, n) if n else b""
        if len(got) != n:
            raise ValueError(f"the server of {self.url} ignores HTTP range requests (asked for {n} bytes of "
                             f"{INDEX_FILE}, got {len(got)}): reading tokens would download a whole shard for every "
                             f"read; serve the folder from a server that answers Range with 206 Partial Content "
                             f"(nginx, S3, GCS), or open it with open_source(url, cache_dir=DIR, cache_shards=True) "
                             f"to download each shard once (planning from the index needs neither)")
        self._ranges_checked = True

    def load_array(self, name: str, what: str, fix: str) -> np.ndarray:
        """A ``.npy`` of the folder, fetched whole once (memory-mapped from the cache folder when there is one)."""
        if self._cache is not None:
            local = os.path.join(self._cache, name)
            if os.path.exists(local):
                try:
                    return np.load(local, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError):
                    pass  # a damaged cache file: fetched again below
        raw = self._fetch(name, missing=f"{what} {self.path(name)} not found; {fix}")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{what} {self.path(name)} cannot be read ({e}); {fix}") from None
        if self._cache is None:
            return arr
        with atomic_write(local, "wb") as f:
            f.write(raw)
        return np.load(local, mmap_mode="r", allow_pickle=False)

    # -- token reads ------------------------------------------------------------------------

    def pread(self, name: str, n: int, offset: int) -> bytes:
        if self.cache_shards:
            self._download(name)
            assert self._local is not None
            return self._local.pread(name, n, offset)
        if n <= 0:
            return b""
        self._check_ranges()
        buf = self._fetch(name, offset, offset + n)
        if len(buf) > n:  # fsspec returns the whole body of a 200 answer to a range request
            raise ValueError(f"the server of {self.url} ignored a range request for {self.path(name)} (asked for "
                             f"{n} bytes, got {len(buf)}): serve the folder from a server that supports Range, or "
                             f"pass cache_dir= with cache_shards=True")
        return buf

    def pread_many(self, reqs: list[tuple[str, int, int]]) -> list[bytes | None]:
        """``(name, n, offset)`` ranges fetched concurrently (fsspec's ``cat_ranges``); ``None`` where a
        range failed or came back longer than asked (the read then asks again and reports the problem)."""
        if self.cache_shards or not reqs:
            return [None] * len(reqs)
        self._check_ranges()
        fs = self._connect()
        try:
            got = fs.cat_ranges([f"{self._root}/{name}" for name, _, _ in reqs], [off for _, _, off in reqs],
                                [off + n for _, n, off in reqs], on_error="return")
        except Exception:  # a prefetch is a hint: the reads themselves fetch again and report errors
            return [None] * len(reqs)
        out: list[bytes | None] = []
        for (_, n, _), buf in zip(reqs, got, strict=True):
            ok = isinstance(buf, bytes) and len(buf) <= n
            out.append(buf if ok else None)
        with self._lock:
            self.bytes_fetched += sum(len(b) for b in got if isinstance(b, bytes))
        return out

    def _download(self, name: str) -> None:
        """Fetch a shard whole into the cache folder once, checking its size and crc32 against the index."""
        assert self._cache is not None
        local = os.path.join(self._cache, name)
        with self._lock:
            if self._local is None:
                self._local = LocalStore(self._cache)
            lock = self._downloads.setdefault(name, threading.Lock())
        with lock:
            if os.path.exists(local):
                return
            entry = self._shards.get(name, {})
            url = self.path(name)
            with atomic_path(local) as tmp:
                try:
                    self._retrying(url, lambda fs: fs.get_file(f"{self._root}/{name}", tmp))
                except FileNotFoundError:
                    raise ValueError(f"shard {url} listed in the index is not on the server; upload the "
                                     f"folder again whole") from None
                size = os.path.getsize(tmp)
                with self._lock:
                    self.bytes_fetched += size
                if "bytes" in entry and size != entry["bytes"]:
                    raise ValueError(f"shard {url} has {size} bytes but the index recorded {entry['bytes']}: "
                                     f"it is truncated or was rewritten; upload the folder again")
                if "crc32" in entry and file_crc32(tmp) != entry["crc32"]:
                    raise ValueError(f"shard {url} does not match the crc32 in the index (it was changed or "
                                     f"damaged in transfer); upload the folder again")

    def close(self) -> None:
        if self._local is not None:
            self._local.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "cache_dir": self.cache_dir, "cache_shards": self.cache_shards,
                "storage_options": self.storage_options, "read_timeout_s": self.read_timeout_s,
                "retries": self.retries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], cache_dir=state["cache_dir"], cache_shards=state["cache_shards"],  # type: ignore[misc]
                      storage_options=state["storage_options"],
                      read_timeout_s=state.get("read_timeout_s", READ_TIMEOUT_S), retries=state.get("retries", RETRIES))


def open_remote(url: str, *, cache_dir: str | os.PathLike[str] | None = None, cache_shards: bool = False,
                storage_options: dict[str, Any] | None = None, verify: str = "full", allow_part: bool = False,
                read_timeout_s: float = READ_TIMEOUT_S, retries: int = RETRIES) -> ShardSource:
    """A :class:`ShardSource` over the shard folder at ``url`` (see the module doc)."""
    store = RemoteStore(url, cache_dir=cache_dir, cache_shards=cache_shards, storage_options=storage_options,
                        read_timeout_s=read_timeout_s, retries=retries)
    return ShardSource(store.url, verify=verify, store=store, allow_part=allow_part)
