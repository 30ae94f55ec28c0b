"""One rank's step after its plan is checked: pull, forward/backward, push (the trainer's and the estimate's).

:func:`execute_step` is the sequence every rank runs once the plan's topology is known: the stage model
for this rank's place, with its gradients attached in fp32 and the optimizer's shards inside its buffers
where they fit (:meth:`~parallel_runtime.training.runtime.Runtime.prepare_step`); the parameter pull (in
flight beside the first forward with ``train.overlap``);
:func:`~parallel_runtime.training.step.forward_backward`; the gradient push (both through the
:class:`~parallel_runtime.training.transport.ShardExchange`); and only then the figures read from the
device (:meth:`FBResult.resolved`: CUDA events and the loss, one synchronize after the step's last
collective). The caller adds what it needs around each piece through :class:`StepHooks`: the trainer its
failure phases, phase times and memory probes; :mod:`parallel_runtime.diagnostics.estimate` the kinds of
the memory it tracks.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from balanced_loader.materialize import Microbatch
from balanced_loader.plan import StepPlan
from parallel_runtime.topology import Topology
from parallel_runtime.training.overlap import Overlap
from parallel_runtime.training.runtime import GradBuffer, Runtime, StageModel
from parallel_runtime.training.step import FBResult, forward_backward
from parallel_runtime.training.transport import ShardExchange


class StepHooks:
    """What a caller adds around the pieces of a step (every method may do nothing)."""

    def phase(self, name: str) -> AbstractContextManager:
        """Around ``pull``, ``forward_backward`` and ``push``."""
        return nullcontext()

    def model(self, sm: StageModel) -> None:
        """The stage model this step runs (before its gradients are attached)."""

    def between(self) -> None:
        """Between the phases."""

    def before_push(self, sm: StageModel) -> None:
        """After forward/backward, before the push (the gradients are final)."""


def execute_step(runtime: Runtime, exchange: ShardExchange, overlap: Overlap | None, topo: Topology,
                 plan: StepPlan, microbatches: Sequence[Microbatch], num_valid_tokens: int, *, step: int,
                 push: bool = True, share_grad: bool = True, recompute: bool = False, spans: bool = False,
                 hooks: StepHooks | None = None) -> FBResult:
    """Pull, forward/backward and (``push``) push of this rank's part of ``plan``; returns its resolved result.
    ``share_grad``: the optimizer's gradient shard may live inside the working gradients (not when another
    policy's pass runs between this push and the optimizer step)."""
    hooks = hooks or StepHooks()
    sm = runtime.prepare_step(topo, exchange.optimizer, push=push, share_grad=share_grad)
    sm.model.recompute = recompute
    hooks.model(sm)
    live = None  # with train.overlap: the step's pull and push in flight beside forward/backward
    with hooks.phase("pull"):
        if overlap is not None:
            # passes that run (cp=1's padding fillers run none: such a rank contributes no gradient, as without
            # overlap, where the idle rank's gradients are detached below)
            live = overlap.begin(sm.model, sm.params, microbatches=sum(not mb.padding for mb in microbatches),
                               push=push)
        else:
            exchange.pull(sm.params)
    hooks.between()
    with hooks.phase("forward_backward"):
        res = forward_backward(runtime, sm, plan, topo, microbatches, num_valid_tokens, step=step, spans=spans,
                               sync_point=live.settle if live is not None else None, resolve=False)
    if not res.microbatches:  # an idle rank contributes no gradient (and moves no bytes in the push)
        GradBuffer.detach(sm.params)
    hooks.between()
    with hooks.phase("push"):
        if push:
            hooks.before_push(sm)
        if live is not None:
            live.finish()
        elif push:
            exchange.push(sm.params)
        GradBuffer.detach(sm.params)
        hooks.between()
    return res.resolved()  # times and loss read from the device once, after the step's last collective
