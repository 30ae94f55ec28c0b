"""The step's pull and push overlapped with forward and backward (hooks per bucket, as DDP and FSDP do).

The buckets are the exchange's (:class:`~parallel_runtime.training.transport.ShardExchange`, over the
pure :mod:`parallel_runtime.training.exchange`): bucket ``k`` is the same
window of every shard, so a whole-model rank of a 2-rank world needs buckets ``0..k`` for its first
layers and its last layers' gradients fill the *last* buckets first. Their collectives are started
asynchronously (gloo and NCCL return a work handle) on a process group of their own, at most
``depth`` at a time in reusable buffers, in one order on every rank (pulls ascending, pushes
descending), which is what pairs them up across ranks.

* **pull**: :meth:`Overlap.begin` derives both exchange plans (collectives, before anything is in
  flight) and starts the first ``depth`` pull buckets. A forward pre-hook on every module that holds
  parameters waits for the buckets its parameters need (starting later ones as earlier ones finish),
  so the first microbatch's first layers compute while the later layers' parameters arrive. What a
  module needs is the same on every rank of its TP group (the last bucket of any tp index's slice:
  :func:`~parallel_runtime.training.exchange.tp_group_needs`), since its forward holds TP collectives. The pull
  is finished (:meth:`StepExchange.settle`) after this rank's first forward and before the pipeline
  blocks on a peer (a receive, a barrier): a rank never waits on a bucket that a blocked peer has not
  started, so nothing deadlocks.
* **push**: a post-accumulate-grad hook counts each parameter's gradient accumulations; after this
  rank's last microbatch a parameter's gradient is final, and a bucket whose parameters are all final
  is sent while the backward goes on (buckets strictly in descending order; a bucket that would exceed
  ``depth`` in flight waits for the next hook: a hook never blocks, since the backward may hold a CP
  collective a peer waits on). :meth:`StepExchange.finish` sends the rest and waits for all.

The result is the same as :meth:`ShardExchange.pull` then :meth:`ShardExchange.push`: the same
buckets, bytes and sums (tests/parallel_runtime/training/test_overlap.py). Parameters must be used inside the
forward of the module that holds them, or after it (true of the native decoder and of the HF causal
LMs the runtime accepts); the pull is complete after the first forward in any case.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from balanced_loader.loader_args import available_cores
from parallel_runtime.training.exchange import tp_group_needs
from parallel_runtime.training.layout import LocalParam, grad_of
from parallel_runtime.training.transport import InFlight, ShardExchange


def overlap_wanted(setting: bool | str, *, gpu: bool, busy_cores: int = 0, cores: int = 1) -> bool:
    """``train.overlap`` for a run: ``true`` / ``false`` as given; ``auto`` on GPUs (the collectives run beside
    the kernels), and on CPU only where the compute threads of this machine's ranks (``busy_cores``: ranks x
    ``world.threads``) leave one of its ``cores`` free. Why: where the ranks fill every core, the overlap's
    collectives (a gloo group of their own, a bucket per 2 MB, a thread that wakes for each) run on the
    compute's cores and hide nothing; measured on 2 ranks of 1 thread on 2 cores (HF Llama 27.5M,
    docs/results/hf_speed.md), with it the ranks spent 4% more CPU per step for fewer tokens/s."""
    if isinstance(setting, bool):
        return setting
    return gpu or busy_cores < cores


def run_overlap(setting: bool | str, *, gpu: bool, threads: int, world: int) -> bool:
    """:func:`overlap_wanted` for this rank of a distributed run, the same on every rank: ``auto`` on CPU asks
    this machine (its ranks, ``LOCAL_WORLD_SIZE``, else the world, x ``threads`` against its cores) and takes
    the least answer of all ranks (machines may differ in cores, and the overlap's group is created by every
    rank or none; a collective, so every rank calls it)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this machine's cores
    on = overlap_wanted(setting, gpu=gpu, busy_cores=local_ranks * threads, cores=available_cores())
    if setting == "auto" and not gpu:
        agree = torch.tensor([int(on)])  # gloo: a CPU tensor
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        on = bool(agree.item())
    return on


DEPTH = 2  # buckets in flight at once (each a pair of reusable buffers)
BUCKET_ELEMS = 1 << 19  # elements per bucket buffer when overlapping: DEPTH x 2 x 2 MB in flight


class _Hooks:
    """The hooks of one stage model (installed once; they act while a step's exchange is active)."""

    def __init__(self, model: nn.Module, params: Sequence[LocalParam]) -> None:
        self.active: StepExchange | None = None
        index = {id(lp.tensor): j for j, lp in enumerate(params)}
        self.module_params: dict[int, list[int]] = {}  # id(module) -> local indices of its own parameters
        self.handles = []
        for m in model.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                self.module_params[id(m)] = own
                self.handles.append(m.register_forward_pre_hook(self._pre))
        for j, lp in enumerate(params):
            self.handles.append(lp.tensor.register_post_accumulate_grad_hook(self._grad_hook(j)))

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.active is not None:
            self.active.before_module(self.module_params[id(module)])

    def _grad_hook(self, j: int):
        def hook(_: torch.Tensor) -> None:
            if self.active is not None:
                self.active.grad_final(j)
        return hook


class Overlap:
    """Overlapped buckets of one :class:`ShardExchange` (on its process group of their own), hooks per stage model."""

    def __init__(self, exchange: ShardExchange, *, depth: int = DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.exchange = exchange
        self.depth = depth
        self._hooks: dict[int, _Hooks] = {}
        # buckets that overlapped compute, over the run: pulls done before the first forward ended, pushes
        # started by a gradient hook (the rest went in settle() / finish())
        self.overlapped = {"pull": 0, "push": 0}

    def begin(self, model: nn.Module, params: Sequence[LocalParam], *, microbatches: int,
              push: bool) -> StepExchange:
        """Plan this step's pull (and push) and start the first pull buckets (collective: every rank, in
        the same order). ``microbatches``: this rank's forward/backward passes in the step (0: idle, its
        parameters contribute no gradient); ``push``: also push the gradients (else the pull only)."""
        hooks = self._hooks.get(id(model))
        if hooks is None:
            hooks = self._hooks[id(model)] = _Hooks(model, params)
        ex = StepExchange(self.exchange, params, hooks, microbatches=microbatches, push=push, depth=self.depth,
                          overlapped=self.overlapped)
        hooks.active = ex
        return ex


class StepExchange:
    """One step's pull and push in flight (made by :meth:`Overlap.begin`)."""

    def __init__(self, xc: ShardExchange, params: Sequence[LocalParam], hooks: _Hooks, *, microbatches: int,
                 push: bool, depth: int, overlapped: dict[str, int]) -> None:
        self.xc, self.params, self.hooks, self.depth = xc, params, hooks, depth
        self.overlapped = overlapped
        self.microbatches = microbatches
        pull_rows, targets = xc.describe(params, push=False)
        self.pull = xc.plan_for(pull_rows).buckets
        self._pull_flats = [t.detach().view(-1) for t in targets]
        self.push = ()
        self._push_local: list[int] = []  # push part index -> local parameter index
        if push:
            push_rows, _ = xc.describe(params, push=True, contributes=microbatches > 0)
            self.push = xc.plan_for(push_rows).buckets
            # the parameters describe() kept, in its order (tp index 0 contributes replicated ones)
            self._push_local = [j for j, lp in enumerate(params) if microbatches > 0
                                and (lp.spec.tp_dim is not None or lp.tp_index == 0)]
            xc.begin_push(self.push)
        # pull: the last bucket each local parameter needs, the same on every rank of its TP group (a
        # module's forward holds TP collectives: its members must have waited for the same buckets)
        self._need = tp_group_needs(xc.layout, pull_rows, self.pull)
        # push: parameters not yet final per bucket, and the buckets each local parameter is in
        self._pending = [len(bk.parts) for bk in self.push]
        self._push_of: list[list[int]] = [[] for _ in params]
        for k, bk in enumerate(self.push):
            for j, *_ in bk.parts:
                self._push_of[self._push_local[j]].append(k)
        self._counts = [0] * len(params)
        self._pulled = 0  # pull buckets completed (in order)
        self._pull_next = 0  # next pull bucket to start
        self._push_next = len(self.push) - 1  # next push bucket to start (descending)
        self._flight: list[InFlight] = []  # started, not completed: oldest first
        self._slots: list[int] = list(range(depth))  # free buffer slots
        self._slot_of: dict[int, int] = {}  # id(InFlight) -> its slot
        self._grads: list[torch.Tensor] | None = None  # the pushed gradients, flat (read when the first goes)
        self.overcounted = False
        self._settled = False
        self._fill_pull()

    # ---- in flight -----------------------------------------------------------------------------
    def _start(self, bk, flats, *, push: bool) -> None:
        slot = self._slots.pop()
        f = self.xc.launch(bk, flats, push=push, slot=slot, async_op=True)
        self._slot_of[id(f)] = slot
        self._flight.append(f)

    def _complete_oldest(self) -> None:
        f = self._flight.pop(0)
        self.xc.complete(f)  # its wait counts in the exchange's comm_s
        self._slots.append(self._slot_of.pop(id(f)))
        if not f.push:
            self._pulled += 1

    def _reap(self) -> None:
        """Complete the oldest collectives that are done already (never blocks)."""
        while self._flight and (self._flight[0].work is None or self._flight[0].work.is_completed()):
            self._complete_oldest()

    def _fill_pull(self) -> None:
        while self._pull_next < len(self.pull) and self._slots:
            self._start(self.pull[self._pull_next], self._pull_flats, push=False)
            self._pull_next += 1

    def _ensure_pulled(self, k: int) -> None:
        """Pull buckets ``0..k`` complete (blocking)."""
        with torch.no_grad():
            while self._pulled <= k:
                if not self._flight:
                    self._fill_pull()
                self._complete_oldest()
                self._fill_pull()

    # ---- hooks ---------------------------------------------------------------------------------
    def before_module(self, local: list[int]) -> None:
        """A module holding local parameters ``local`` is about to run: their buckets must be in."""
        if self._pulled < len(self.pull):
            self._reap()
            self._fill_pull()
            self._ensure_pulled(max(self._need[j] for j in local))

    def settle(self) -> None:
        """The whole pull complete (after this rank's first forward; before it blocks on a peer)."""
        if self._pulled < len(self.pull):
            self.overlapped["pull"] += self._pulled
            self._ensure_pulled(len(self.pull) - 1)
        elif not self._settled:
            self.overlapped["pull"] += len(self.pull)
        self._settled = True

    def grad_final(self, j: int) -> None:
        """Local parameter ``j``'s gradient was accumulated once more; after the last microbatch it is final."""
        self._counts[j] += 1
        if self._counts[j] > self.microbatches:
            self.overcounted = True  # more accumulations than passes: buckets may have gone out early
        if self._counts[j] != self.microbatches:
            return
        for k in self._push_of[j]:
            self._pending[k] -= 1
        self._reap()
        before = self._push_next
        self._fill_push(final=False)
        self.overlapped["push"] += before - self._push_next

    def _fill_push(self, *, final: bool) -> None:
        while self._push_next >= 0 and (final or self._pending[self._push_next] == 0):
            if not self._slots:
                if not final:
                    return  # a hook never blocks
                self._complete_oldest()
                continue
            if self._grads is None:
                self._grads = [grad_of(self.params[j].tensor).reshape(-1) for j in self._push_local]
            self._start(self.push[self._push_next], self._grads, push=True)
            self._push_next -= 1

    def finish(self) -> None:
        """After forward/backward: the rest of the pull, every push bucket, and the wait for all of them."""
        try:
            self.settle()
            if self.overcounted:
                raise RuntimeError("a parameter's gradient was accumulated more often than this rank ran microbatches "
                                   "in the step, so gradient buckets may have been sent early; train this model with "
                                   "train.overlap: false")
            with torch.no_grad():
                self._fill_push(final=True)
                while self._flight:
                    self._complete_oldest()
        finally:
            self.hooks.active = None

