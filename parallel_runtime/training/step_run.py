"""One train step on this rank, as two executors of one sequence (the trainer's ``train_step`` before its record).

:meth:`StepExecutor.run` is the step: inside one memory context (:class:`~.step_memory.StepMemory`: a fresh
peak, heap trims between phases) and one exchange record (:class:`~.transport.ExchangeStats`: the step's
pulls and pushes), the trained pass (:meth:`StepExecutor.forward_backward` with the push), the passes of the
compared policies (forward/backward of their plans of the same data, no push) and the optimizer step. It
returns a :class:`StepRun`, everything the step's record (:mod:`.step_report`) is made of.

Two executors run a pass:

* :class:`DistributedStep`: this rank's part of the plan: the plan check
  (:func:`~.plan_check.check_plan_runs_here`: same plan everywhere, contract 1, hostable, groups created),
  then :func:`~.rank_step.execute_step` (pull, forward/backward, push) and one all-gather of every rank's
  figures;
* :class:`ReferenceStep`: the whole plan in one process on the whole model (``--reference``: the check
  that a parallel setup is exact).

Every phase of a step is one context (:meth:`StepExecutor.phase`): named for failures (what a timeout
waited on and with whom: :func:`parallel_runtime.launch.phase`) and timed into ``time_ms``
(:class:`~.breakdown.StepTimes`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from balanced_loader.loader import BalancedLoader, StepBatch
from parallel_runtime.config import Recipe
from parallel_runtime.groups import GroupCache
from parallel_runtime.launch import phase as named_phase
from parallel_runtime.training import metrics as M
from parallel_runtime.training.breakdown import StepTimes
from parallel_runtime.training.layout import LocalParam
from parallel_runtime.training.optimizer import ShardedOptimizer
from parallel_runtime.training.overlap import Overlap
from parallel_runtime.training.plan_check import check_plan_runs_here
from parallel_runtime.training.rank_step import StepHooks, execute_step
from parallel_runtime.training.runtime import GradBuffer, Runtime, StageModel
from parallel_runtime.training.step import FBResult, reference_forward_backward
from parallel_runtime.training.step_memory import StepMemory
from parallel_runtime.training.transport import ExchangeStats, ShardExchange


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """One pass's figures of every rank, by rank (all-gathered in :meth:`gather`)."""

    loss_sum: np.ndarray  # [world] float64, each rank's share of the step loss
    compute_ms: np.ndarray  # [world] float64, time in compute
    wall_ms: np.ndarray  # [world] float64, forward/backward wall time, waits included
    planner_wait_ms: np.ndarray  # [world] float64, time the step waited for its plan
    microbatches: np.ndarray  # [world] float64, microbatches each rank ran
    pipeline_bytes: np.ndarray  # [world] float64, bytes each rank sent to neighbouring stages
    busy_wall_ms: np.ndarray  # [world] float64, wall time of each rank's compute blocks

    @staticmethod
    def of(res: FBResult, wait_s: float) -> RankStats:
        """This rank's figures alone (a world of one)."""
        return RankStats(loss_sum=np.array([res.loss_sum]), compute_ms=np.array([res.compute_ms]),
                         wall_ms=np.array([res.wall_ms]), planner_wait_ms=np.array([wait_s * 1e3]),
                         microbatches=np.array([float(res.microbatches)]),
                         pipeline_bytes=np.array([float(res.pipeline_bytes)]),
                         busy_wall_ms=np.array([res.busy_wall_ms]))

    def gather(self, comm_device: torch.device) -> RankStats:
        """Every rank's figures (collective): one all-gather of this rank's fields, packed in field order."""
        names = [f.name for f in fields(self)]
        rows = M.gather_rows([getattr(self, n)[0] for n in names], comm_device)  # [world, fields]
        return RankStats(**{n: rows[:, i] for i, n in enumerate(names)})


@dataclass(frozen=True, kw_only=True)
class Pass:
    """One forward/backward of a plan on every rank."""

    batch: StepBatch
    row: dict  # the plan's keys of the step record (metrics.plan_row), its fingerprint among them
    stats: RankStats  # every rank's figures (this rank's alone in a reference run)
    fb: FBResult  # this rank's result
    new_groups: int  # process groups the plan check created


@dataclass(frozen=True, kw_only=True)
class StepRun:
    """What one step did: the trained pass, the compared policies' passes, the optimizer step, the traffic."""

    trained: Pass
    compared: dict[str, Pass]  # by policy name, in policy.compare's order
    grad_norm: float
    lr: float  # the learning rate of this optimizer step
    moved: ExchangeStats  # the step's pulls and pushes, the compared passes' included


class StepExecutor(ABC):
    """The sequence of one step; a subclass runs its passes (:meth:`forward_backward`)."""

    def __init__(self, *, optimizer: ShardedOptimizer, exchange: ShardExchange, memory: StepMemory,
                 times: StepTimes, world_size: int) -> None:
        self.optimizer, self.exchange, self.memory, self.times = optimizer, exchange, memory, times
        self.everyone = range(world_size)  # what a world-wide collective waits on

    def run(self, batch: StepBatch, compare: Mapping[str, BalancedLoader],
            next_batch: Callable[[BalancedLoader], StepBatch]) -> StepRun:
        """The step on ``batch``, then a pass of each compared loader's next batch (``next_batch``), then the
        optimizer step."""
        self.exchange.take_stats()  # this step's record starts here
        with self.memory.step():  # heap trims between phases, the peak from here to the optimizer step's end
            trained = self.forward_backward(batch, push=True)
            compared = {name: self.forward_backward(next_batch(ld), push=False) for name, ld in compare.items()}
            with self.phase("optimizer", f"the optimizer step of step {batch.step}", self.everyone):
                norm = self.optimizer.step()
        moved = self.exchange.take_stats()
        self.times.add("exposed_comm", moved.comm_s + self.optimizer.norm_comm_s)  # the collectives' waits
        return StepRun(trained=trained, compared=compared, grad_norm=norm, moved=moved,
                       lr=self.optimizer.config.lr_at(self.optimizer.steps - 1))

    def phase(self, key: str | None, what: str, ranks: Sequence[int]) -> ExitStack:
        """One phase of the step: named for failures (``what``, waiting on ``ranks``) and timed under ``key`` of
        ``time_ms`` (None: in ``other``)."""
        stack = ExitStack()
        stack.enter_context(named_phase(what, ranks))
        if key is not None:
            stack.enter_context(self.times.phase(key))
        return stack

    @abstractmethod
    def forward_backward(self, batch: StepBatch, *, push: bool) -> Pass:
        """Forward and backward of ``batch``'s plan; ``push``: the gradients go into the optimizer's shards."""


class DistributedStep(StepExecutor):
    """This rank's part of each plan, with every other rank."""

    def __init__(self, runtime: Runtime, *, recipe: Recipe, groups: GroupCache, overlap: Overlap | None,
                 rank: int, comm_device: torch.device, share_grad: bool, **kw) -> None:
        """``share_grad``: the optimizer's gradient shard may live inside the working gradients (not when a
        compared policy's pass runs between the push and the optimizer step)."""
        super().__init__(**kw)
        self.runtime, self.recipe, self.groups, self.overlap = runtime, recipe, groups, overlap
        self.rank, self.comm_device, self.share_grad = rank, comm_device, share_grad

    def forward_backward(self, batch: StepBatch, *, push: bool) -> Pass:
        s, train, plan = batch.step, self.recipe.train, batch.plan
        row = M.plan_row(plan)  # the fingerprint once: for the plan check and the record
        with self.phase("plan_check", f"the plan check of step {s}", self.everyone):
            topo, new_groups = check_plan_runs_here(plan, recipe=self.recipe, sequences=batch.sequences,
                                                    groups=self.groups, comm_device=self.comm_device,
                                                    fingerprint=row["fingerprint"])
        hooks = _PhaseHooks(self, s, topo.step_peers(self.rank, plan), push)
        res = execute_step(self.runtime, self.exchange, self.overlap, topo, plan, batch.microbatches,
                           batch.num_valid_tokens, step=s, push=push, share_grad=self.share_grad,
                           recompute=train.recompute, spans=train.trace and push, hooks=hooks)
        with self.phase(None, f"the stats gather of step {s}", self.everyone):
            stats = RankStats.of(res, batch.planner_wait_s).gather(self.comm_device)
        return Pass(batch=batch, row=row, stats=stats, fb=res, new_groups=new_groups)


class ReferenceStep(StepExecutor):
    """Each plan's docs in this one process, on the whole model."""

    def __init__(self, model: nn.Module, params: list[LocalParam], *, source, device: torch.device,
                 attention: str, recompute: bool, fp32_grads: bool, **kw) -> None:
        """``fp32_grads``: a half-precision model sums its microbatches' gradients in fp32, as the runtime does."""
        super().__init__(**kw)
        self.model, self.params, self.source, self.device = model, params, source, device
        self.attention, self.recompute = attention, recompute
        self.grads = GradBuffer(device) if fp32_grads else None

    def forward_backward(self, batch: StepBatch, *, push: bool) -> Pass:
        self.model.recompute = self.recompute
        saved = self.memory.watch(self.model, self.params)
        self.exchange.pull(self.params)
        if self.grads is not None:
            self.grads.attach(self.params)
        with saved.hooks():
            res = reference_forward_backward(self.model, batch.plan, self.source, batch.num_valid_tokens,
                                             device=self.device, attention=self.attention)
        self.memory.note(self.params, saved)
        if push:
            self.exchange.push(self.params)
        GradBuffer.detach(self.params)
        return Pass(batch=batch, row=M.plan_row(batch.plan), stats=RankStats.of(res, batch.planner_wait_s), fb=res,
                    new_groups=0)


class _PhaseHooks(StepHooks):
    """A distributed pass's pieces as the step's phases (failure names, times) with the memory probes."""

    def __init__(self, ex: DistributedStep, step: int, peers: list[int], push: bool) -> None:
        """``peers``: the ranks this rank exchanges with in the forward/backward (:meth:`Topology.step_peers`)."""
        self.ex, self.step, self.peers, self.push = ex, step, peers, push
        self.saved: M.SavedActivations | None = None

    def phase(self, name: str) -> ExitStack:
        ex, s = self.ex, self.step
        if name == "forward_backward":
            stack = ex.phase(name, f"forward/backward of step {s}", self.peers)
            stack.enter_context(self.saved.hooks())
            return stack
        return ex.phase(name, {"pull": f"the parameter pull of step {s}",
                               "push": f"the gradient push of step {s}"}[name], ex.everyone)

    def model(self, sm: StageModel) -> None:
        self.saved = self.ex.memory.watch(sm.model, sm.params)

    def between(self) -> None:
        self.ex.memory.between()

    def before_push(self, sm: StageModel) -> None:
        if self.push:
            self.ex.memory.note(sm.params, self.saved)

