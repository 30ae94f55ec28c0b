r"""Plan a pool whose lanes are not alike (device classes, lane speeds): one speed group at a time.

Contract 2 times a group by its slowest lane (its class's formula divided by its speed). A CP group
that mixes a fast and a slow lane runs at the slow one's pace, so lanes are first split into **speed
groups**, the lanes with one (class, speed); a single-lane-degree policy (``cp``) splits in blocks of
``cp`` lanes. Then:

1. **Split the batch** across the speed groups (:func:`split_items`, the LPT kernel in
   :mod:`balanced_loader.planning.kernels.split`): one load target for every lane, group ``g``'s lanes
   finishing together when it gets ``T * lanes_g`` lane-time *in its own speed*; items longest first to
   the group that would finish first with them, only to groups that can hold them (the policy's
   longest segment on that group's lanes and class).
2. **Plan each group** with the policy itself, on its lanes and its class's coefficients divided by its
   speed (a uniform sub-world: every policy's own balancing applies inside: hydra's load target, the KK
   partitions, FlexSP's SP groups, Megatron's rounds).
3. **Correct and keep the best**: the estimate misses the granularity of passes and groups, so each
   group's planned time is compared with its estimate and the split is redone with that ratio
   (:data:`RETRIES` times at most, while the groups differ by more than :data:`SLACK`); the plan with
   the smallest contract-2 step time (lanes timed by their class and speed) wins, also against the
   policy's plan of the whole pool as if every lane were the slowest (a policy whose rounds and
   barriers span the pool, Megatron-Core's, can lose more to aligned rounds than it gains).

The groups' microbatches are merged by index (their lanes are disjoint, so each lane keeps its
order); barriers of the groups are merged too. With one speed group this is the policy's own plan
on the group's (scaled) coefficients: the same groups and order as for alike lanes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from balanced_loader.cost import CostModel, fit_levels, slowest
from balanced_loader.plan import BatchItems, Group, Pool, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import fixed_degree

RETRIES = 2  # re-splits after the first plan
SLACK = 0.03  # groups' planned times within 3% of each other: no re-split

PlanFn = Callable[[BatchItems, CostModel, PlanConfig, int], StepPlan]


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedGroup:
    """Lanes of one pool with one device class and one speed."""

    lanes: tuple[int, ...]  # [n] lane indices in the pool, ascending
    model: CostModel  # the class's uniform model, times divided by the speed
    config: PlanConfig  # the policy's config on a world of just these lanes
    capacity: int  # the longest item the policy can plan on them


def speed_groups(cost: CostModel, config: PlanConfig, ranks: Sequence[Sequence[int]], tp: int,
                 longest: Callable[[CostModel, PlanConfig], int], world_size: int | None = None, *,
                 unit: int | None = None) -> list[SpeedGroup]:
    """The speed groups of a pool with rank grid ``ranks`` (``[pp][lanes * tp]``), in lane order
    (``world_size``: the plan's, when ``config`` is a pool's own sub-world; ``unit``: lanes kept whole
    in blocks, default the fixed CP degree or 1)."""
    world = world_size or config.world_size
    pp = len(ranks)
    unit = unit or config.cp or 1  # a fixed CP degree keeps its aligned blocks whole
    nl = len(ranks[0]) // tp if len(ranks) else 0
    if nl % unit:
        raise ValueError(f"cp {unit} does not divide the {nl} lanes of the pool")
    # each block of unit lanes as one lane of contract 2: its slowest speed, and a block of several classes
    # the slowest keys of them (a mixed class of its own)
    blocks = cost.lanes(ranks, tp * unit, world)
    keys = list(zip(blocks.cls.tolist(), blocks.speed.tolist()))  # [nl // unit] (class, speed)
    out = []
    runs = aligned_runs(keys)
    # a time-limited solver (flexsp, hydraulis) gets the pool's budget shared over the groups, so a step
    # plans in about the time it would on alike lanes
    config = replace(config, time_limit_s=max(0.05, config.time_limit_s / len(runs)))
    for first, size in runs:
        c, v = keys[first]
        lanes = list(range(first * unit, (first + size) * unit))
        model = blocks.models[c].scaled(1.0 / v)
        top = 1 << (len(lanes).bit_length() - 1)  # the largest aligned block of these lanes
        cp = None if config.cp is None else min(config.cp, top)
        sub = replace(config, world_size=len(lanes) * tp * pp, cp=cp)  # solver time limits: see speed_groups()
        out.append(SpeedGroup(lanes=tuple(lanes), model=model, config=sub, capacity=longest(model, sub)))
    return out


def aligned_runs(keys: Sequence[object]) -> list[tuple[int, int]]:
    """``(first, size)`` blocks covering ``0 .. len(keys) - 1``: each the largest aligned power-of-two block
    (``first % size == 0``) whose keys are all equal (a buddy decomposition). Why: the policies place CP
    groups on aligned power-of-two blocks of their lanes, so a group of 7 alike lanes would leave some idle."""
    out, i, n = [], 0, len(keys)
    while i < n:
        size = i & -i if i else 1 << (n.bit_length() - 1)  # the largest alignment of position i
        while size > 1 and (i + size > n or any(keys[j] != keys[i] for j in range(i, i + size))):
            size //= 2
        out.append((i, size))
        i += size
    return out


def groups_holding(cost: CostModel, config: PlanConfig, pool: Pool, longest: Callable[[CostModel, PlanConfig], int],
                   world: int, need: int) -> list[SpeedGroup]:
    """The speed groups of ``pool``, coarsened until one holds an item of ``need`` tokens: blocks of 2, 4, ...
    lanes, each as slow as its slowest lane, at last the whole pool as one group. Why: a slow lane cuts the
    aligned blocks of alike lanes, so a doc the pool holds (the loader's ``max_seq_len``) may fit none."""
    unit, nl = config.cp or 1, pool.num_lanes
    while True:
        groups = speed_groups(cost, config, pool.ranks, pool.tp, longest, world, unit=unit)
        if need <= max(g.capacity for g in groups) or unit >= nl:
            return groups
        unit = unit * 2 if nl % (unit * 2) == 0 else nl


def item_estimates(items: BatchItems, group: SpeedGroup, tp: int, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """``([n] lane-ms, [n] group ms)`` of every item on ``group`` at its memory-fit degree (``microbatch_ms``
    per ``cap`` tokens for one-lane items, whose passes are shared)."""
    sc = group.model.shape(tp, pp)
    s = items.lengths.astype(np.float64)
    d = np.left_shift(1, fit_levels(items.lengths, max(sc.max_tokens_per_lane, 1))).astype(np.float64)  # [n]
    d = np.minimum(d, max(len(group.lanes), 1))
    f = np.asarray(sc.compute_ms(s))
    comm = np.asarray(sc.comm_ms(s, d))
    g = sc.microbatch_ms + f / d + comm  # [n] group time alone
    area = np.where(d > 1, d * g, f + sc.microbatch_ms * s / max(sc.max_tokens_per_lane, 1))
    return area, g


def split_items(items: BatchItems, groups: Sequence[SpeedGroup], tp: int, pp: int,
                factor: np.ndarray | None = None) -> np.ndarray:
    """``[n]`` speed group of every item (module docstring, step 1); ``factor`` ``[groups]`` corrects each
    group's estimates (planned / estimated time of a previous try)."""
    from balanced_loader.planning.kernels.split import split_kernel  # numba: loaded when a cluster plans

    k = len(groups)
    est = [item_estimates(items, g, tp, pp) for g in groups]
    fac = np.ones(k) if factor is None else factor
    area = np.ascontiguousarray(np.stack([a for a, _ in est], axis=1) * fac[None, :])  # [n, k]
    crit = np.ascontiguousarray(np.stack([c for _, c in est], axis=1) * fac[None, :])  # [n, k]
    allowed = np.stack([items.lengths <= g.capacity for g in groups], axis=1)  # [n, k]
    order = np.argsort(-area.min(axis=1), kind="stable").astype(np.int64)  # largest first
    lanes = np.asarray([float(len(g.lanes)) for g in groups])
    out = split_kernel(order, area, crit, allowed, lanes)
    if len(out) and out.min() < 0:
        i = int(np.flatnonzero(out < 0)[0])
        best = max(g.capacity for g in groups)
        raise ValueError(f"doc {int(items.doc_ids[i])} ({int(items.lengths[i])} tokens) fits no group of alike "
                         f"lanes: the largest holds {best} tokens; split long docs (long_docs: split) or "
                         f"use a larger --cp")
    return out


def _sub(items: BatchItems, idx: np.ndarray) -> BatchItems:
    return BatchItems(doc_ids=items.doc_ids[idx], starts=items.starts[idx], lengths=items.lengths[idx])


def _rounds(p: Pool) -> list[tuple[tuple[Group, ...], ...]]:
    """A pool's microbatches cut at its barriers (Megatron's rounds; one round without barriers)."""
    edges = [0, *p.barriers, len(p.microbatches)]
    return [p.microbatches[a:b] for a, b in zip(edges, edges[1:])]


def merge(pool: Pool, parts: Sequence[tuple[SpeedGroup, Pool]]) -> Pool:
    """One pool from the groups' plans, lanes mapped back: round r of every group starts at one microbatch
    (after the longest round r - 1 of any group), and a barrier before each round but the first when the
    groups' plans have barriers; without barriers, microbatch k holds every group's microbatch k."""
    rounds = [_rounds(p) for _, p in parts]
    micro: list[list[Group]] = []
    barriers: list[int] = []
    for r in range(max((len(x) for x in rounds), default=0)):
        if r:
            barriers.append(len(micro))
        width = max((len(x[r]) for x in rounds if r < len(x)), default=0)
        base = len(micro)
        micro.extend([] for _ in range(width))
        for (g, _), rs in zip(parts, rounds):
            for j, mb in enumerate(rs[r] if r < len(rs) else ()):
                micro[base + j].extend(Group(lanes=tuple(g.lanes[x] for x in grp.lanes), segments=grp.segments)
                                       for grp in mb)
    keep = [k for k, m in enumerate(micro) if m]  # a round's padding indices hold nothing: drop them
    index = {k: i for i, k in enumerate(keep)}
    bars = sorted({index[min(k for k in keep if k >= b)] for b in barriers if any(k >= b for k in keep)} - {0})
    return replace(pool, microbatches=tuple(tuple(micro[k]) for k in keep), barriers=tuple(bars))


def _fixed_degree(items: BatchItems, cost: CostModel, pool: Pool, world_size: int) -> int:
    """A fixed-degree policy's CP/SP degree for the pool: the smallest power of two whose lanes (the smallest
    cap of any class) hold the longest item, at most the largest power of two dividing the lanes."""
    caps = cost.pool_lane_caps(pool.tp, pool.pp, pool.ranks, world_size)
    cap = int(caps.min()) if caps is not None and len(caps) else cost.lane_cap(pool.tp, pool.pp)
    return fixed_degree(items, pool.num_lanes, max(cap, 1))


def plan_pool(fn: PlanFn, items: BatchItems, cost: CostModel, config: PlanConfig, step: int, pool: Pool,
              longest: Callable[[CostModel, PlanConfig], int], *, fixed_degree: bool = False,
              world_size: int | None = None) -> tuple[Pool, tuple[str, ...]]:
    """The microbatches of one pool (its rank grid ``pool.ranks``) planned by ``fn`` on lanes that are not
    alike (module docstring); also the groups' notes. ``fixed_degree``: the policy runs every doc at one
    CP/SP degree (static trainers, verl): it is fixed for the whole pool first, and groups are its blocks.
    ``world_size``: the plan's, when ``config`` is the pool's own sub-world (several pools)."""
    from balanced_loader.simulate import pool_ms, step_ms  # numba: loaded when a plan is made

    world = world_size or config.world_size
    if fixed_degree and config.cp is None:  # the degree the policy would take for the whole pool, fixed first
        config = replace(config, cp=_fixed_degree(items, cost, pool, world))
    groups = groups_holding(cost, config, pool, longest, world, int(items.lengths.max(initial=0)))
    if len(groups) == 1:
        sub = fn(items, groups[0].model, groups[0].config, step)
        return merge(pool, [(groups[0], sub.pools[0])]), sub.notes
    best: tuple[float, Pool, tuple[str, ...]] | None = None
    factor = np.ones(len(groups))
    for _ in range(RETRIES + 1):
        where = split_items(items, groups, pool.tp, pool.pp, factor)
        parts, notes, planned, est = [], [], np.zeros(len(groups)), np.zeros(len(groups))
        for gi, g in enumerate(groups):
            idx = np.flatnonzero(where == gi)
            sub = fn(_sub(items, idx), g.model, g.config, step)
            parts.append((g, sub.pools[0]))
            notes.extend(sub.notes)
            planned[gi] = step_ms(sub, g.model)
            area, crit = item_estimates(_sub(items, idx), g, pool.tp, pool.pp)
            est[gi] = max(float(area.sum()) / len(g.lanes), float(crit.max(initial=0.0))) / pool.pp
        merged = merge(pool, parts)
        t = pool_ms(merged, cost, world)
        if best is None or t < best[0]:
            best = (t, merged, tuple(notes))
        busy = planned[planned > 0]
        if len(busy) < 2 or busy.max() <= busy.min() * (1 + SLACK):
            break
        factor = factor * np.where((est > 0) & (planned > 0), planned / np.maximum(est, 1e-12), 1.0)
    assert best is not None
    # the safety net: the policy on the whole pool as if its lanes were all the slowest (every cap holds);
    # a policy whose own structure spans the pool (Megatron's rounds and barriers) may do better that way
    blind = _blind(fn, items, cost, config, step, pool, world)
    if blind is not None and pool_ms(blind[0], cost, world) < best[0]:
        return blind
    return best[1], best[2]


def _blind(fn: PlanFn, items: BatchItems, cost: CostModel, config: PlanConfig, step: int, pool: Pool,
           world: int) -> tuple[Pool, tuple[str, ...]] | None:
    """The policy's plan of the whole pool on the key-by-key slowest of its lanes' models (None: it cannot)."""
    models = cost.lanes(pool.ranks, pool.tp, world).lane_models()
    worst = models[0] if len(models) == 1 else slowest(models)
    sub = replace(config, world_size=pool.num_lanes * pool.tp * pool.pp)
    try:
        plan = fn(items, worst, sub, step)
    except ValueError:
        return None
    return replace(pool, microbatches=plan.pools[0].microbatches, barriers=plan.pools[0].barriers), plan.notes


def plan_one_pool(fn: PlanFn, items: BatchItems, cost: CostModel, config: PlanConfig, step: int, layout: Pool,
                  longest: Callable[[CostModel, PlanConfig], int], *, fixed_degree: bool = False) -> StepPlan:
    """A one-pool policy's plan on a cluster whose lanes are not alike (module docstring)."""
    pool, notes = plan_pool(fn, items, cost, config, step, layout, longest, fixed_degree=fixed_degree)
    return StepPlan(step=step, world_size=config.world_size, pools=(pool,), notes=notes)
