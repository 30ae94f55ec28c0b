r"""``pools``: a fixed heterogeneous layout of pools, docs balanced across them, hydra inside each.

The layout comes from ``PlanConfig.extra["pools"]``, a list of ``{tp, pp, lanes}`` (for example
``[{tp: 1, pp: 2, lanes: 1}, {tp: 1, pp: 1, lanes: 2}]``); pools take consecutive rank ranges
in that order (:func:`~balanced_loader.plan.single_pool_ranks`: TP inside a node, stage-major),
and together they must cover the world. Every shape must be usable in the cost file.

Per step:

1. **Across pools** (cost-weighted LPT): items longest first; each goes to the pool, among
   those that can hold it (``max_tokens_per_lane`` x the pool's largest aligned block), whose
   estimated time after adding it is smallest (ties: the earlier pool). A pool's estimate is
   ``max(area, critical) + (pp - 1) * g_max / pp`` with ``area`` = the lane time of its items
   at their memory-fit degrees (work, CP communication, ``microbatch_ms`` per group and per
   ``cap`` tokens of one-lane items) over ``lanes * pp``, ``critical`` = the longest item's group
   time over ``pp`` and ``g_max`` the largest group time (pipeline fill and drain, contract 2).
2. **Inside a pool**: the pool's items are planned by ``hydra`` on the pool's shape and lanes
   (closed-form load target, load-driven CP degrees on aligned lane blocks, passes per lane).

Deterministic given (items, cost, config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, allowed_degrees
from balanced_loader.plan import BatchItems, Pool, StepPlan, single_pool_ranks
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies import hydra
from balanced_loader.planning.policies.common import longest_on, one_pool_longest_segment, refuse_flags
from balanced_loader.strict import check_keys, number

_POOL_KEYS = ("tp", "pp", "lanes")


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolSpec:
    """One pool of the fixed layout: shape, lanes and first rank."""

    tp: int
    pp: int
    lanes: int
    offset: int  # first rank of the pool

    @property
    def num_ranks(self) -> int:
        return self.tp * self.pp * self.lanes


def pool_specs(config: PlanConfig) -> list[PoolSpec]:
    """The validated layout of ``config.extra["pools"]`` (one ValueError naming the entry)."""
    check_keys(config.extra, ("pools",), "policy 'pools'", word="option")
    raw = config.extra.get("pools")
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError("policy 'pools' needs extra.pools: a list of {tp, pp, lanes}, e.g. "
                         "[{tp: 1, pp: 2, lanes: 1}, {tp: 1, pp: 1, lanes: 2}]")
    out: list[PoolSpec] = []
    offset = 0
    for i, p in enumerate(raw):
        where = f"policy 'pools': extra.pools[{i}]"
        if not isinstance(p, dict):
            raise ValueError(f"{where}: expected a mapping {{tp, pp, lanes}}, got {p!r}")
        check_keys(p, _POOL_KEYS, where)
        vals = {k: number(p, k, where, integer=True, minimum=1, default=1) for k in _POOL_KEYS}
        spec = PoolSpec(offset=offset, **vals)
        out.append(spec)
        offset += spec.num_ranks
    if offset != config.world_size:
        sizes = " + ".join(str(s.num_ranks) for s in out)
        raise ValueError(f"policy 'pools': extra.pools hold {sizes} = {offset} ranks (tp*pp*lanes each) "
                         f"but the world has {config.world_size}; make them add up")
    return out


def _shape(cost: CostModel, spec: PoolSpec, i: int) -> ShapeCost:
    sc = cost.shape(spec.tp, spec.pp)
    if not sc.usable:
        raise ValueError(f"policy 'pools': extra.pools[{i}] shape tp={spec.tp}, pp={spec.pp} is marked "
                         f"unusable in the cost file (max_tokens_per_lane: 0)")
    return sc


class _PoolLoad:
    """Running time estimate of one pool while items are assigned (module docstring). On lanes that are not
    alike, ``sc`` is the pool's slowest class and ``lanes`` its lane count weighted by speed."""

    def __init__(self, sc: ShapeCost, spec: PoolSpec, max_degree: int | None = None, lanes: float | None = None
                 ) -> None:
        self.sc, self.spec = sc, spec
        self.lanes = float(spec.lanes) if lanes is None else lanes
        self.degrees = [d for d in allowed_degrees(spec.lanes) if max_degree is None or d <= max_degree]
        self.capacity = sc.max_tokens_per_lane * self.degrees[-1]
        self.lane_ms = 0.0  # lane time of items at degree > 1 plus work of one-lane items
        self.short_tokens = 0
        self.g_max = 0.0

    def _item(self, s: int) -> tuple[float, float, bool]:
        """(lane ms, group ms, one-lane) of an item of ``s`` tokens at its memory-fit degree."""
        sc = self.sc
        d = next(x for x in self.degrees if s <= sc.max_tokens_per_lane * x)
        g = sc.group_ms([s], d)
        if d == 1:
            return float(sc.compute_ms(s)), g, True
        return d * g, g, False

    def estimate(self, s: int | None = None) -> float:
        lane_ms, short, g_max = self.lane_ms, self.short_tokens, self.g_max
        if s is not None:
            add, g, one = self._item(s)
            lane_ms += add
            short += s if one else 0
            g_max = max(g_max, g)
        if g_max == 0.0:
            return 0.0
        pp, sc = self.spec.pp, self.sc
        passes = -(-short // sc.max_tokens_per_lane)
        area = (lane_ms + sc.microbatch_ms * passes) / (self.lanes * pp)
        return max(area, g_max / pp) + (pp - 1) * g_max / pp

    def add(self, s: int) -> None:
        add, g, one = self._item(s)
        self.lane_ms += add
        self.short_tokens += s if one else 0
        self.g_max = max(self.g_max, g)


def _cluster_load(cost: CostModel, spec: PoolSpec, i: int, max_degree: int | None, world: int) -> _PoolLoad:
    """A pool's estimate on lanes that are not alike: the slowest lane's model (its class and speed) and
    the pool's lanes weighted by their speed relative to it (caps: the smallest class's)."""
    _shape(cost, spec, i)
    prof = cost.lanes(single_pool_ranks(spec.num_ranks, spec.tp, spec.pp, spec.offset), spec.tp, world)
    models = prof.lane_models()
    unit = [m.shape(spec.tp, spec.pp).compute_ms(1024.0) for m in models]  # [lanes] ms of a 1,024-token doc
    slow = int(np.argmax(unit))
    return _PoolLoad(models[slow].shape(spec.tp, spec.pp), spec, max_degree, lanes=sum(unit[slow] / u for u in unit))


def assign(items: BatchItems, cost: CostModel, specs: list[PoolSpec], max_degree: int | None = None,
           world: int | None = None) -> np.ndarray:
    """``[n]`` pool index of every item (step 1 of the module docstring); CP degrees up to ``max_degree``
    (``world``: the world size, for lanes that are not alike)."""
    if cost.uniform or world is None:
        loads = [_PoolLoad(_shape(cost, s, i), s, max_degree) for i, s in enumerate(specs)]
    else:
        loads = [_cluster_load(cost, s, i, max_degree, world) for i, s in enumerate(specs)]
    pool_of = np.zeros(len(items), dtype=np.int64)
    for i in np.argsort(-items.lengths, kind="stable"):
        s = int(items.lengths[i])
        best, best_t = -1, 0.0
        for p, load in enumerate(loads):
            if s > load.capacity:
                continue
            t = load.estimate(s)
            if best < 0 or t < best_t:
                best, best_t = p, t
        if best < 0:
            largest = max(ld.capacity for ld in loads)
            raise ValueError(f"policy 'pools': doc {int(items.doc_ids[i])} ({s} tokens) fits no pool: the "
                             f"largest holds {largest} tokens (max_tokens_per_lane x largest CP block); "
                             f"split long docs (long_docs: split) or add lanes")
        loads[best].add(s)
        pool_of[i] = best
    return pool_of


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    refuse_flags(config, "pools", ("tp", "pp"), "the shapes come from extra.pools ({tp, pp, lanes} per pool)")
    specs = pool_specs(config)
    if config.cp is not None and config.cp & (config.cp - 1):
        raise ValueError(f"policy 'pools' cannot honour --cp {config.cp}: it must be a power of two (it caps "
                         f"the CP degree in every pool)")
    cluster = not cost.uniform
    pool_of = assign(items, cost, specs, config.cp, config.world_size if cluster else None)
    pools = []
    for p, spec in enumerate(specs):
        idx = np.flatnonzero(pool_of == p)
        sub = BatchItems(doc_ids=items.doc_ids[idx], starts=items.starts[idx], lengths=items.lengths[idx])
        layout = Pool(tp=spec.tp, pp=spec.pp, ranks=single_pool_ranks(spec.num_ranks, spec.tp, spec.pp, spec.offset),
                      microbatches=())
        if len(sub):
            cp = None if config.cp is None else min(config.cp, 1 << (spec.lanes.bit_length() - 1))
            inner = PlanConfig(policy="hydra", world_size=spec.num_ranks, tp=spec.tp, pp=spec.pp, cp=cp,
                               seed=config.seed)
            if cluster:  # hydra on each group of alike lanes of the pool (planning.speed_groups)
                from balanced_loader.planning.speed_groups import plan_pool

                layout, _ = plan_pool(hydra.plan_step, sub, cost, inner, step, layout, hydra_longest,
                                      world_size=config.world_size)
            else:
                layout = replace(layout, microbatches=hydra.plan_step(sub, cost, inner, step).pools[0].microbatches)
        pools.append(layout)
    return StepPlan(step=step, world_size=config.world_size, pools=tuple(pools))


plan_step_cluster = plan_step  # classes and lane speeds are handled above (across pools, and inside each)


def hydra_longest(cost: CostModel, config: PlanConfig) -> int:
    return one_pool_longest_segment(cost, config)


# ---- what the loader and the runtime ask before planning ----------------------------------------


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """The layout's pools on aligned power-of-two blocks (``cp`` when set); a layout that does not
    parse leaves its error to the first plan and counts as one pool of the configured shape."""
    try:
        specs = pool_specs(config)
    except ValueError:
        return one_pool_longest_segment(cost, config)
    return longest_on([(cost.shape(s.tp, s.pp), s.lanes) for s in specs], config.cp)


def pool_shapes(cost: CostModel, config: PlanConfig) -> dict[tuple[int, int], int]:
    """The layout's shapes, each with its largest pool's lanes."""
    out: dict[tuple[int, int], int] = {}
    for s in pool_specs(config):
        out[(s.tp, s.pp)] = max(out.get((s.tp, s.pp), 0), s.lanes)
    return out


def fixed_pools(config: PlanConfig) -> tuple[Pool, ...]:
    """The layout (ranks per pool, no microbatches): the same in every step."""
    return tuple(Pool(tp=s.tp, pp=s.pp, ranks=single_pool_ranks(s.num_ranks, s.tp, s.pp, s.offset), microbatches=())
                 for s in pool_specs(config))
