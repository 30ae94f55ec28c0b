"""``token-kk``: verl's sequence balancing with dynamic batch size.

1. Data parallel: Karmarkar-Karp of every doc's work ``q*s^2 + l*s`` (verl's
   ``calculate_workload``) into one part per SP group (``balance_batch``).
2. Microbatches (``rearrange_micro_batches``): each group needs
   ``ceil(tokens / (degree * max_tokens_per_lane))`` microbatches; the count is the maximum
   over groups (verl all-reduces it with MAX), then each group's docs are split by
   Karmarkar-Karp on work into that many microbatches. When a microbatch would exceed the token
   cap, the count grows by one on every group and the split is redone (verl's fix #7553).
   Microbatches run heaviest first.

The SP degree (verl's Ulysses ``sequence_parallel_size``) is ``--cp`` or the smallest power of
two whose lanes hold the longest doc; tp = pp = 1 unless the config sets them.
"""

from __future__ import annotations

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.packing import karmarkar_karp
from balanced_loader.planning.policies.common import (
    assemble,
    check_fits,
    empty_plan,
    fixed_degree,
    one_pool_longest_segment,
    one_pool_plan,
    pool_setup,
)

FIXED_DEGREE = True  # one CP/SP degree for every doc (planning.speed_groups fixes it per pool)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    setup = pool_setup(items, cost, config, "token-kk")
    lanes, cap = setup.lanes, setup.cap
    d = config.cp if config.cp is not None else fixed_degree(items, lanes, cap)
    if d > lanes or lanes % d:
        raise ValueError(f"policy 'token-kk': SP degree {d} must divide the {lanes} lanes per stage; "
                         f"choose --cp among the divisors of {lanes}")
    check_fits(items, cap, d, "token-kk", what="SP degree", fix="raise --cp")
    if not len(items):
        return empty_plan(step, config, setup)
    mb, lane0, deg = kk_arrays(items.lengths, setup.shape, lanes, d)
    micro = assemble(items, mb, lane0, deg)
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)


def kk_arrays(lengths: np.ndarray, sc: ShapeCost, lanes: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """verl's plan at SP degree ``d`` (module docstring) as per-item ``(microbatch, first lane, degree)``
    ``[n]`` each; the docs must fit ``d * max_tokens_per_lane`` and ``d`` must divide ``lanes``."""
    cap_tok = sc.max_tokens_per_lane * d
    groups = lanes // d
    ln = np.asarray(lengths, dtype=np.int64)
    work = np.asarray(sc.compute_ms(ln.astype(np.float64)))  # [n]
    part = karmarkar_karp(work, groups)  # [n] SP group of each doc
    members = [np.flatnonzero(part == g) for g in range(groups)]
    m = max(-(-int(ln[idx].sum()) // cap_tok) for idx in members)
    while True:
        sub = [karmarkar_karp(work[idx], m) if len(idx) else idx for idx in members]
        if all(np.bincount(s, weights=ln[idx], minlength=m).max() <= cap_tok
               for s, idx in zip(sub, members) if len(idx)):
            break
        m += 1
    mb = np.empty(len(ln), dtype=np.int64)
    for idx, s in zip(members, sub):
        if not len(idx):
            continue
        heavy = np.argsort(-np.bincount(s, weights=work[idx], minlength=m), kind="stable")
        rank = np.empty(m, dtype=np.int64)
        rank[heavy] = np.arange(m)
        mb[idx] = rank[s]
    return mb, part * d, np.full(len(ln), d, dtype=np.int64)


def longest_segment(cost: CostModel, config: PlanConfig) -> int:
    """One fixed CP/SP degree for every doc: ``cp`` or the largest power of two dividing the lanes."""
    return one_pool_longest_segment(cost, config, fixed_degree=True)
