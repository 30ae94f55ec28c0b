"""Complete-or-absent outputs: :func:`atomic_write` (one file), :class:`StagedFolder` (a folder written
whole, renamed into place), :class:`OutputSet` (files published together); and :func:`read_json`, the one
reader of the package's JSON files (one clear line when one is unreadable). Stdlib only; imports nothing of
ours.

Every file the package writes (plans, reports, charts, shards, the length index) goes through
it: the bytes land in a hidden temporary file in the same folder, are flushed to disk, and the
temporary file is renamed over ``path`` only when everything was written. A failed write (disk
full, an exception in the caller's block, Ctrl-C) removes the temporary file and leaves an
existing ``path`` untouched.

Outputs are never clobbered: :func:`check_output` refuses, in one line, an output path that is one
of the command's inputs or that is not a regular file (or folder) it may replace: a device, a pipe,
a socket, a link to one, anything under ``/dev`` or ``/proc`` (``--out /dev/full`` as root would
otherwise have its device node renamed over). A symbolic link to a regular file is written through
(the link stays, its target is replaced). :func:`undo_folders` removes the folders a command made
for its outputs when it fails before writing into them.
"""

from __future__ import annotations

import contextlib
import errno as errno_
import os
import re
import socket
import stat
import tempfile
import zlib
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


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
_SYSTEM = ("/dev/", "/proc/", "/sys/")  # paths that name devices and processes, never an output file


def _kind(st: os.stat_result) -> str:
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")


def check_output(path: str | os.PathLike[str], what: str = "--out", *, inputs: Any = (), folder: bool = False,
                 names: Any = ()) -> None:
    """Refuse (one ``ValueError`` line) an output ``path`` this command may not replace (module docstring):
    it must be a regular file (``folder``: a folder) or absent, not under ``/dev``, ``/proc`` or ``/sys``
    (itself or through a link), and not one of ``inputs`` (paths the command reads; missing ones are
    skipped). ``names``: the files a folder output writes into it, each of which must not be an input."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    if any(p.startswith(_SYSTEM) or p.rstrip("/") in ("/dev", "/proc", "/sys")
           for p in (os.path.abspath(path), real)):
        raise ValueError(f"{what} {path} names a device or process file ({real}), not a "
                         f"{'folder' if folder else 'file'} to write; give a path on a disk")
    try:
        st = os.stat(path)  # through links
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be checked: {e.strerror}") from None
    if st is not None:
        ok = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
        if not ok:
            want = "a folder (or a new path)" if folder else "a regular file (or a new path)"
            raise ValueError(f"{what} {path} is {_kind(st)}, not {want} it may replace; give another path")
    targets = [path] + [os.path.join(path, n) for n in names] if folder else [path]
    for t in targets:
        for src in (inputs if isinstance(inputs, (list, tuple, set)) else [inputs]):
            if src is not None and _same_file(t, src):
                named = "" if t == path else f" (its {os.path.basename(t)})"
                raise ValueError(f"{what} {path}{named} is also an input of this command ({os.fspath(src)}); "
                                 f"writing it would destroy what it reads: give another {what}")


def _same_file(a: Any, b: Any) -> bool:
    try:
        return os.path.exists(a) and os.path.samefile(a, os.fspath(b))
    except (OSError, ValueError, TypeError):
        return False


def _target(path: str) -> str:
    """The file an output replaces: ``path``, or a symbolic link's target (written through, the link kept);
    refused when that exists and is not a regular file (:func:`check_output`)."""
    if os.path.islink(path) or any(os.path.abspath(path).startswith(p) for p in _SYSTEM):
        check_output(path, "output")
        return os.path.realpath(path)
    try:
        st = os.stat(path)
    except OSError:
        return path
    if not stat.S_ISREG(st.st_mode):
        check_output(path, "output")
    return path


def _temp_file(folder: str, base: str, suffix: str) -> tuple[int, str]:
    """A new hidden temporary file for output ``base`` in ``folder``: ``.BASE.pPID-HOST.<random>.tmp``. Its
    name says which process made it, so a run first removes the ones of dead processes of this host (what a
    ``kill -9`` left: the output itself was never touched, only this file stayed behind)."""
    tag = f"p{os.getpid()}-{_HOST}"
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            m = _TEMP.match(name)
            # base's own temporaries, and those of a writer that wrote atomically into one of base's (a chart
            # into an OutputSet's temporary file: '..BASE.pPID-HOST.X.tmp.png.pPID-HOST.Y.tmp')
            mine = m is not None and (m.group(1) == base or m.group(1).startswith(f".{base}.p"))
            if mine and m.group(3) == _HOST and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
    return tempfile.mkstemp(prefix=f".{base}.{tag}.", suffix=suffix, dir=folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_TEMP = re.compile(r"^\.(.+)\.p(\d+)-([0-9a-f]{8})\.[^.]+\.tmp")


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
    path = _target(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = _temp_file(folder, os.path.basename(path), ".tmp")
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
    path = _target(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = _temp_file(folder, os.path.basename(path), ".tmp")
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


def read_json(path: str | os.PathLike[str], what: str, *, fix: str = "") -> Any:
    """The parsed JSON of the file ``path``, a ``what`` (e.g. "plan file"); one ``ValueError`` line naming it when
    it cannot be read, is not text or is not JSON (its line and column), ending with ``fix`` where given (what
    to do). The caller checks the shape."""
    import json

    end = f"; {fix}" if fix else ""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}{end}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not text{end}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg}){end}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ValueError(f"{what} {path} is nested too deeply to be one{end}") from None


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
    """Several files of one output (``compare.json`` and its charts; a trace and its Gantt chart) published
    as a set.

    :meth:`path` gives a temporary name next to each final file for the writer to fill (through
    :func:`atomic_write` or any writer); :meth:`commit` renames every one into place only after all
    of them were written, so a failure (a full disk on the last chart) leaves the previous set as it
    was: never a new ``compare.json`` beside old charts, never a new trace without its chart. A context
    manager: commit on success, remove the temporary files on any exception. ``folder``: where names
    are (None: each name is a path of its own, in any folder).
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self.folder = None if folder is None else os.fspath(folder)
        self._tmp: dict[str, str] = {}  # final path -> temporary path

    def path(self, name: str) -> str:
        final = _target(self.final(name))
        if final not in self._tmp:
            base = os.path.basename(final)
            try:
                # the final extension last: writers that pick a format by extension (charts) still see it
                fd, tmp = _temp_file(os.path.dirname(os.path.abspath(final)), base,
                                     f".tmp{os.path.splitext(base)[1]}")
                os.close(fd)
            except OSError as e:
                raise write_error(final, e) from None
            self._tmp[final] = tmp
        return self._tmp[final]

    def final(self, name: str) -> str:
        return name if self.folder is None else os.path.join(self.folder, name)

    def commit(self) -> None:
        """Rename every file into place, holding the set's publish lock (:func:`publish_lock`): two runs that
        publish the same set at once leave one run's set whole, never one's JSON beside the other's charts."""
        if not self._tmp:
            return
        folders = {os.path.dirname(os.path.abspath(f)) for f in self._tmp}
        with publish_lock(min(self._tmp)):
            for final, tmp in list(self._tmp.items()):
                try:
                    os.chmod(tmp, 0o666 & ~_umask())
                    os.replace(tmp, final)
                except OSError as e:
                    raise write_error(final, e) from None
                del self._tmp[final]
            for folder in sorted(folders):
                fsync_dir(folder)

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
            kept = "the folder's previous files were kept" if self.folder is not None else "previous files were kept"
            raise OSError(exc.errno, f"{msg} ({kept})") from None


@contextlib.contextmanager
def publish_lock(path: str) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` (waited for) on ``.NAME.publish`` beside ``path`` for the block; the file is
    removed on release. Why the inode check: a waiter may lock a file its holder removed in the meantime, and
    must then lock the one that is there now (as :class:`balanced_loader.outputs.locks.OutputLock` does)."""
    import fcntl

    lock = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.publish")
    for _ in range(1000):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a folder we cannot add a file to: publish without it (the renames are still atomic)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except OSError:
            same = False
        if same:
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.remove(lock)  # while holding it: a waiter on this inode retries on a fresh file
                os.close(fd)
            return
        os.close(fd)
    yield  # the lock file kept changing (a thousand publishers?): the renames alone


@contextlib.contextmanager
def undo_folders(path: str | os.PathLike[str]) -> Iterator[None]:
    """Note which of ``path`` and its parents do not exist yet; when the block fails, remove those the block
    created that are still empty (deepest first; never a file, never a folder that holds one): an error found
    after a command made its ``--out`` leaves no empty folder behind."""
    missing = missing_folders(path)
    try:
        yield
    except BaseException:
        remove_empty(missing)
        raise


def missing_folders(path: str | os.PathLike[str]) -> list[str]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    p = os.path.abspath(os.fspath(path))
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    return missing


def remove_empty(folders: Any) -> None:
    """``rmdir`` each of ``folders`` in order while it is an empty folder (stop at the first that is not)."""
    for d in folders:
        try:
            os.rmdir(d)
        except OSError:
            break
