"""The one multi-process harness of the test suite: N gloo processes on localhost.

    from distributed import run_distributed

    def per_rank(rank, world_size, x):      # module level, so spawned processes can import it
        t = torch.tensor([float(rank + x)])
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(per_rank, 4, 1.0) == [10.0] * 4

Each call spawns fresh processes (``spawn`` start method, one torch thread each) that join a
gloo world through a TCP store the parent owns (no port races), with collective timeouts.
Results come back by rank (pickled: keep them small, CPU tensors or plain data). If a rank
raises, the others fail or are terminated and :class:`WorldError` names the first failing
rank with its traceback; the whole call never exceeds ``timeout`` by much. Spawning costs
seconds per world: run several checks inside one world where you can.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parallel_runtime.launch import WorldError, spawn_world

__all__ = ["WorldError", "run_distributed"]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads: int = 1, grace: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank."""
    return spawn_world(fn, world_size, *args, timeout_s=timeout, threads=threads, grace_s=grace)
