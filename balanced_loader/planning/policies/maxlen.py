"""``maxlen``: Megatron static (fixed ``--tp/--pp/--cp``, max-length packing).

The pool shape is ``(tp, pp)`` from the cost file (``cost.shape(tp, pp)``; a shape not listed
under ``strategies`` is an error). CP defaults to the smallest power of two whose lanes hold
the longest doc. Docs are packed first-fit-decreasing into bins of ``cp * max_tokens_per_lane``
tokens; bin b runs on CP group ``b % G`` in microbatch ``b // G`` (G = lanes / cp data-parallel
replicas), and every replica runs the same number of microbatches (see ``deal_bins``).
"""

from __future__ import annotations

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import one_pool_longest_segment, static_plan

FIXED_DEGREE = True  # one CP/SP degree for every doc (planning.speed_groups fixes it per pool)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    return static_plan(items, cost, config, step, policy="maxlen", algorithm="ffd")


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """One fixed CP/SP degree for every doc: ``cp`` or the largest power of two dividing the lanes."""
    return one_pool_longest_segment(cost, config, fixed_degree=True)
