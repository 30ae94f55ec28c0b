"""``hydraulis``: heterogeneous pipelines per step (papers/hydraulis.md), with CP inside pools of one shape.

**As published** (:func:`_classic`): every pipeline is its own pool of shape ``(tp, pp)`` (from the cost
file's ``strategies``) with exactly one lane; pools take consecutive rank ranges, largest first (TP inside a
node). Each microbatch is one group ``lanes=[0]`` of packed docs, so a pool's contract-2 time is
``sum_j t_j / pp + (pp - 1) max_j t_j / pp``: the paper's 1F1B ``(m + pp - 1) t_max`` when the
microbatches are equal (the preset's whole-model coefficients are the paper's per-stage
ones times pp). Replicas of a shape are separate pools.

Per step, for every candidate strategy that holds the batch's longest doc: stage 1 sends
docs to pipelines, stage 2 packs each pipeline's docs into microbatches
(:mod:`balanced_loader.planning.solvers.assign`); the fastest candidate wins. Candidates come from
``PlanConfig.candidates`` (a file written by ``balanced-loader candidates``), else from
``extra["length_histogram"]`` (lengths, or a mapping length -> count), else from the current
batch's own lengths (:mod:`balanced_loader.planning.solvers.candidates`). If no candidate holds the
longest doc, the homogeneous plan of the fastest shape that holds it is added (noted).

**With CP inside pools** (:func:`pooled_candidates`): a one-lane pipeline holds no doc longer than its
shape's ``max_tokens_per_lane``. The same strategies are also planned as one pool per shape whose lanes
are all its replicas, docs balanced across the pools and hydra inside each (policy ``pools``), so a doc
may run as a CP group over several replicas of one shape: every homogeneous shape (the best homogeneous
shape is always a candidate) and the classic plan's own strategy. The fastest plan by contract 2 wins
(a note names it when it is not the one-lane pipelines); docs longer than every pipeline are planned by
the pooled candidates alone. ``cp`` caps the CP degree inside the pools (``cp=1``: no CP).

Cost-aware pruning keeps the ILPs few: every candidate is first planned with greedy stage 2;
candidates are then refined in order of that time, and only while their lower bound can still
win; within a candidate only the slowest pipeline is re-packed by ILP (the others cannot change
the step time). Knobs (``PlanConfig.extra``): ``restarts`` (50), ``node_limit`` (100),
``stage2_time_limit_s`` (0.5), ``max_v`` (16), ``delta_s`` (128), ``delta_n`` (1),
``fixed_cost`` ("packed"), ``stage1_fixed`` ("none": the paper's cost; "packed": stage 1 adds
each doc's share ``microbatch_ms * len / cap`` of a microbatch), ``ilp_min_gain``
(0.01: a stage-2 ILP runs only where greedy packing is more than 1 % above its bound). Deterministic given
(items, cost, config) unless a time limit is hit, which ``StepPlan.notes`` records.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost
from balanced_loader.plan import BatchItems, Group, Pool, StepPlan, single_pool_ranks
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies import pools
from balanced_loader.planning.policies.common import longest_on, refuse_flags
from balanced_loader.planning.solvers import candidates as cands
from balanced_loader.planning.solvers.assign import Packing, dispatch, pack_pipeline
from balanced_loader.simulate import serial_pool_ms, step_ms
from balanced_loader.strict import check_keys, number

_DEFAULTS: dict[str, object] = {"restarts": 50, "node_limit": 100, "stage2_time_limit_s": 0.5, "max_v": 16,
                                "delta_s": 128, "delta_n": 1, "fixed_cost": "packed", "stage1_fixed": "none",
                                "ilp_min_gain": 0.01}


@dataclass(frozen=True, kw_only=True, slots=True)
class HydraulisOptions:
    restarts: int
    node_limit: int
    stage2_time_limit_s: float
    max_v: int
    delta_s: int
    delta_n: int
    fixed_cost: str
    stage1_fixed: str
    ilp_min_gain: float

    @staticmethod
    def from_config(config: PlanConfig) -> HydraulisOptions:
        where = "policy 'hydraulis'"
        check_keys(config.extra, (*_DEFAULTS, "length_histogram"), where, word="option")
        kw = {k: config.extra.get(k, v) for k, v in _DEFAULTS.items()}
        for k in ("restarts", "node_limit", "max_v", "delta_s", "delta_n"):
            kw[k] = number(kw, k, where, integer=True, minimum=1)
        kw["ilp_min_gain"] = number(kw, "ilp_min_gain", where, minimum=0)
        if number(kw, "stage2_time_limit_s", where) <= 0:
            raise ValueError(f"{where}: 'stage2_time_limit_s' must be > 0, got {kw['stage2_time_limit_s']!r}")
        if kw["fixed_cost"] not in cands.FIXED_COST_MODES:
            raise ValueError(f"policy 'hydraulis': 'fixed_cost' must be one of {cands.FIXED_COST_MODES}")
        if kw["stage1_fixed"] not in ("packed", "none"):
            raise ValueError("policy 'hydraulis': 'stage1_fixed' must be 'packed' or 'none'")
        return HydraulisOptions(**kw)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def _load_candidates(path: str, mtime_ns: int, world_size: int, cost: CostModel) -> tuple[cands.Candidate, ...]:
    return tuple(cands.load(path, world_size, cost))


def candidate_list(items: BatchItems, cost: CostModel, config: PlanConfig, opts: HydraulisOptions
                   ) -> list[cands.Candidate]:
    """The candidates this step considers (see module docstring for the source order)."""
    if config.candidates:
        try:
            mtime = os.stat(config.candidates).st_mtime_ns
        except OSError as e:
            raise ValueError(f"cannot read candidates file {config.candidates}: {e.strerror}") from None
        return list(_load_candidates(config.candidates, mtime, config.world_size, cost))
    if "length_histogram" in config.extra:
        ln, w = cands.histogram_of(config.extra["length_histogram"])
    else:
        ln, w = np.asarray(items.lengths, dtype=np.int64), None
    return cands.generate(ln, w, cost, config.world_size, delta_s=opts.delta_s, delta_n=opts.delta_n,
                          fixed_cost=opts.fixed_cost)


@dataclass(kw_only=True, slots=True)
class _Trial:
    cand: cands.Candidate
    pipes: list[tuple[int, int]]  # [P] (tp, pp)
    assign: np.ndarray  # [n] pipeline per item
    packs: list[Packing]  # [P]
    lower: float
    shapes: list[ShapeCost]  # [P] each pipeline's coefficients (its class and speed on a cluster)

    @property
    def ms(self) -> float:
        return max((p.ms for p in self.packs), default=0.0)


def _pipeline_lower(work: np.ndarray, lengths: np.ndarray, cap: int, c: float, pp: int) -> float:
    """A lower bound on the pipeline's contract-2 time over every microbatch count it could use."""
    if len(work) == 0:
        return 0.0
    v_lo = max(1, -(-int(lengths.sum()) // cap))
    tw, wm = float(work.sum()), float(work.max())
    v = np.arange(v_lo, max(v_lo, len(work)) + 1, dtype=np.float64)
    return float((v * c + tw + (pp - 1) * (c + np.maximum(wm, tw / v))).min())


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    opts = HydraulisOptions.from_config(config)
    refuse_flags(config, "hydraulis", ("tp", "pp"), "it picks the pipelines' tp and pp per step; use policy "
                 "'pools' for a fixed layout, or drop the flag")
    if config.cp is not None and config.cp & (config.cp - 1):
        raise ValueError(f"policy 'hydraulis' cannot honour --cp {config.cp}: it must be a power of two (it caps "
                         f"the CP degree inside every pool of one shape)")
    shapes = cands.usable_shapes(cost, config.world_size)
    lengths = np.asarray(items.lengths, dtype=np.int64)
    longest = int(lengths.max()) if len(lengths) else 0
    holds = longest_segment(cost, config)
    if longest > holds:
        i = int(np.argmax(lengths))
        raise ValueError(f"policy 'hydraulis': doc {int(items.doc_ids[i])} ({longest} tokens) fits no shape: the "
                         f"most any shape holds is {holds} tokens (max_tokens_per_lane x its replicas' largest "
                         f"CP block); split long docs (long_docs: split) or add a shape")
    classic: StepPlan | None = None
    if longest <= max(sc.max_tokens_per_lane for sc in shapes):
        classic = _classic(items, cost, config, opts, step)
        if len(lengths) == 0:
            return classic
    best, best_ms, name = classic, step_ms(classic, cost) if classic is not None else np.inf, "pipelines"
    for cand in pooled_candidates(cost, config.world_size, classic):
        layout = [{"tp": tp, "pp": pp, "lanes": n} for tp, pp, n in cand.pipelines]
        try:
            plan = pools.plan_step(items, cost, PlanConfig(policy="pools", world_size=config.world_size, cp=config.cp,
                                                           seed=config.seed, extra={"pools": layout}), step)
        except ValueError:  # some doc fits none of this candidate's pools
            continue
        t = step_ms(plan, cost)
        if t < best_ms * (1 - 1e-9):
            best, best_ms, name = plan, t, f"pools {cand.label()} with CP inside"
    assert best is not None  # the shape that holds the longest doc gives a pooled candidate
    notes = [] if classic is None or best is classic else list(classic.notes)
    if name != "pipelines":
        notes.append(f"hydraulis: {name} kept ({best_ms:.1f} ms"
                     + (f"; one-lane pipelines {step_ms(classic, cost):.1f} ms)" if classic is not None else ")"))
    return best.with_timing(notes=tuple(notes))


def pooled_candidates(cost: CostModel, world: int, classic: StepPlan | None) -> list[cands.Candidate]:
    """Strategies planned as one pool per shape (its replicas the pool's lanes, hydra inside, so CP groups span
    replicas): every homogeneous shape that divides the world, then the classic plan's own strategy."""
    out = [cands.normalize({(sc.tp, sc.pp): world // sc.gpus}) for sc in cands.usable_shapes(cost, world)
           if world % sc.gpus == 0]
    if classic is not None:
        mine = cands.normalize([(p.tp, p.pp) for p in classic.pools])
        if mine not in out:
            out.append(mine)
    return out


def _classic(items: BatchItems, cost: CostModel, config: PlanConfig, opts: HydraulisOptions, step: int
             ) -> StepPlan:
    """Hydraulis as published: one-lane pipelines, docs dispatched to them and packed (module docstring)."""
    lengths = np.asarray(items.lengths, dtype=np.int64)
    notes: list[str] = []
    if len(lengths) == 0 and not config.candidates and "length_histogram" not in config.extra:
        empty = _homogeneous_for(0, cost, config.world_size, lengths)
        return _plan(step, config.world_size, empty.expand(), [[] for _ in empty.expand()], items)
    cand_list = candidate_list(items, cost, config, opts)
    longest = int(lengths.max()) if len(lengths) else 0
    usable = [c for c in cand_list if c.max_tokens(cost) >= longest]
    if not usable:
        fallback = _homogeneous_for(longest, cost, config.world_size, lengths)
        notes.append(f"hydraulis: no candidate holds the {longest}-token doc; added {fallback.label()}")
        usable = [fallback]
    if len(lengths) == 0:
        return _plan(step, config.world_size, usable[0].expand(), [[] for _ in usable[0].expand()], items)
    trials = [_stage1(c, lengths, cost, config, opts) for c in usable]
    # refine: best greedy first, only while the lower bound can still win, only the slowest pipeline
    trials.sort(key=lambda t: (t.ms, usable.index(t.cand)))
    best = trials[0].ms
    for t in trials:
        if t.lower >= best - 1e-9:
            continue
        refined: set[int] = set()
        while True:
            p = int(np.argmax([pk.ms for pk in t.packs]))
            if p in refined or t.packs[p].source == "empty":
                break
            refined.add(p)
            sc, pp = t.shapes[p], t.pipes[p][1]
            docs = np.flatnonzero(t.assign == p)
            work = np.asarray(sc.compute_ms(lengths[docs].astype(np.float64))) / pp
            packed = pack_pipeline(lengths[docs], work, sc.max_tokens_per_lane, sc.microbatch_ms / pp, pp,
                                   time_limit_s=opts.stage2_time_limit_s, node_limit=opts.node_limit,
                                   max_v=opts.max_v, use_ilp=True, min_gain=opts.ilp_min_gain)
            if packed.time_limit_hits:
                notes.append(f"hydraulis: stage-2 ILP time limit {opts.stage2_time_limit_s:g}s hit "
                             f"{packed.time_limit_hits}x ({t.cand.label()}, pipeline {p}); this plan depends "
                             f"on machine speed")
            for f in sorted(set(packed.failures)):
                notes.append(f"hydraulis: {f} ({t.cand.label()}, pipeline {p}); greedy packing kept")
            if packed.ms < t.packs[p].ms - 1e-9:
                t.packs[p] = packed
        best = min(best, t.ms)
    win = min(trials, key=lambda t: (t.ms, usable.index(t.cand)))
    bins = []
    for p, pk in enumerate(win.packs):
        docs = np.flatnonzero(win.assign == p)
        bins.append([[int(docs[i]) for i in b] for b in pk.bins])
    plan = _plan(step, config.world_size, win.pipes, bins, items)
    return plan.with_timing(notes=tuple(notes))


def _stage1(cand: cands.Candidate, lengths: np.ndarray, cost: CostModel, config: PlanConfig,
            opts: HydraulisOptions) -> _Trial:
    pipes = cand.expand()
    scs = pipe_shapes(cost, pipes, config.world_size)
    ln = lengths.astype(np.float64)
    work = np.stack([np.asarray(sc.compute_ms(ln)) / sc.pp for sc in scs], axis=1)  # [n, P] per-stage work
    s1 = work.copy()
    if opts.stage1_fixed == "packed":
        s1 += np.stack([sc.microbatch_ms / sc.pp * ln / sc.max_tokens_per_lane for sc in scs], axis=1)
    allowed = np.stack([lengths <= sc.max_tokens_per_lane for sc in scs], axis=1)  # [n, P]
    ppm1 = np.asarray([sc.pp - 1 for sc in scs], dtype=np.float64)
    assign, _ = dispatch(s1, allowed, ppm1, lengths, restarts=opts.restarts, seed=config.seed)
    packs, lower = [], 0.0
    for p, sc in enumerate(scs):
        docs = np.flatnonzero(assign == p)
        c = sc.microbatch_ms / sc.pp
        packs.append(pack_pipeline(lengths[docs], work[docs, p], sc.max_tokens_per_lane, c, sc.pp,
                                   time_limit_s=opts.stage2_time_limit_s, node_limit=opts.node_limit,
                                   max_v=opts.max_v, use_ilp=False))
        lower = max(lower, _pipeline_lower(work[docs, p], lengths[docs], sc.max_tokens_per_lane, c, sc.pp))
    return _Trial(cand=cand, pipes=pipes, assign=assign, packs=packs, lower=lower, shapes=scs)


def pipe_shapes(cost: CostModel, pipes: list[tuple[int, int]], world: int) -> list[ShapeCost]:
    """``[P]`` each pipeline's coefficients: the cost file's shape, or on a cluster whose lanes are not alike
    the shape of the pipeline's class with its times divided by its speed (pipelines take consecutive ranks,
    as :func:`_plan` lays them out)."""
    if cost.uniform:
        return [cost.shape(tp, pp) for tp, pp in pipes]
    out, offset = [], 0
    for tp, pp in pipes:
        out.append(cost.ranks_model(range(offset, offset + tp * pp), world).shape(tp, pp))
        offset += tp * pp
    return out


plan_step_cluster = plan_step  # pipelines take their class and speed in stage 1 and 2 (pipe_shapes)


def _homogeneous_for(longest: int, cost: CostModel, world: int, lengths: np.ndarray) -> cands.Candidate:
    """The homogeneous strategy of the shape that holds ``longest`` with the least total work per replica."""
    best: tuple[float, cands.Candidate] | None = None
    for sc in cands.usable_shapes(cost, world):
        if sc.max_tokens_per_lane < longest or world % sc.gpus:
            continue
        reps = world // sc.gpus
        w = np.asarray(sc.compute_ms(lengths.astype(np.float64))) / sc.pp
        ms = serial_pool_ms(np.array([w.sum() / reps]), sc.pp, sc.microbatch_ms / sc.pp)
        if best is None or ms < best[0]:
            best = (ms, cands.normalize({(sc.tp, sc.pp): reps}))
    if best is None:
        raise ValueError(f"policy 'hydraulis': no shape both holds a {longest}-token doc and divides the world "
                         f"size {world}")
    return best[1]


def _plan(step: int, world: int, pipes: list[tuple[int, int]], bins: list[list[list[int]]],
          items: BatchItems) -> StepPlan:
    pools, offset = [], 0
    for (tp, pp), mbs in zip(pipes, bins):
        g = tp * pp
        pools.append(Pool(tp=tp, pp=pp, ranks=single_pool_ranks(g, tp, pp, offset),
                          microbatches=tuple((Group(lanes=(0,), segments=tuple(items.segment(i) for i in b)),)
                                             for b in mbs)))
        offset += g
    assert offset == world
    return StepPlan(step=step, world_size=world, pools=tuple(pools))


# ---- what the loader and the runtime ask before planning ----------------------------------------


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """The largest lane cap times the largest aligned CP block of a shape's replicas (``cp`` when set)."""
    shapes = cands.usable_shapes(cost, config.world_size)
    return longest_on([(sc, config.world_size // sc.gpus) for sc in shapes], config.cp)


def pool_shapes(cost: CostModel, config: PlanConfig) -> dict[tuple[int, int], int]:
    """Every usable shape dividing the world, with all the world's replicas of it as lanes (one pool per shape
    with CP inside, or one-lane pipelines)."""
    return {(s.tp, s.pp): config.world_size // s.gpus for s in cost.shapes() if config.world_size % s.gpus == 0}


def fixed_pools(config: PlanConfig) -> None:
    """None: the pipelines change from step to step (a candidate per step)."""
    return None
