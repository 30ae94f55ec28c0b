"""One step's forward and backward on this rank, for any valid plan (and the one-process reference).

:func:`forward_backward` finds this rank's pool, stage, lane and tp index in the plan and runs the
pool's microbatches on the stage's model for that place (:meth:`Runtime.stage_model`, or
:meth:`Runtime.prepare_step` when a step against the optimizer follows) through
:class:`~parallel_runtime.engines.pipeline.PipelineStage` in 1F1B order. Each microbatch's attention
is bound to its group: local attention for one lane, otherwise the CP engine over the group's
cached process groups (ring, Ulysses or nested, from the layout ``cp_inner`` the loader used).
Lanes in no group of a microbatch skip it; a rank with no microbatch at all still returns
(its gradients stay ``None`` and the push contributes zeros).

The pieces it uses live in their own rooms: the stage models and groups a rank keeps
(:mod:`parallel_runtime.training.runtime`), the check that a plan can run here
(:mod:`parallel_runtime.training.plan_check`), parameters in optimizer coordinates
(:mod:`parallel_runtime.training.params`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.calibration.samples import Samples, sample_rows
from balanced_loader.materialize import Microbatch
from balanced_loader.plan import StepPlan
from parallel_runtime.engines.context import make_engine, shard_microbatch
from parallel_runtime.engines.device import to_device
from parallel_runtime.engines.pipeline import Clock, PipelineStage, StageInput, StageLink
from parallel_runtime.model import Transformer, local_attention
from parallel_runtime.topology import Topology
from parallel_runtime.training.runtime import Runtime, StageModel

# ---- one step ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FBResult:
    """What one rank did in a step's forward and backward."""

    loss_sum: float  # this rank's share of the step loss (last stage, tp index 0; else 0)
    compute_ms: float  # time in compute (see pipeline.Clock)
    wall_ms: float  # wall time of the whole forward/backward, waits included
    microbatches: int  # microbatches this rank ran
    pipeline_bytes: int  # activation/gradient bytes this rank sent to neighbouring stages
    busy_wall_ms: float = 0.0  # wall time of the compute blocks alone (waits on peers between them excluded)
    samples: Samples = field(default_factory=Samples.empty)  # per microbatch: features and measured times
    spans: tuple[tuple[int, str, float, float], ...] = ()  # (microbatch, F|B, wall start, end) when asked
    start_s: float = 0.0  # time.perf_counter() when the forward/backward began
    timer: str = "thread-cpu"  # what timed the compute blocks (pipeline.Clock.timer)
    # not resolved yet (forward_backward(resolve=False)): what resolved() reads after the step
    pending: Callable[[], FBResult] | None = field(default=None, repr=False, compare=False)

    def resolved(self) -> FBResult:
        """The figures read from the device (CUDA events, the loss): once, after the step's last collective."""
        return self if self.pending is None else self.pending()


def forward_backward(rt: Runtime, sm: StageModel, plan: StepPlan, topo: Topology, microbatches: Sequence[Microbatch],
                     num_valid_tokens: int, *, step: int = 0, spans: bool = False,
                     sync_point: Callable[[], None] | None = None,
                     after_backward: Callable[[], None] | None = None,
                     resolve: bool = True) -> FBResult:
    """Run this rank's microbatches of ``plan`` on ``sm``, this rank's stage model in ``topo`` (gradients
    accumulate in it); ``spans``: keep
    every compute block's wall start and end (the measured trace); ``sync_point``, ``after_backward``: see
    :class:`~parallel_runtime.engines.pipeline.PipelineStage`; ``resolve=False``: read nothing from the device
    yet (times and loss come with :meth:`FBResult.resolved`, which the trainer calls after the push)."""
    t0 = time.perf_counter()
    c = topo.coord(rt.rank)
    pool = plan.pools[c.pool]
    prev, nxt = topo.stage_neighbours(rt.rank)
    link = StageLink(prev=prev, next=nxt, group=rt.groups.get(topo.pipeline_ranks(rt.rank)) if pool.pp > 1 else None,
                     dtype=rt.dtype, device=rt.device)
    clock = Clock(rt.device, spans=spans)
    stage = PipelineStage(sm.model, link, num_valid_tokens=num_valid_tokens, dtype=rt.dtype, device=rt.device,
                          clock=clock, sync_point=sync_point, after_backward=after_backward)
    work = topo.lane_work(rt.rank, plan)  # [num_microbatches] this lane's group, or None where it skips
    # inputs are built lazily (when the 1F1B order reaches each microbatch), so a CP engine binds
    # its buffers only for the microbatch in flight
    inputs: dict[int, Callable[[], StageInput]] = {}
    for mb in microbatches:
        if mb.padding:  # cp=1 fillers even out a DDP loop's pass count; the runtime has no per-pass collective
            continue
        w = work[mb.k]
        assert w is not None and w.group.lanes == mb.lanes, "microbatches do not match the plan"
        inputs[mb.k] = _input_builder(rt, mb, w.cp_ranks, stage.first, stage.last)
    barrier = None
    if pool.barriers:  # every rank of the pool waits there (Megatron-Core's hybrid CP puts one after each round)
        group = rt.groups.get([r for s in pool.ranks for r in s])

        def barrier() -> None:
            dist.barrier(group=group)
    n = stage.run(len(pool.microbatches), c.stage, pool.pp, inputs, pool.barriers, barrier)
    wall_ms = (time.perf_counter() - t0) * 1e3
    loss = stage.loss_tensor if c.tp_index == 0 else None  # TP ranks of a lane share one loss: count it once
    ran = [mb for mb in microbatches if not mb.padding]

    def read() -> FBResult:
        clock.finish()
        shapes = [(pool.tp, pool.pp, mb.degree, mb.cp_inner, mb.seq_lengths) for mb in ran]
        samples = sample_rows(step, rt.rank, shapes, [clock.cost_ms.get(mb.k, 0.0) for mb in ran],
                              [clock.wall_ms.get(mb.k, 0.0) for mb in ran])
        return FBResult(loss_sum=0.0 if loss is None else float(loss), compute_ms=clock.total_s * 1e3,
                        wall_ms=wall_ms, microbatches=n, pipeline_bytes=link.bytes_sent,
                        busy_wall_ms=sum(clock.wall_ms.values()), samples=samples, spans=tuple(clock.spans or ()),
                        start_s=t0, timer=clock.timer)

    if resolve:
        return read()
    return FBResult(loss_sum=0.0, compute_ms=0.0, wall_ms=wall_ms, microbatches=n, pipeline_bytes=link.bytes_sent,
                    start_s=t0, timer=clock.timer, pending=read)


def _input_builder(rt: Runtime, mb: Microbatch, cp_ranks: tuple[int, ...], first: bool,
                   last: bool) -> Callable[[], StageInput]:
    def build() -> StageInput:
        dev = rt.device
        if mb.degree == 1:
            attn = local_attention(to_device(mb.cu_seqlens, dev), rt.attention, host_cu_seqlens=mb.cu_seqlens)
        else:
            engine = make_engine(engine_kind(mb.degree, mb.cp_inner), rt.groups, cp_ranks, rt.rank,
                                 inner=mb.cp_inner, impl=rt.attention)
            attn = engine.bind(mb.seq_lengths)
        return StageInput(num_tokens=mb.num_tokens, position_ids=to_device(mb.position_ids, dev),
                          input_ids=to_device(mb.input_ids, dev) if first else None,
                          labels=to_device(mb.labels, dev) if last else None, attn=attn)

    return build


def engine_kind(degree: int, inner: int) -> str:
    """The CP engine for a group of ``degree`` lanes laid out with Ulysses size ``inner``."""
    if inner <= 1:
        return "ring"
    return "ulysses" if inner == degree else "nested"


# ---- the one-process reference -------------------------------------------------------------


def reference_forward_backward(model: Transformer, plan: StepPlan, source, num_valid_tokens: int, *,
                               device: torch.device, attention: str = "loop") -> FBResult:
    """The step's docs on one whole model, no parallelism: each plan group's segments as one packed
    microbatch of whole (unpadded) segments, token losses summed and divided by the global valid tokens."""
    t0 = time.perf_counter()
    clock = Clock(device)
    losses: list[torch.Tensor] = []
    n = 0
    for pool in plan.pools:
        for mb in pool.microbatches:
            for g in mb:
                toks = [np.asarray(source.read(d, s, ln), dtype=np.int64) for d, s, ln in g.segments]
                b = shard_microbatch(toks, 1, 0)
                with clock:
                    ids, pos, labels = (to_device(b[k], device) for k in ("input_ids", "position_ids", "labels"))
                    attn = local_attention(to_device(b["cu_seqlens"], device), attention,
                                           host_cu_seqlens=b["cu_seqlens"])
                    loss = model(ids, pos, labels, attn=attn, num_valid_tokens=num_valid_tokens)
                    loss.backward()
                losses.append(loss.detach())
                n += 1
    loss_sum = sum(float(x) for x in losses)  # read once the work is queued (fp64 sums, in order)
    clock.finish()
    return FBResult(loss_sum=loss_sum, compute_ms=clock.total_s * 1e3, wall_ms=(time.perf_counter() - t0) * 1e3,
                    microbatches=n, pipeline_bytes=0, busy_wall_ms=sum(clock.wall_ms.values()), timer=clock.timer)

