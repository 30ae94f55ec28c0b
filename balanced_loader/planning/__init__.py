"""Policy registry and the one entry point every caller uses: :func:`make_plan`.

A policy is a module in ``balanced_loader.planning.policies`` with a function
``plan_step(items, cost, config, step) -> StepPlan``. Planning is a pure function of
(items, cost, config): every rank can compute the same plan.

What the loader and the runtime need to know before the first plan comes from the policy too,
through optional module functions (one pool of shape ``(tp or 1, pp or 1)`` on aligned
power-of-two blocks when a policy does not define them), so that no caller names a policy:

* :func:`longest_segment` ``(cost, config) -> int``: the longest segment it can plan (the
  loader's default context limit);
* :func:`pool_shapes` ``(cost, config) -> {(tp, pp): lanes}``: every pool shape it may plan, with
  the most lanes a pool of that shape has (the runtime checks the model splits over them);
* :func:`fixed_pools` ``(config) -> tuple[Pool, ...] | None``: the rank grid of its pools when it
  is the same in every step (the runtime creates their groups up front), else ``None``.

On lanes that are not alike (contract 2's device classes and lane speeds) a policy plans through
``plan_step_cluster(items, cost, config, step)`` when it defines one (several pools), else one group of
alike lanes at a time (:mod:`balanced_loader.planning.speed_groups`); ``FIXED_DEGREE = True`` marks a
policy that runs every doc at one CP/SP degree.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, Pool, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import one_pool_layout, one_pool_longest_segment
from balanced_loader.planning.registry import POLICIES

__all__ = ["POLICIES", "BatchItems", "PlanConfig", "fixed_pools", "get_policy", "longest_segment", "make_plan",
           "policy_module", "pool_shapes", "warm_up"]


def policy_module(name: str) -> ModuleType:
    """The module of a policy (imported on first use: the CLI starts fast; numba loads only when needed)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    try:
        return importlib.import_module(f"balanced_loader.planning.policies.{POLICIES[name]}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("balanced_loader.planning.policies"):
            raise ValueError(f"policy '{name}' is not available in this build") from None
        raise


def get_policy(name: str):
    """The ``plan_step`` function of a policy."""
    return policy_module(name).plan_step


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """The longest segment ``config.policy`` can plan (0 when no shape it may use is usable); on lanes that
    are not alike, the longest that some group of alike lanes holds."""
    layout = fixed_pools(config) if not cost.uniform else None
    if layout is not None and len(layout) == 1:
        from balanced_loader.planning.speed_groups import speed_groups

        return max(g.capacity for g in speed_groups(cost, config, layout[0].ranks, layout[0].tp, _longest))
    return _longest(cost, config)


def _longest(cost: CostModel, config: PlanConfig) -> int:
    fn = getattr(policy_module(config.policy), "longest_segment", None)
    return fn(cost, config) if fn is not None else one_pool_longest_segment(cost, config)


def pool_shapes(cost: CostModel, config: PlanConfig) -> dict[tuple[int, int], int]:
    """Every ``(tp, pp)`` shape ``config.policy`` may plan, with the most lanes a pool of it has."""
    fn = getattr(policy_module(config.policy), "pool_shapes", None)
    if fn is not None:
        return fn(cost, config)
    tp, pp = config.tp or 1, config.pp or 1
    return {(tp, pp): config.world_size // (tp * pp)}


def fixed_pools(config: PlanConfig) -> tuple[Pool, ...] | None:
    """The pools (ranks, no microbatches) of every plan of ``config.policy``, or ``None`` when they vary."""
    fn = getattr(policy_module(config.policy), "fixed_pools", None)
    return fn(config) if fn is not None else one_pool_layout(config)


def make_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int = 0) -> StepPlan:
    """Plan one step with ``config.policy``; fills ``plan_seconds`` and ``predicted_ms``."""
    fn = get_policy(config.policy)
    t0 = time.perf_counter()
    if cost.uniform:
        plan = fn(items, cost, config, step)
        # a policy may offer its plan on other shapes too (hydra: lanes of tensor-parallel ranks), kept if faster
        shapes = getattr(policy_module(config.policy), "try_shapes", None)
        if shapes is not None:
            plan = shapes(items, cost, config, step, plan)
    else:
        plan = _plan_cluster(fn, items, cost, config, step)
    dt = time.perf_counter() - t0
    from balanced_loader.simulate import step_ms  # numba: loaded when a plan is made, not when the CLI starts

    return plan.with_timing(plan_seconds=dt, predicted_ms=step_ms(plan, cost))


def _plan_cluster(fn, items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    """A plan on lanes that are not alike (device classes, lane speeds): the policy's own
    ``plan_step_cluster`` when it has one (several pools), else one speed group at a time
    (:mod:`balanced_loader.planning.speed_groups`)."""
    module = policy_module(config.policy)
    own = getattr(module, "plan_step_cluster", None)
    if own is not None:
        return own(items, cost, config, step)
    layout = fixed_pools(config)
    if layout is None or len(layout) != 1:
        raise ValueError(f"policy '{config.policy}' cannot plan for device classes or lane speeds")
    from balanced_loader.planning.speed_groups import plan_one_pool

    return plan_one_pool(fn, items, cost, config, step, layout[0], _longest,
                         fixed_degree=getattr(module, "FIXED_DEGREE", False))


def warm_up(batches: Sequence[BatchItems], cost: CostModel, configs: Sequence[PlanConfig]) -> None:
    """Load each policy and compile its kernels on a one-sequence batch, so ``plan_seconds`` is the
    step's own work. A failure here is left for the real step to report."""
    from balanced_loader.planning.packing import warm_up as warm_kernels

    warm_kernels()
    first = next((b for b in batches if len(b)), None)
    if first is None:
        return
    i = int(np.argmin(first.lengths))
    one = BatchItems(doc_ids=first.doc_ids[i:i + 1], starts=first.starts[i:i + 1], lengths=first.lengths[i:i + 1])
    for c in configs:
        with contextlib.suppress(ValueError):
            make_plan(one, cost, c)
