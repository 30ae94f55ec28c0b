"""Complete-or-absent outputs: :func:`atomic_write` (one file), :class:`StagedFolder` (a folder written
whole, renamed into place), :class:`OutputSet` (files published together). Stdlib only; imports nothing of ours.

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


def fsync_dir(path: str) -> None:
    """Make a folder's entries (a rename into it) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_new_folder(path: str | os.PathLike[str], what: str) -> None:
    """``path`` must not exist or be an empty folder (an output written whole); one ``ValueError`` otherwise."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"{what} {path} is a file; give a folder to create")
    entries = sorted(os.listdir(path))
    if entries:
        shown = ", ".join(entries[:3]) + (" ..." if len(entries) > 3 else "")
        raise ValueError(f"{what} {path} already holds files ({shown}); choose a new folder or remove it first")


class StagedFolder:
    """A folder written whole: its files go into a hidden folder beside ``target``
    (``.NAME.partial-`` and 8 random hex digits), and :meth:`publish` renames that folder to ``target`` when
    everything is written; :meth:`discard` (any failure) removes it. So ``target`` is either absent
    (or the empty folder it was) or complete: a full disk, an exception or Ctrl-C leaves nothing
    a reader could take for data. ``target`` must not exist or be an empty folder.
    """

    PARTIAL = ".partial-"

    def __init__(self, target: str | os.PathLike[str], what: str = "output folder") -> None:
        self.target = os.path.normpath(os.fspath(target))
        self.what = what
        check_new_folder(self.target, what)
        parent = os.path.dirname(os.path.abspath(self.target))
        try:
            os.makedirs(parent, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}{self.PARTIAL}", dir=parent)
            os.chmod(self.path, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        except OSError as e:
            raise write_error(self.target, e) from None

    def publish(self) -> None:
        fsync_dir(self.path)
        try:
            os.rename(self.path, self.target)  # atomic; replaces an empty folder, fails on a non-empty one
        except OSError as e:
            self.discard()
            if e.errno in (errno_.ENOTEMPTY, errno_.EEXIST):
                raise ValueError(f"{self.what} {self.target} was filled by another process while this one wrote "
                                 f"it; nothing of this run was kept") from None
            raise write_error(self.target, e) from None
        fsync_dir(os.path.dirname(os.path.abspath(self.target)))

    def discard(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)


def remove_partials(target: str | os.PathLike[str]) -> None:
    """Remove the staging folders a killed :class:`StagedFolder` of ``target`` left behind (call while
    holding ``target``'s :class:`~balanced_loader.outputs.locks.OutputLock`: no one else is writing it)."""
    import shutil

    target = os.path.normpath(os.path.abspath(os.fspath(target)))
    parent, prefix = os.path.dirname(target), f".{os.path.basename(target)}{StagedFolder.PARTIAL}"
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(prefix) and os.path.isdir(os.path.join(parent, name)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


class OutputSet:
    """Several files of one output (``compare.json`` and its charts) published as a set.

    :meth:`path` gives a temporary name next to each final file for the writer to fill (through
    :func:`atomic_write` or any writer); :meth:`commit` renames every one into place only after all
    of them were written, so a failure (a full disk on the last chart) leaves the folder's previous
    set as it was: never a new ``compare.json`` beside old charts. A context manager: commit on
    success, remove the temporary files on any exception.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        self._tmp: dict[str, str] = {}  # final path -> temporary path

    def path(self, name: str) -> str:
        final = os.path.join(self.folder, name)
        if final not in self._tmp:
            try:
                # the final extension last: writers that pick a format by extension (charts) still see it
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=f".tmp{os.path.splitext(name)[1]}",
                                           dir=self.folder)
                os.close(fd)
            except OSError as e:
                raise write_error(final, e) from None
            self._tmp[final] = tmp
        return self._tmp[final]

    def final(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def commit(self) -> None:
        for final, tmp in list(self._tmp.items()):
            try:
                os.chmod(tmp, 0o666 & ~_umask())
                os.replace(tmp, final)
            except OSError as e:
                raise write_error(final, e) from None
            del self._tmp[final]
        fsync_dir(self.folder)

    def discard(self) -> None:
        for tmp in self._tmp.values():
            with contextlib.suppress(OSError):
                os.remove(tmp)
        self._tmp.clear()

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.commit()
            finally:
                self.discard()
            return
        names = dict(self._tmp)
        self.discard()
        if isinstance(exc, OSError):  # name the file the user asked for, not its temporary name
            msg = str(exc.strerror or exc)
            for final, tmp in names.items():
                msg = msg.replace(tmp, final)
            raise OSError(exc.errno, f"{msg} (the folder's previous files were kept)") from None
