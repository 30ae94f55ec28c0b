"""Start a world of processes on one machine, or join the launcher's.

:func:`spawn_world` runs a function on N fresh processes that join one gloo (or NCCL) world
through a TCP store the parent owns (no port races): the multi-process tests
(``tests/distributed.py``), ``selfcheck``, ``profile``, the Spindle executor and the
benchmarks use it. A rank that raises is reported with its traceback, the other ranks exit
(their collectives fail once the failed rank is gone, or the parent ends them after a grace
period), and the whole world has a hard timeout: a failure never hangs.

:func:`init_from_env` joins a world started by ``accelerate launch`` / ``torchrun``
(``python -m parallel_runtime``): under ``torchrun`` on one or several nodes (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), ``accelerate launch``, or ``srun`` setting those variables itself.

Both ways of joining wait for every rank on the store with a long timeout (a rank that starts
late on a busy machine is not a collective timeout), then start the world with the collective
timeout ``timeout_s``; :func:`new_group` gives every subgroup the same timeout. When a rank
fails, :func:`failure_line` says so in one line: its own error is posted to the store, and its
peers, whose collectives break or time out, name that rank (or, on a timeout, what they were
waiting in: the :func:`phase` the trainer was in and its group's ranks) instead of a socket error.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def default_backend(device: torch.device | str | None = None) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    dev = torch.device(device) if device is not None else None
    return "nccl" if dev is not None and dev.type == "cuda" else "gloo"


JOIN_TIMEOUT_S = 1800.0  # how long ranks may take to reach the store (imports, a busy machine)

# this process's world: its store, the collective timeout, and the rank whose process hosts the store
# (rank 0 when the variables come from srun or a script; torchrun's agent hosts it otherwise)
_world: dict[str, Any] = {"store": None, "timeout_s": None, "store_host": None}
_phase: list[tuple[str, tuple[int, ...]]] = []  # what this rank is doing now (innermost last)
_raised_in: list[tuple[str, tuple[int, ...]]] = []  # the phase the first error of this process left


def init_from_env(backend: str, timeout_s: float) -> None:
    """Join the launcher's world (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a lone process
    (no ``WORLD_SIZE``) makes a world of one. Collectives of the world and every group made with
    :func:`new_group` time out after ``timeout_s``."""
    if "WORLD_SIZE" in os.environ:
        join = datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        # the same store init_process_group(init_method="env://") would make (torchrun's agent store
        # when there is one), kept here so failures can be posted to it
        store, rank, world = next(dist.rendezvous("env://", timeout=join))
        _join(store, rank, world, backend, timeout_s)
        _world["store_host"] = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=timeout_s))
    _join(store, 0, 1, backend, timeout_s)


def _join(store: dist.Store, rank: int, world: int, backend: str, timeout_s: float) -> None:
    """Wait for all ranks on ``store`` (long timeout), then start the world (collective timeout)."""
    store.set_timeout(datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
    key = "parallel_runtime/joined"
    if store.add(key, 1) == world:
        store.set(key + "/all", "1")
    store.wait([key + "/all"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _world.update(store=store, timeout_s=float(timeout_s), store_host=None)


def world_timeout_s() -> float | None:
    """The collective timeout this process's world was started with (``None``: not started here)."""
    return _world["timeout_s"] if dist.is_initialized() else None


def new_group(ranks: Sequence[int], *, backend: str | None = None,
              timeout_s: float | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` with the world's collective timeout (torch's default is 30 min for gloo,
    10 min for NCCL, whatever the world's): a stopped peer ends the run within the timeout."""
    t = timeout_s if timeout_s is not None else world_timeout_s()
    return dist.new_group(list(ranks), backend=backend,
                          timeout=datetime.timedelta(seconds=t) if t is not None else None)


# ---- failures: one line per rank ------------------------------------------------------------------


@contextmanager
def phase(what: str, ranks: Sequence[int]) -> Iterator[None]:
    """Name what this rank is doing and with whom (a timeout inside reports it): cheap, no collective."""
    _phase.append((what, tuple(int(r) for r in ranks)))
    try:
        yield
    except BaseException:
        if not _raised_in:  # the innermost phase an error left (outer ones see it pass through)
            _raised_in.append(_phase[-1])
        raise
    finally:
        _phase.pop()


def current_phase() -> tuple[str, tuple[int, ...]] | None:
    """The phase an error left (once one has), else the innermost phase this rank is in."""
    return _raised_in[0] if _raised_in else (_phase[-1] if _phase else None)


_FAILED = "parallel_runtime/failed"


def _failure_store() -> dist.Store | None:
    store = _world["store"]
    if store is None:
        return None
    store.set_timeout(datetime.timedelta(seconds=5))  # the run is ending: never wait long on the store
    return store


def post_failure(rank: int, message: str) -> None:
    """Post this rank's error to the world's store (the first poster is the one peers name)."""
    try:
        store = _failure_store()
        if store is not None and store.add(_FAILED + "/count", 1) == 1:
            store.set(_FAILED, f"{rank}\t{message}")
    except Exception:  # (the store may be gone with its host; the error is printed anyway)
        pass


def failed_peer() -> tuple[int, str] | None:
    """The rank (and one-line message) that posted the first failure, if any and the store is reachable."""
    try:
        store = _failure_store()
        if store is None or not store.check([_FAILED]):
            return None
        r, _, msg = store.get(_FAILED).decode().partition("\t")
        return int(r), msg
    except Exception:  # (the store's host is gone: when that is a rank, it ended first)
        host = _world["store_host"]
        return None if host is None else (host, "its process ended; it hosts the store: see its message")


def is_comm_error(e: BaseException) -> bool:
    """A broken or timed-out collective (a peer stopped, crashed or is unreachable), not this rank's own error."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("gloo", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                            "NCCL", "Broken pipe"))


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def failure_line(e: BaseException, rank: int) -> str:
    """One line saying why this rank stops; posted to the store when it is the run's first failure.

    A rank's own error says what it is; a rank whose collective broke names the rank that posted
    first (so a peer's error, or the first timeout, is reported by every rank), or else says what it
    waited in and with whom (the innermost :func:`phase`)."""
    if not is_comm_error(e):
        what = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        post_failure(rank, what)
        return f"rank {rank}: {what}"
    where = current_phase()
    doing, ranks = where if where is not None else ("a collective", ())
    group = f" (group ranks {list(ranks)})" if ranks else ""
    peer = failed_peer()
    if peer is not None and peer[0] != rank:
        return f"rank {rank}: stopped in {doing}{group}: rank {peer[0]} failed first ({peer[1]})"
    if _is_timeout(e):
        t = world_timeout_s()
        what = f"timed out{f' after {t:g} s' if t is not None else ''} in {doing}{group}"
    else:
        what = f"lost a peer in {doing}{group} (a peer process ended: see its message): {str(e).splitlines()[0][:200]}"
    post_failure(rank, what)
    return f"rank {rank}: {what}"


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed; the message names them and the first cause."""


def init_world(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1",
               backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Join the world whose TCP store listens on ``host:port``; collectives time out after ``timeout_s``."""
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
    _join(store, rank, world_size, backend, timeout_s)


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float, threads: int,
               fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    torch.set_num_threads(threads)
    try:
        init_world(rank, world_size, port=port, backend=backend, timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # report everything, then leave at once so peers' collectives fail
        msg = f"{type(e).__name__}: {e}".strip()
        conn.send_bytes(pickle.dumps(("error", (msg, traceback.format_exc(), time.time()))))
        conn.close()
        os._exit(1)
    conn.close()
    dist.destroy_process_group()


def spawn_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                backend: str = "gloo", threads: int = 1, grace_s: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Each process joins a
    gloo (or ``backend``) world with collective timeout ``timeout_s``. If a rank raises, the
    others get ``grace_s`` to fail on their own (their collectives break when it exits) and
    are then terminated; a :class:`WorldError` names the first failure, with its traceback.
    The whole call never takes much more than ``timeout_s``.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    readers, procs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, world_size, store.port, backend, timeout_s, threads,
                                                 fn, args, w), daemon=True, name=f"rank{rank}")
        p.start()
        w.close()
        readers.append(r)
        procs.append(p)
    results: list[Any] = [None] * world_size
    status: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", result) | ("error", (msg, tb, t)) | ("died", code)
    order: list[int] = []  # ranks in the order they failed
    first_fail_t: float | None = None
    try:
        while len(status) < world_size:
            now = time.monotonic()
            deadline = start + timeout_s
            if first_fail_t is not None:
                deadline = min(deadline, first_fail_t + grace_s)
            if now >= deadline:
                break
            pending = [i for i in range(world_size) if i not in status]
            ready = wait([readers[i] for i in pending] + [procs[i].sentinel for i in pending],
                         timeout=min(0.5, deadline - now))
            for i in pending:
                got = None
                if readers[i] in ready or procs[i].sentinel in ready:
                    try:
                        if readers[i].poll():
                            got = pickle.loads(readers[i].recv_bytes())
                    except (EOFError, OSError):
                        got = None
                    if got is None and procs[i].sentinel in ready:
                        procs[i].join(timeout=1.0)
                        got = ("died", procs[i].exitcode)
                if got is None:
                    continue
                status[i] = got
                if got[0] == "ok":
                    results[i] = got[1]
                else:
                    order.append(i)
                    if first_fail_t is None:
                        first_fail_t = time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for r in readers:
            r.close()
        del store
    if len(order) == 0 and len(status) == world_size:
        return results
    # the first failure is the earliest raise (messages may be read in another order); a process
    # that died without a message (a crash, a kill) is the likeliest cause of the rest
    order.sort(key=lambda i: status[i][1][2] if status[i][0] == "error" else float("-inf"))
    elapsed = time.monotonic() - start
    lines = []
    if order:
        first = order[0]
        kind, info = status[first]
        what = info[0] if kind == "error" else f"process exited with code {info} without a result"
        lines.append(f"rank {first} failed first: {what}")
    else:
        lines.append(f"world of {world_size} ranks timed out after {elapsed:.1f}s")
    for i in range(world_size):
        if order and i == order[0]:
            continue
        if i not in status:
            lines.append(f"  rank {i}: no result after {elapsed:.1f}s; terminated")
        elif status[i][0] == "error":
            after = f" (after rank {order[0]} failed)" if order and i != order[0] else ""
            lines.append(f"  rank {i}{after}: {status[i][1][0].splitlines()[0][:300]}")
        elif status[i][0] == "died":
            lines.append(f"  rank {i}: process exited with code {status[i][1]}")
    if order and status[order[0]][0] == "error":
        lines.append(f"traceback of rank {order[0]}:\n{status[order[0]][1][1]}")
    raise WorldError("\n".join(lines))
