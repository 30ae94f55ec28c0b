"""Complete-or-absent output files: :func:`atomic_write` (stdlib only; imports nothing of ours).

Every file the package writes (plans, reports, charts, shards, the length index) goes through
it: the bytes land in a hidden temporary file in the same folder, are flushed to disk, and the
temporary file is renamed over ``path`` only when everything was written. A failed write (disk
full, an exception in the caller's block, Ctrl-C) removes the temporary file and leaves an
existing ``path`` untouched.
"""

from __future__ import annotations

import contextlib
import errno as errno_
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_error(path: str, e: OSError) -> OSError:
    """An ``OSError`` whose message names ``path`` and the cause (``strerror`` alone may be None)."""
    cause = e.strerror or str(e) or type(e).__name__
    if e.errno is not None and not e.strerror:
        cause = os.strerror(e.errno)
    return OSError(e.errno if e.errno is not None else errno_.EIO, f"cannot write {path}: {cause}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = None
                 ) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` for writing; on success fsync it and rename it to ``path``.

    ``mode`` is ``"w"`` (text, UTF-8 unless ``encoding``) or ``"wb"``. An ``OSError`` while
    creating, writing, syncing or renaming is re-raised as one ``OSError`` whose message is
    ``cannot write PATH: CAUSE``; any other exception from the block propagates unchanged. In
    every failure the temporary file is removed and ``path`` is left as it was.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise write_error(path, e) from None
    ok = False
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
            f = os.fdopen(fd, mode, encoding=(encoding or "utf-8") if mode == "w" else None)
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        ok = True
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if not ok:
            with contextlib.suppress(OSError):
                os.remove(tmp)


class _Discard(Exception):
    """Thrown into an open :func:`atomic_write` to remove its temporary file."""


class AtomicFile:
    """An :func:`atomic_write` held open across calls (a file written piece by piece, e.g. a shard):
    ``file`` takes the bytes, ``commit()`` syncs and renames it into place (``OSError`` naming the
    path on failure, the temporary file removed), ``discard()`` removes the temporary file."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb") -> None:
        self.path = os.fspath(path)
        self._cm: Any = atomic_write(self.path, mode)
        self.file: IO[Any] = self._cm.__enter__()

    def commit(self) -> None:
        cm, self._cm = self._cm, None
        assert cm is not None, f"{self.path} was already committed or discarded"
        cm.__exit__(None, None, None)

    def discard(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            with contextlib.suppress(_Discard):
                cm.__exit__(_Discard, _Discard(), None)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path next to ``path`` for a writer that needs a file name (a download); on success
    the file is synced and renamed to ``path``, on failure removed (``path`` is left as it was)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as e:
        raise write_error(path, e) from None
    ok = False
    try:
        yield tmp
        try:
            os.chmod(tmp, 0o666 & ~_umask())
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            raise write_error(path, e) from None
        ok = True
    finally:
        if not ok:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """``text`` to ``path``, complete or not at all."""
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = None) -> None:
    """``obj`` as JSON (one trailing newline) to ``path``, complete or not at all."""
    import json

    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
