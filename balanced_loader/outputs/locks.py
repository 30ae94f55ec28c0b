"""One writer per output: :class:`OutputLock`, an exclusive ``fcntl.flock`` on a lock file beside an output
folder (stdlib only; imports nothing of ours).

``build-shards --out DIR``, ``balanced-loader index DIR`` and a training run's ``--out DIR`` hold the lock
on ``DIR`` while they write it: the lock file is ``.DIR.lock`` in DIR's parent folder (beside it, so a
folder that is published whole by a rename, as a shard build is, can be locked before it exists). The
holder writes who it is into the file (pid, host, command, start time); a second writer fails at once
with one ``ValueError`` line naming that holder. The kernel drops the lock when the holder exits, so a
crashed run leaves no stale lock, only a lock file that the next writer takes over; a clean release
removes the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import IO, Any

LOCK_SUFFIX = ".lock"


def lock_path(target: str | os.PathLike[str]) -> str:
    """The lock file of an output folder: ``.NAME.lock`` beside it."""
    target = os.path.abspath(os.fspath(target))
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{LOCK_SUFFIX}")


def _holder() -> dict[str, Any]:
    cmd = " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])
    cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": cmd,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe_holder(text: str) -> str:
    """The holder's record (the lock file's JSON) as words, or a plain phrase when it cannot be read."""
    try:
        h = json.loads(text)
        return (f"pid {int(h['pid'])} on {h['host']} ({h['command']}, since {h['since']})")
    except (ValueError, KeyError, TypeError):
        return "another process"


def _read_holder(f: IO[str]) -> str:
    """The holder's record; it writes it just after taking the lock, so an empty file is read again briefly."""
    for _ in range(40):
        f.seek(0)
        text = f.read()
        if text.strip():
            return describe_holder(text)
        time.sleep(0.025)
    return "another process"


class OutputLock:
    """An exclusive lock on the output folder ``target`` (see the module doc); a context manager.

    ``what`` names the output in the error, e.g. ``"--out"``. :meth:`acquire` raises one ``ValueError``
    (``--out DIR is in use by pid P on HOST (COMMAND, since T); wait for it to finish or choose another
    --out``) when another process holds it; locks are per open file, so a second lock in the same
    process conflicts too.
    """

    def __init__(self, target: str | os.PathLike[str], what: str = "--out") -> None:
        self.target = os.fspath(target)
        self.what = what
        self.path = lock_path(self.target)
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> OutputLock:
        import fcntl  # POSIX only, and only a writer needs it

        if self._file is not None:
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(100):  # a holder that releases removes the file: lock the file that is there now
            f = open(self.path, "a+")  # noqa: SIM115 (kept open while the lock is held)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(f)
                f.close()
                raise ValueError(f"{self.what} {self.target} is in use by {holder}; wait for it to finish or "
                                 f"choose another {self.what}") from None
            except OSError:
                f.close()
                raise
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                f.seek(0)
                f.truncate()
                f.write(json.dumps(_holder()) + "\n")
                f.flush()
                self._file = f
                return self
            f.close()  # the file was removed (and maybe recreated) between open and lock: try again
        raise ValueError(f"{self.what} {self.target}: its lock file {self.path} keeps changing; is another "
                         f"process starting and stopping on it?")

    def release(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)  # while still holding the lock: a waiter then locks a fresh file
        f.close()

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
