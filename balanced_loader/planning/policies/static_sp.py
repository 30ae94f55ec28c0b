"""``static-sp``: DeepSpeed Ulysses with one fixed sequence-parallel degree for every doc.

The degree is ``--cp`` or the smallest power of two whose lanes hold the longest doc (tp = pp
= 1 unless the config sets them). Docs are packed best-fit-decreasing into bins of
``degree * max_tokens_per_lane`` tokens; each microbatch runs the next ``lanes / degree`` bins,
one per SP group (FlexSP's ``fix_sp_bfd`` baseline), the same count on every group.
"""

from __future__ import annotations

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import one_pool_longest_segment, static_plan

FIXED_DEGREE = True  # one CP/SP degree for every doc (planning.speed_groups fixes it per pool)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    return static_plan(items, cost, config, step, policy="static-sp", algorithm="bfd")


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """One fixed CP/SP degree for every doc: ``cp`` or the largest power of two dividing the lanes."""
    return one_pool_longest_segment(cost, config, fixed_degree=True)
