"""``flexsp``: FlexSP's heterogeneous sequence-parallel groups per microbatch (papers/flexsp.md).

One pool of shape ``(config.tp or 1, config.pp or 1)`` over the whole world. The sequence
blaster sorts the batch longest first and cuts it into ``M`` contiguous microbatches with the
smallest largest token sum (min-max chunking DP), for ``M`` from ``ceil(tokens / cluster
capacity)`` (raised until every chunk fits) over ``num_m`` values. Each microbatch starts from
the best homogeneous greedy plan; where its lower bound leaves room, FlexSP's bucketed MILP
(HiGHS; :mod:`balanced_loader.planning.solvers.sp_milp`: the per-slot model when small, else the same
model aggregated over identical slots with a bisected makespan) replaces it if faster after
decoding to real docs and re-costing. ``M`` values whose summed lower bounds cannot beat the
best greedy total get no MILP. The step is assembled for contract 2 (lanes run ahead across
microbatches): groups go on aligned lane blocks by earliest free time, 1-lane groups may be
re-dealt by their lanes' finish times, and the fastest of (M, MILP or greedy microbatches,
order) by contract-2 time wins, so the result is never slower than the greedy plan. The re-deal is
also tried with up to two 1-lane groups per lane and microbatch: a lane free early takes a second
group of short docs that a late lane would otherwise hold. Last, hydra's plan (with ``min_degree: 1``) and
BatchAda's on the same pool compete with the result (contract-2 time, ties keep FlexSP's; a note names the
winner): flexsp is never behind either of them. Where ``tp`` is free, :func:`try_shapes` (``make_plan``'s hook)
compares hydra's plan on lanes of tensor-parallel ranks too, so flexsp is never behind hydra as ``make_plan``
gives it.

Knobs (``PlanConfig.extra``): ``min_degree`` (default 1), ``num_m`` (5), ``node_limit`` (50),
``rel_gap`` (0.002), ``buckets`` (16), ``max_solves`` (12 HiGHS solves per step: under 2 s of planning at 64 lanes),
``exact_vars`` (64: FlexSP's per-slot MILP when it has at most this many assignment variables,
else the aggregated one), ``bisect_steps`` (6 per microbatch), ``bisect_tol`` (0.005: stop bisecting
when the makespan bracket is that tight); each solve's wall-clock safety limit is
``PlanConfig.time_limit_s`` (1 s).

**1-lane groups are allowed** (``min_degree: 1``). FlexSP's code skips ``d = 1`` while its
paper's runs use ``<1 x 64>`` microbatches; measured on the FlexSP GPT-7B setting (64 lanes,
Wikipedia, docs/results/planners.md) 1-lane groups make the plan faster (short docs skip
the all-to-all), so they are the default; ``min_degree: 2`` reproduces the code.

Determinism: the plan is a pure function of (items, cost, config) unless the MILP's
wall-clock limit ends a search (each search is bounded first by a deterministic node
limit); such a hit, and any solver failure with its greedy fallback, is recorded in
``StepPlan.notes``. Which ``M`` get a MILP is decided by lower bounds and a deterministic
solve budget (``max_solves``), never by elapsed time.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, Group, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import check_fits, one_pool_plan, pool_setup, sp_degrees
from balanced_loader.planning.solvers.sp_plan import FlexSPOptions, plan_microbatches, pool_time

__all__ = ["FlexSPOptions", "plan_microbatches", "plan_step", "pool_time", "try_shapes"]


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    opts = FlexSPOptions.from_config(config)
    setup = pool_setup(items, cost, config, "flexsp")
    tp, pp, sc, num_lanes = setup.tp, setup.pp, setup.shape, setup.lanes
    degrees = sp_degrees(config, num_lanes, opts.min_degree, "flexsp")
    lengths = np.asarray(items.lengths, dtype=np.int64)
    check_fits(items, sc.max_tokens_per_lane, degrees[-1], "flexsp")
    if len(items) == 0:
        return one_pool_plan(step, config.world_size, tp, pp, ())
    mbs, lanes, notes = plan_microbatches(lengths, sc, num_lanes, opts, pp, degrees[-1])
    microbatches = tuple(
        tuple(Group(lanes=ln, segments=tuple(items.segment(i) for i in g.docs)) for g, ln in zip(groups, placed))
        for groups, placed in zip(mbs, lanes))
    plan = one_pool_plan(step, config.world_size, tp, pp, microbatches)
    plan, chose = _never_behind(plan, items, cost, config, opts, step)
    return plan.with_timing(notes=(*notes, *chose))


def _never_behind(plan: StepPlan, items: BatchItems, cost: CostModel, config: PlanConfig, opts: FlexSPOptions,
                  step: int) -> tuple[StepPlan, tuple[str, ...]]:
    """The fastest by contract 2 of FlexSP's plan, hydra's and BatchAda's on the same pool (their groups are
    aligned power-of-two blocks within ``cp`` too; hydra's only when 1-lane groups are allowed): flexsp is
    never behind them. Returns the plan and a note when another one wins (ties keep FlexSP's)."""
    from balanced_loader.planning.policies import batch_ada, hydra
    from balanced_loader.simulate import step_ms

    best, best_ms, name = plan, step_ms(plan, cost), "flexsp"
    others = [("batch-ada", batch_ada, {"min_degree": opts.min_degree})]
    if opts.min_degree == 1:
        others.insert(0, ("hydra", hydra, {}))
    for other, module, extra in others:
        cand = module.plan_step(items, cost, replace(config, policy=other, extra=extra), step)
        t = step_ms(cand, cost)
        if t < best_ms * (1 - 1e-9):
            best, best_ms, name = cand, t, other
    if name == "flexsp":
        return plan, ()
    return best.with_timing(notes=()), (f"flexsp: {name}'s plan kept ({best_ms:.1f} ms; FlexSP's own "
                                        f"{step_ms(plan, cost):.1f} ms)",)


def try_shapes(items: BatchItems, cost: CostModel, config: PlanConfig, step: int, plan: StepPlan) -> StepPlan:
    """``plan`` (flexsp's, on one-rank lanes), or hydra's plan on lanes of 2, 4, .. tensor-parallel ranks where
    that is faster (:func:`balanced_loader.planning.policies.hydra.tp_lanes_plan`: the plan needs CP, ``tp`` and
    ``pp`` are free; ``make_plan`` calls this only on one top-level pool of alike lanes). Only where hydra's plan
    competes at all (``min_degree: 1``)."""
    from balanced_loader.planning.policies import hydra

    if FlexSPOptions.from_config(config).min_degree != 1:
        return plan
    best, ms, own = hydra.tp_lanes_plan(items, cost, replace(config, extra={}), step, plan)
    if best is plan:
        return plan
    return best.with_timing(notes=(*best.notes, f"flexsp: hydra's plan on lanes of tp {best.pools[0].tp} kept "
                                                f"({ms:.1f} ms; on one-rank lanes {own:.1f} ms)"))
