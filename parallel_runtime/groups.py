"""Process groups for a set of plan shapes, and the world they live in.

:class:`ProcessGroups` creates every group :func:`parallel_runtime.topology.required_groups`
lists, once, in the same order on every rank (``new_group`` is collective over the world),
deduplicated by rank set. A step then only *looks up* groups by rank tuple; nothing is
created on the hot path, and asking for a group that was not pre-created is a clear error.

The world helpers at the bottom (:func:`init_world`, :func:`spawn_world`) start a
process group on one machine: the multi-process tests, ``selfcheck`` and the benchmarks use
them. A rank that raises is reported with its traceback, the other ranks exit (their
collectives fail once the failed rank is gone, or the parent ends them after a grace
period), and the whole world has a hard timeout: a failure never hangs.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from balanced_loader.cost import allowed_degrees
from balanced_loader.plan import StepPlan
from parallel_runtime.topology import GroupSpec, Topology, nested_split, required_groups


def default_backend(device: torch.device | str | None = None) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    dev = torch.device(device) if device is not None else None
    return "nccl" if dev is not None and dev.type == "cuda" else "gloo"


@dataclass(frozen=True, kw_only=True)
class NestedGroups:
    """This rank's two groups of a nested (Ulysses-in-ring) CP group."""

    inner_ranks: tuple[int, ...]  # [inner] in lane order
    inner: dist.ProcessGroup | None
    outer_ranks: tuple[int, ...]  # [outer] in lane order
    outer: dist.ProcessGroup | None


@dataclass(kw_only=True)
class GroupLookup:
    """This rank's process groups by sorted rank tuple (what every engine looks groups up in)."""

    rank: int
    _groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)

    def _create(self, spec: GroupSpec, world: int, backend: str | None) -> None:
        """Create ``spec``'s group (collective over the world: every rank, member or not, in one order)."""
        pg = dist.group.WORLD if len(spec.ranks) == world else dist.new_group(list(spec.ranks), backend=backend)
        if self.rank in spec.ranks:
            self._groups[spec.ranks] = pg

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The group over ``ranks`` (any order); ``None`` for a single rank."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) <= 1:
            return None
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} asked for group {key}, which it is not a member of")
        pg = self._groups.get(key)
        if pg is None:
            raise ValueError(f"process group over ranks {key} was not pre-created; create every group a plan "
                             f"needs first (ProcessGroups.build with its plans or sizes, or GroupCache.ensure)")
        return pg

    def has(self, ranks: Sequence[int]) -> bool:
        key = tuple(sorted(int(r) for r in ranks))
        return len(key) <= 1 or key in self._groups

    def nested(self, cp_ranks: Sequence[int], inner: int) -> NestedGroups:
        """This rank's inner (Ulysses) and outer (ring) groups of a CP group (lane order)."""
        inners, outers = nested_split(tuple(cp_ranks), inner)
        mine_in = next((g for g in inners if self.rank in g), None)
        mine_out = next((g for g in outers if self.rank in g), None)
        if mine_in is None or mine_out is None:
            raise ValueError(f"rank {self.rank} is not in CP group {tuple(cp_ranks)}")
        return NestedGroups(inner_ranks=mine_in, inner=self.get(mine_in),
                            outer_ranks=mine_out, outer=self.get(mine_out))


@dataclass(kw_only=True)
class ProcessGroups(GroupLookup):
    """Pre-created process groups of this rank, looked up by rank tuple."""

    world_size: int
    specs: tuple[GroupSpec, ...]

    @staticmethod
    def build(
        topologies: Iterable[Topology] = (),
        *,
        plans: Iterable[StepPlan] = (),
        cp_sizes: Callable[[int], Sequence[int]] = allowed_degrees,
        inner_sizes: Sequence[int] | None = None,
        gpus_per_node: int | None = None,
        extra: Iterable[Sequence[int]] = (),
        backend: str | None = None,
    ) -> ProcessGroups:
        """Create every group the given topologies and plans need (collective: call on all ranks).

        ``backend`` defaults to the world's backend (gloo on CPU, NCCL on CUDA).
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call init_world() (or "
                             "init_process_group) on every rank before ProcessGroups.build")
        specs = required_groups(topologies, plans=plans, cp_sizes=cp_sizes, inner_sizes=inner_sizes,
                                gpus_per_node=gpus_per_node, extra=extra)
        world = dist.get_world_size()
        rank = dist.get_rank()
        out = ProcessGroups(rank=rank, world_size=world, specs=tuple(specs))
        for spec in specs:
            if spec.ranks[-1] >= world:
                raise ValueError(f"{spec.kind} group {spec.ranks} names rank {spec.ranks[-1]} but the "
                                 f"world has {world} ranks")
            out._create(spec, world, backend)
        return out

    def __len__(self) -> int:
        return len(self.specs)


# ---- world setup (one machine) -------------------------------------------------------


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
