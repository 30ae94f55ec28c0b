"""Start a world of processes on one machine, or join the launcher's.

:func:`spawn_world` runs a function on N fresh processes that join one gloo (or NCCL) world
through a TCP store the parent owns (no port races): the multi-process tests
(``tests/distributed.py``), ``selfcheck``, ``profile``, the Spindle executor and the
benchmarks use it. A rank that raises is reported with its traceback, the other ranks exit
(their collectives fail once the failed rank is gone, or the parent ends them after a grace
period), and the whole world has a hard timeout: a failure never hangs.

:func:`init_from_env` joins a world started by ``accelerate launch`` / ``torchrun``
(``python -m parallel_runtime``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def default_backend(device: torch.device | str | None = None) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    dev = torch.device(device) if device is not None else None
    return "nccl" if dev is not None and dev.type == "cuda" else "gloo"


def init_from_env(backend: str, timeout_s: float) -> None:
    """Join the launcher's world (env://); a lone process (no ``WORLD_SIZE``) makes a world of one."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed; the message names them and the first cause."""


def init_world(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1",
               backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Join the world whose TCP store listens on ``host:port``; collectives time out after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


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
