"""A step's row of ``metrics.jsonl`` from what the step did (:class:`~.step_run.StepRun`).

:meth:`StepReport.record`, on every rank after the optimizer step, in this order: every rank's memory
(a gather: peak, base and parts, process groups), the balance of the trained plan against the cost model
that planned it (and of each compared policy's plan against its own), the closed loop's calibration and
trace (``train.calibrate`` / ``train.trace``: gathers and fits), and every rank's phase times (a gather).
Each collective is a named phase (a timeout reports it). Keys in docs/runtime.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.loader import BalancedLoader, StepBatch
from parallel_runtime.groups import GroupCache
from parallel_runtime.launch import phase
from parallel_runtime.training import metrics as M
from parallel_runtime.training.breakdown import StepTimes
from parallel_runtime.training.closed_loop import ClosedLoop
from parallel_runtime.training.optimizer import ShardedOptimizer
from parallel_runtime.training.step_memory import StepMemory
from parallel_runtime.training.step_run import Pass, StepRun
from parallel_runtime.training.transport import ShardExchange


class StepReport:
    """The figures a step's record gathers, and the row."""

    def __init__(self, *, policy: str, loader: BalancedLoader, compare: Mapping[str, BalancedLoader],
                 loop: ClosedLoop, memory: StepMemory, times: StepTimes, optimizer: ShardedOptimizer,
                 exchange: ShardExchange, groups: GroupCache | None, world_size: int,
                 comm_device: torch.device | None) -> None:
        """``groups`` and ``comm_device`` None: a reference run (one process, no collective)."""
        self.policy, self.loader, self.compare, self.loop = policy, loader, compare, loop
        self.memory, self.times, self.optimizer, self.exchange = memory, times, optimizer, exchange
        self.groups, self.comm_device = groups, comm_device
        self.everyone = range(world_size)

    def record(self, batch: StepBatch, run: StepRun, t0: float) -> dict[str, Any]:
        """The row of the step on ``batch`` that started at ``time.perf_counter() == t0`` (collective)."""
        s, stats = batch.step, run.trained.stats
        with phase(f"the memory record of step {s}", self.everyone):
            memory = self._memory()
        bal = self._balance(self.loader, run.trained)
        if self.comm_device is None:  # one process: the plan's per-rank prediction, one measured time
            bal.update(skew=1.0, wall_skew=1.0, measured_bubble=0.0)
        # before the closed loop, which may hand the compared loaders a new cost model
        compare = {name: {"fingerprint": p.row["fingerprint"], "loss": float(p.stats.loss_sum.sum()),
                          **{k: p.row[k] for k in ("pools", "cp_groups", "max_degree")},
                          **self._balance(self.compare[name], p)}
                   for name, p in run.compared.items()}
        if self.loop.active:
            with phase(f"the calibration after step {s}", self.everyone), self.times.phase("closed_loop"):
                bal.update(self.loop.after_step(batch, run.trained.fb, (time.perf_counter() - t0) * 1e3))
        # one clock reading for both: record() gathers the ranks' rows (a collective), and a second reading after it
        # would put that wait in step_ms but in none of the phases
        step_ms = (time.perf_counter() - t0) * 1e3
        with phase(f"the time record of step {s}", self.everyone):
            times = self.times.record(step_ms, self.comm_device)
        rec = {"step": s, "loss": float(stats.loss_sum.sum()), "valid_tokens": batch.num_valid_tokens,
               "policy": self.policy, **run.trained.row, **bal,
               "wall_ms": np.round(stats.wall_ms, 3).tolist(), "microbatches": stats.microbatches.astype(int).tolist(),
               "planner_wait_ms": round(float(stats.planner_wait_ms.max()), 3),
               "grad_norm": run.grad_norm, "lr": run.lr,
               "pull_bytes": run.moved.bytes_pulled, "push_bytes": run.moved.bytes_pushed,
               "pipeline_bytes": int(stats.pipeline_bytes.sum()), "new_groups": run.trained.new_groups,
               "step_ms": round(step_ms, 3), "memory": memory, "time_ms": times}
        if batch.mixture_tokens is not None:
            rec["mixture_tokens"] = batch.mixture_tokens
        if compare:
            rec["compare"] = compare
        return rec

    @staticmethod
    def _balance(loader: BalancedLoader, p: Pass) -> dict[str, Any]:
        """The pass's plan against the cost model its loader planned it with."""
        return M.step_balance(p.batch.plan, loader.costs.at(p.batch.step), p.stats.compute_ms, p.stats.wall_ms,
                              p.stats.busy_wall_ms)

    def _memory(self) -> dict[str, Any]:
        """Every rank's peak and parts (collective unless a reference run)."""
        mine = {**self.memory.figures(
            optimizer_bytes=self.optimizer.state_bytes,  # a gradient shard inside the working gradients: grads_bytes
            comm_bytes=self.exchange.buffer_bytes),  # the reusable fp32 send and receive buffers of the buckets
            "process_groups": self._process_groups()}
        rows = M.gather_values(mine, self.comm_device)
        return {**rows, "peak_exact": [bool(x) for x in rows["peak_exact"]]}

    def _process_groups(self) -> int:
        """Process groups this rank is in: the world, the optimizer's exchange group and the plan groups (NCCL
        makes a communicator, with its own device buffers, for each one used)."""
        if self.groups is None:
            return 0
        groups = {id(g) for g in self.groups.members()} | {id(dist.group.WORLD)}
        if self.optimizer.group is not None:
            groups.add(id(self.optimizer.group))
        return len(groups)
