"""Policy registry and the one entry point every caller uses: :func:`make_plan`.

A policy is a module in ``balanced_loader.planning.policies`` with a function
``plan_step(items, cost, config, step) -> StepPlan``. Planning is a pure function of
(items, cost, config): every rank can compute the same plan.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Sequence

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.registry import POLICIES

__all__ = ["POLICIES", "BatchItems", "PlanConfig", "get_policy", "make_plan", "warm_up"]



def get_policy(name: str):
    """The ``plan_step`` function of a policy."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    try:
        mod = importlib.import_module(f"balanced_loader.planning.policies.{POLICIES[name]}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("balanced_loader.planning.policies"):
            raise ValueError(f"policy '{name}' is not available in this build") from None
        raise
    return mod.plan_step


def make_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int = 0) -> StepPlan:
    """Plan one step with ``config.policy``; fills ``plan_seconds`` and ``predicted_ms``."""
    fn = get_policy(config.policy)
    t0 = time.perf_counter()
    plan = fn(items, cost, config, step)
    dt = time.perf_counter() - t0
    from balanced_loader.simulate import step_ms  # vectorised contract-2 step time (equals cost.step_ms)

    return plan.with_timing(plan_seconds=dt, predicted_ms=step_ms(plan, cost))


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
