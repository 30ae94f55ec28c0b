"""One step's forward and backward on this rank, for any valid plan (and the one-process reference).

:func:`forward_backward` finds this rank's pool, stage, lane and tp index in the plan, takes
(or builds) the stage's model for that pool shape, and runs the pool's microbatches through
:class:`~parallel_runtime.engines.pipeline.PipelineStage` in 1F1B order. Each microbatch's attention
is bound to its group: local attention for one lane, otherwise the CP engine over the group's
cached process groups (ring, Ulysses or nested, from the layout ``cp_inner`` the loader used).
Lanes in no group of a microbatch skip it; a rank with no microbatch at all still returns
(its gradients stay ``None`` and the push contributes zeros).

Process groups: :class:`GroupCache` creates the groups of the run's declared shapes up front
and, before a step, any group that step's plan needs and that does not exist yet (collective
over the world, in the order :func:`~parallel_runtime.topology.required_groups` gives; every
rank holds the same plan, checked by fingerprint first, so the order agrees).

Parameters: the model's full parameter names are the optimizer's coordinates
(:func:`param_specs`); :func:`init_params` yields every full parameter from (seed, name) one
layer at a time, so every layout starts from the same model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.materialize import Microbatch
from balanced_loader.plan import StepPlan
from parallel_runtime.engines.context import make_engine
from parallel_runtime.engines.pipeline import Clock, PipelineStage, StageInput, StageLink, stage_layers
from parallel_runtime.engines.tensor import TensorParallel
from parallel_runtime.groups import GroupLookup
from parallel_runtime.model import ModelConfig, Transformer, local_attention
from parallel_runtime.topology import GroupSpec, Topology, required_groups
from parallel_runtime.training.optimizer import LocalParam, ParamSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- parameters in full-model coordinates ----------------------------------------------


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the full model (name, full shape, TP split dim); norms get no weight decay."""
    model = Transformer(cfg, device="meta", seed=None)
    return [ParamSpec(name=n, shape=tuple(shape), tp_dim=dim, decay=not n.endswith("norm.weight"))
            for n, (shape, dim) in model.full_shapes().items()]


def init_params(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full fp32 tensor)`` of every parameter, built one piece (ends, then each layer) at a time."""
    ends = Transformer(cfg, layers=[], seed=seed)
    yield from ((n, p.detach()) for n, p in ends.named_parameters())
    del ends
    for i in range(cfg.num_layers):
        block = Transformer(cfg, layers=[i], first_stage=False, last_stage=False, seed=seed)
        yield from ((n, p.detach()) for n, p in block.named_parameters())


# ---- process groups ---------------------------------------------------------------------


@dataclass(kw_only=True)
class GroupCache(GroupLookup):
    """Process groups by rank set, created collectively in one order on every rank, as plans need them."""

    backend: str | None = None
    created: set[tuple[int, ...]] = field(default_factory=set)  # every group created, member or not
    num_created: int = 0

    def ensure(self, specs: Iterable[GroupSpec]) -> int:
        """Create the groups of ``specs`` that do not exist yet (collective: same specs on every rank)."""
        world = dist.get_world_size()
        n = 0
        for spec in specs:
            if spec.ranks in self.created:
                continue
            self.created.add(spec.ranks)
            self._create(spec, world, self.backend)
            n += 1
        self.num_created += n
        return n


def declared_groups(topologies: Iterable[Topology], cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups of the run's declared pool shapes: TP, PP and every aligned CP block (plus nested parts)."""
    return required_groups(topologies, inner_sizes=_inner_sizes(cp_engine, cp_inner))


def plan_groups(plan: StepPlan, cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups one plan uses: its pools' TP and PP groups and its CP groups (plus nested parts)."""
    return required_groups([], plans=[plan], cp_sizes=lambda n: [1], inner_sizes=_inner_sizes(cp_engine, cp_inner))


def _inner_sizes(cp_engine: str, cp_inner: int) -> list[int]:
    return [cp_inner] if cp_engine == "nested" and cp_inner > 1 else []


def engine_kind(degree: int, inner: int) -> str:
    """The CP engine for a group of ``degree`` lanes laid out with Ulysses size ``inner``."""
    if inner <= 1:
        return "ring"
    return "ulysses" if inner == degree else "nested"


# ---- stage models ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StageModel:
    """This rank's part of the model for one pool shape, and its parameters in full coordinates."""

    model: Transformer
    params: tuple[LocalParam, ...]


class Runtime:
    """What a rank keeps across steps: groups, stage models by shape, the model config."""

    def __init__(self, cfg: ModelConfig, *, rank: int, device: torch.device, dtype: torch.dtype,
                 attention: str, groups: GroupCache | None, specs: Sequence[ParamSpec]) -> None:
        self.cfg, self.rank, self.device, self.dtype = cfg, rank, device, dtype
        self.attention = attention
        self.groups = groups
        self.specs = {s.name: s for s in specs}
        self._models: dict[tuple, StageModel] = {}

    def stage_model(self, topo: Topology) -> StageModel:
        """The model of this rank's (pool shape, stage, tp index, TP group), built once and reused."""
        c = topo.coord(self.rank)
        pool = topo.pools[c.pool]
        tp_ranks = topo.tp_ranks(self.rank)
        key = (pool.tp, pool.pp, c.stage, c.tp_index, tp_ranks)
        sm = self._models.get(key)
        if sm is None:
            tp = TensorParallel(size=pool.tp, index=c.tp_index,
                                group=self.groups.get(tp_ranks) if pool.tp > 1 else None)
            model = Transformer(self.cfg, tp=tp, layers=stage_layers(self.cfg.num_layers, pool.pp, c.stage),
                                first_stage=c.stage == 0, last_stage=c.stage == pool.pp - 1, device=self.device,
                                dtype=self.dtype, seed=None)
            params = tuple(LocalParam(spec=self.specs[n], tensor=p, tp_index=c.tp_index, tp_size=pool.tp)
                           for n, p in model.named_parameters())
            sm = StageModel(model=model, params=params)
            self._models[key] = sm
        return sm


# ---- one step ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FBResult:
    """What one rank did in a step's forward and backward."""

    loss_sum: float  # this rank's share of the step loss (last stage, tp index 0; else 0)
    compute_ms: float  # time in compute (see pipeline.Clock)
    wall_ms: float  # wall time of the whole forward/backward, waits included
    microbatches: int  # microbatches this rank ran
    pipeline_bytes: int  # activation/gradient bytes this rank sent to neighbouring stages


def forward_backward(rt: Runtime, plan: StepPlan, topo: Topology, microbatches: Sequence[Microbatch],
                     num_valid_tokens: int) -> tuple[FBResult, StageModel]:
    """Run this rank's microbatches of ``plan`` (gradients accumulate in the stage model)."""
    t0 = time.perf_counter()
    c = topo.coord(rt.rank)
    pool = plan.pools[c.pool]
    sm = rt.stage_model(topo)
    prev, nxt = topo.stage_neighbours(rt.rank)
    link = StageLink(prev=prev, next=nxt, group=rt.groups.get(topo.pipeline_ranks(rt.rank)) if pool.pp > 1 else None)
    clock = Clock(rt.device)
    stage = PipelineStage(sm.model, link, num_valid_tokens=num_valid_tokens, dtype=rt.dtype, device=rt.device,
                          clock=clock)
    work = topo.lane_work(rt.rank, plan)
    inputs: dict[int, Callable[[], StageInput]] = {}
    for mb in microbatches:
        w = work[mb.k]
        assert w is not None and w.group.lanes == mb.lanes, "microbatches do not match the plan"
        inputs[mb.k] = _input_builder(rt, mb, w.cp_ranks, stage.first, stage.last)
    n = stage.run(len(pool.microbatches), c.stage, pool.pp, inputs)
    loss = stage.loss_sum if c.tp_index == 0 else 0.0
    return FBResult(loss_sum=loss, compute_ms=clock.total_s * 1e3, wall_ms=(time.perf_counter() - t0) * 1e3,
                    microbatches=n, pipeline_bytes=link.bytes_sent), sm


def _input_builder(rt: Runtime, mb: Microbatch, cp_ranks: tuple[int, ...], first: bool,
                   last: bool) -> Callable[[], StageInput]:
    def build() -> StageInput:
        dev = rt.device
        if mb.degree == 1:
            attn = local_attention(torch.from_numpy(mb.cu_seqlens).to(dev), rt.attention)
        else:
            engine = make_engine(engine_kind(mb.degree, mb.cp_inner), rt.groups, cp_ranks, rt.rank,
                                 inner=mb.cp_inner, impl=rt.attention)
            attn = engine.bind(mb.seq_lengths)
        return StageInput(num_tokens=mb.num_tokens, position_ids=torch.from_numpy(mb.position_ids).to(dev),
                          input_ids=torch.from_numpy(mb.input_ids).to(dev) if first else None,
                          labels=torch.from_numpy(mb.labels).to(dev) if last else None, attn=attn)

    return build


# ---- the one-process reference -------------------------------------------------------------


def reference_forward_backward(model: Transformer, plan: StepPlan, source, num_valid_tokens: int, *,
                               device: torch.device, attention: str = "loop") -> FBResult:
    """The step's docs on one whole model, no parallelism: each plan group's segments as one packed
    microbatch of whole (unpadded) segments, token losses summed and divided by the global valid tokens."""
    from parallel_runtime.engines.context import shard_microbatch

    t0 = time.perf_counter()
    clock = Clock(device)
    loss_sum, n = 0.0, 0
    for pool in plan.pools:
        for mb in pool.microbatches:
            for g in mb:
                toks = [np.asarray(source.read(d, s, ln), dtype=np.int64) for d, s, ln in g.segments]
                b = shard_microbatch(toks, 1, 0)
                with clock:
                    ids, pos, labels = (torch.from_numpy(b[k]).to(device) for k in ("input_ids", "position_ids",
                                                                                    "labels"))
                    attn = local_attention(torch.from_numpy(b["cu_seqlens"]).to(device), attention)
                    loss = model(ids, pos, labels, attn=attn, num_valid_tokens=num_valid_tokens)
                    loss.backward()
                loss_sum += float(loss.detach())
                n += 1
    return FBResult(loss_sum=loss_sum, compute_ms=clock.total_s * 1e3, wall_ms=(time.perf_counter() - t0) * 1e3,
                    microbatches=n, pipeline_bytes=0)


def fingerprint_int(plan: StepPlan) -> int:
    """The plan fingerprint as a non-negative int64 (first 60 bits of the hex digest)."""
    return int(plan.fingerprint()[:15], 16)
