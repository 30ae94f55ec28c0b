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

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parallel_runtime.launch import WorldError, spawn_world

__all__ = ["WorldError", "accelerate_launch", "run_commands", "run_distributed"]

REPO = Path(__file__).resolve().parents[1]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads: int = 1, grace: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank."""
    return spawn_world(fn, world_size, *args, timeout_s=timeout, threads=threads, grace_s=grace)


# ---- examples run as the user runs them: fresh interpreters, some under `accelerate launch` ----------


def _example_env() -> dict[str, str]:
    """The test's environment without the variables of an enclosing launcher, one torch thread, the repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def accelerate_launch(num_processes: int) -> list[str]:
    """``accelerate launch`` of ``num_processes`` CPU processes on a free port (append the script and its args)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port)]


def run_commands(cmds: Sequence[Sequence[str]], cwd: str | os.PathLike, timeout: float = 600) -> list[str]:
    """Run the commands at once (independent runs: the wall time is the longest); each must exit 0.
    Returns their stderr, in order."""
    procs = [subprocess.Popen(list(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_example_env(),
                              cwd=cwd) for c in cmds]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return errs
