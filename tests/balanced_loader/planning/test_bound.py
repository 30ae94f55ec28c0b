"""The step-time lower bound (planning/solvers/bound.py): below every policy's modeled time on random
batches, each term checked on hand-computed cases, and the passes LP tighter than the area term."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.registry import POLICIES
from balanced_loader.planning.solvers.bound import ANCHOR_KS, ANCHOR_MUS, cheapest, step_lower_bound
from balanced_loader.simulate import simulate_step


def cost_of(q: float, lin: float, beta: float, comm: float, cap: int, pp2: bool) -> CostModel:
    strategies = [{"tp": 1, "pp": 2, "quadratic_ms": q / 2, "linear_ms": lin / 2, "microbatch_ms": beta,
                   "max_tokens_per_lane": 2 * cap}] if pp2 else []
    return CostModel.from_dict({"quadratic_ms": q, "linear_ms": lin, "microbatch_ms": beta,
                                "comm_bytes_per_token": comm, "bandwidth_gbs": {2: 50.0, 4: 20.0, 8: 5.0},
                                "max_tokens_per_lane": cap, "strategies": strategies})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([4, 8, 16]), st.booleans(), st.sampled_from([0.0, 5.0, 40.0]))
def test_bound_is_below_every_policy(seed, world, pp2, beta):
    rng = np.random.default_rng(seed)
    cost = cost_of(float(rng.uniform(0, 2e-4)), float(rng.uniform(0.001, 0.1)), beta, float(rng.uniform(0, 1e6)),
                   int(rng.integers(200, 2000)), pp2)
    cap = cost.base.max_tokens_per_lane
    n = int(rng.integers(1, 120))
    lengths = np.minimum(rng.pareto(1.2, n) * 60 + 1, cap * world // 2).astype(np.int64)
    items = BatchItems.from_lengths(lengths)
    bound = step_lower_bound(lengths, cost, world)
    assert 0 < bound.bound_ms < np.inf
    assert bound.bound_ms == max(bound.area_ms, bound.longest_ms, bound.passes_ms, bound.widths_ms, bound.anchors_ms)
    checked = 0
    for policy in POLICIES:
        if policy == "spindle":
            continue
        try:
            plan = make_plan(items, cost, PlanConfig(policy=policy, world_size=world, time_limit_s=0.5))
        except ValueError:  # a policy that cannot hold this batch (e.g. a fixed degree too small)
            continue
        t = simulate_step(plan, cost).step_ms
        assert bound.bound_ms <= t * (1 + 1e-9), (policy, bound, t)
        checked += 1
    assert checked >= 3


def test_terms_on_a_hand_computed_batch():
    # linear cost only, no communication: lane-ms of a doc is s * 0.1 at any degree; beta 10, cap 100
    cost = cost_of(0.0, 0.1, 10.0, 0.0, 100, False)
    lengths = np.asarray([100] * 8)  # 800 tokens on 4 lanes: 80 ms of work, 8 lane-slots of beta
    b = step_lower_bound(lengths, cost, 4)
    assert b.area_ms == pytest.approx((80.0 + 10.0 * 8) / 4)
    assert b.longest_ms == pytest.approx(10.0 + 100 * 0.1 / 4)  # the cheapest group: degree 4
    # every lane needs two passes (200 tokens > cap): 2 * beta + 20 ms of work = 40 ms
    assert b.passes_ms == pytest.approx(40.0, rel=2e-3)
    assert b.passes_ms <= 40.0
    plan = make_plan(BatchItems.from_lengths(lengths), cost, PlanConfig(policy="greedy", world_size=4))
    assert simulate_step(plan, cost).step_ms == pytest.approx(40.0)  # the bound is tight here


def test_anchors_count_the_groups_that_long_docs_leave_part_empty():
    """Docs of 150 tokens on lanes of 100 need 2 lanes each, and two of them never share a group of 2 (u_1: more
    than half of it), nor three one of 4 (u_2: more than a third): the 8 docs take 16 lane-slots of beta in any
    plan of power-of-two groups, where the area term charges 12 (1,200 tokens / 100) and the passes LP sees 300
    tokens per lane. (Groups of 3 lanes hold two docs each: over every degree the term is the area's.)"""
    cost = cost_of(0.0, 0.1, 10.0, 0.0, 100, False)
    lengths = np.asarray([150] * 8)
    assert step_lower_bound(lengths, cost, 4).anchors_ms == pytest.approx(60.0)
    b = step_lower_bound(lengths, cost, 4, degrees=[1, 2, 4])
    assert b.area_ms == pytest.approx((120.0 + 10.0 * 12) / 4)
    assert b.passes_ms <= 60.0 * (1 + 1e-9)
    assert b.anchors_ms == pytest.approx((120.0 + 10.0 * 16) / 4)  # 70 ms: 4 groups per lane of 10 + 7.5 ms
    best = min(simulate_step(make_plan(BatchItems.from_lengths(lengths), cost,
                                       PlanConfig(policy=p, world_size=4)), cost).step_ms
               for p in ("greedy", "hydra", "maxlen", "token-kk"))
    assert b.bound_ms <= best * (1 + 1e-9) and best == pytest.approx(70.0)  # tight
    # half as long: two docs share a group of one lane, the fixed cost is per cap tokens again
    short = step_lower_bound(np.asarray([50] * 8), cost, 4, degrees=[1, 2, 4])
    assert short.anchors_ms == pytest.approx(short.area_ms)


def uniform_anchors(s: np.ndarray, sc, lanes: int, degrees) -> float:
    """The anchors term with one dual feasible function for every degree (weak duality with a multiplier on
    ``sum_g d_g >= tokens / cap``): what the per-degree ascent starts from."""
    cap, beta = sc.max_tokens_per_lane, float(sc.microbatch_ms)
    allowed = np.asarray(degrees, dtype=np.int64)
    si = s.astype(np.int64)
    c = np.asarray(sc.segment_ms(s[:, None], allowed[None, :].astype(float))) * allowed[None, :]
    c = np.where(si[:, None] <= allowed[None, :] * cap, c, np.inf)
    den = allowed[None, :] * cap
    best = 0.0
    for k in ANCHOR_KS:
        num = (k + 1) * si[:, None]
        u = np.where(num % den == 0, si[:, None] / den, (num // den) / k)
        for mu in ANCHOR_MUS * beta:
            best = max(best, float((c + mu * allowed[None, :] * u).min(axis=1).sum()) + (beta - mu) * s.sum() / cap)
    return best / lanes


def test_anchors_take_a_dual_feasible_function_per_degree():
    """2 lanes, groups of 1 or 2, beta 10, cap 100, 0.1 ms per token, 0.04 lane-ms per token of CP on 2 lanes.
    The 160-token doc fills 80% of a 2-lane group and runs alone there (u_3(0.8) = 1): 2 * 10 + 16 + 6.4 =
    42.4 lane-ms. A 60-token doc is more than half a lane, so it runs alone in a one-lane pass (u_1(0.6) = 1:
    10 + 6 = 16 lane-ms), or at most three share a 2-lane group (u_3(0.3) = 1/3: 20 / 3 + 6 + 2.4 = 15.07).
    With u_1 for one lane and u_3 for two the term is (42.4 + 3 * 15.07) / 2 = 43.8 ms, which the plan [160]
    then [60, 60, 60] on both lanes meets (21.2 + 22.6 ms); one function for both degrees gives 40.2 at best."""
    cost = cost_of(0.0, 0.1, 10.0, 2e6, 100, False)
    sc = cost.shape(1, 1)
    s = np.asarray([160.0, 60.0, 60.0, 60.0])
    assert sc.segment_ms(160.0, 2.0) == pytest.approx(8.0 + 3.2)
    assert uniform_anchors(s, sc, 2, [1, 2]) == pytest.approx(40.2)
    b = step_lower_bound(s.astype(np.int64), cost, 2, [(1, 1)], degrees=[1, 2])
    assert b.anchors_ms == pytest.approx(43.8)
    best = min(simulate_step(make_plan(BatchItems.from_lengths(s.astype(np.int64)), cost,
                                       PlanConfig(policy=p, world_size=2)), cost).step_ms
               for p in ("greedy", "hydra", "flexsp", "batch-ada"))
    assert b.bound_ms <= best * (1 + 1e-9) and best == pytest.approx(43.8)  # tight


def policy_times(lengths, cost, world):
    """``(policy, simulated step ms)`` of every one-pool policy that can plan the batch."""
    for policy in ("hydra", "greedy", "maxlen", "token-kk", "batch-ada", "flexsp", "mcore-dcp"):
        try:
            plan = make_plan(BatchItems.from_lengths(lengths), cost,
                             PlanConfig(policy=policy, world_size=world, time_limit_s=0.5))
        except ValueError:
            continue
        yield policy, simulate_step(plan, cost).step_ms


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([2, 4, 8, 16]), st.sampled_from([5.0, 40.0, 400.0]))
def test_per_degree_anchors_are_below_every_power_of_two_plan(seed, world, beta):
    """Long docs just above a lane's cap among short ones, CP traffic from cheap to dear: the per-degree term is at
    least the uniform one and below every policy's plan of power-of-two groups."""
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(50, 400))
    cost = cost_of(float(rng.uniform(0, 1e-4)), float(rng.uniform(0.001, 0.05)), beta,
                   float(rng.choice([0.0, 1e5, 1e6, 4e6])), cap, False)
    n = int(rng.integers(1, 6 * world))
    lengths = np.where(rng.random(n) < 0.4, rng.uniform(1.0, 2.0, n) * cap, rng.uniform(0.05, 0.7, n) * cap)
    lengths = np.minimum(lengths.astype(np.int64) + 1, cap * world)
    degrees = [1 << v for v in range(world.bit_length()) if 1 << v <= world]
    sc = cost.shape(1, 1)
    term = step_lower_bound(lengths, cost, world, [(1, 1)], degrees=degrees).anchors_ms
    assert term >= uniform_anchors(lengths.astype(np.float64), sc, world, degrees) * (1 - 1e-12)
    for policy, ms in policy_times(lengths, cost, world):
        assert term <= ms * (1 + 1e-9), policy


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([2, 4, 8]), st.sampled_from([5.0, 40.0, 400.0]))
def test_anchors_below_every_policy_where_the_fixed_cost_dominates(seed, world, beta):
    """Few long docs of similar length and a large fixed cost per pass: the regime the anchors term is for."""
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(50, 400))
    cost = cost_of(float(rng.uniform(0, 1e-4)), float(rng.uniform(0.001, 0.05)), beta, float(rng.uniform(0, 1e6)),
                   cap, False)
    n = int(rng.integers(1, 5 * world))
    lengths = (rng.uniform(0.3, 1.0, n) * cap * int(rng.choice([1, 2, 4]))).astype(np.int64) + 1
    lengths = np.minimum(lengths, cap * world)
    bound = step_lower_bound(lengths, cost, world)
    for policy, ms in policy_times(lengths, cost, world):
        assert bound.anchors_ms <= ms * (1 + 1e-9), policy


def test_cheapest_degree_tables():
    cost = cost_of(1e-3, 0.0, 0.0, 1e6, 100, False)
    sc = cost.shape(1, 1)
    s = np.asarray([50.0, 150.0, 750.0])
    lane_ms, group_ms = cheapest(sc, s, 8)
    for i, x in enumerate(s):
        ds = [d for d in range(1, 9) if x <= 100 * d]
        assert lane_ms[i] == pytest.approx(min(d * sc.segment_ms(x, d) for d in ds))
        assert group_ms[i] == pytest.approx(min(sc.segment_ms(x, d) for d in ds))
    assert np.isinf(cheapest(sc, np.asarray([900.0]), 4)[0][0])  # 900 tokens fit no degree <= 4


def test_cheapest_over_given_degrees():
    # bandwidth 20 GB/s from 4 lanes, 5 from 8: a 750-token doc (cap 100) fits from 8 lanes, a
    # 450-token doc from 5; over powers of two the latter must take 8 lanes and the slow links
    cost = cost_of(1e-3, 0.0, 0.0, 1e6, 100, False)
    sc = cost.shape(1, 1)
    s = np.asarray([50.0, 150.0, 450.0, 750.0])
    pow2 = [1, 2, 4, 8]
    lane_ms, group_ms = cheapest(sc, s, 8, pow2)
    for i, x in enumerate(s):
        ds = [d for d in pow2 if x <= 100 * d]
        assert lane_ms[i] == pytest.approx(min(d * sc.segment_ms(x, d) for d in ds))
        assert group_ms[i] == pytest.approx(min(sc.segment_ms(x, d) for d in ds))
    any_lane, _ = cheapest(sc, s, 8)
    assert any_lane[2] < lane_ms[2]  # degree 5 (20 GB/s) is cheaper than 8 (5 GB/s)
    assert np.all(any_lane <= lane_ms * (1 + 1e-12))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([4, 8, 12, 16]), st.sampled_from([0.0, 5.0, 40.0]))
def test_power_of_two_bound_is_below_power_of_two_policies(seed, world, beta):
    """The bound over degrees 1, 2, 4, .. is at least the general one and below the plan of every one-pool
    policy: each forms only groups of power-of-two lanes (the groups the runtime declares), so it is the bound
    the regime sweep reports against (tools/sweep_planner.py)."""
    rng = np.random.default_rng(seed)
    cost = cost_of(float(rng.uniform(0, 2e-4)), float(rng.uniform(0.001, 0.1)), beta, float(rng.uniform(0, 1e6)),
                   int(rng.integers(200, 2000)), False)
    cap = cost.base.max_tokens_per_lane
    lengths = np.minimum(rng.pareto(1.2, int(rng.integers(1, 120))) * 60 + 1, cap * world // 2).astype(np.int64)
    degrees = [1 << v for v in range(world.bit_length()) if 1 << v <= world]
    general = step_lower_bound(lengths, cost, world, [(1, 1)])
    pow2 = step_lower_bound(lengths, cost, world, [(1, 1)], degrees=degrees)
    assert general.area_ms <= pow2.area_ms * (1 + 1e-12) and general.longest_ms <= pow2.longest_ms * (1 + 1e-12)
    # the passes LP is bisected to REL_TOL, so the general one may land up to that above
    assert general.bound_ms <= pow2.bound_ms * (1 + 2e-3)
    checked = 0
    for policy in ("hydra", "mcore-dcp", "maxlen", "static-sp", "token-kk", "batch-ada", "greedy", "flexsp"):
        try:
            plan = make_plan(BatchItems.from_lengths(lengths), cost,
                             PlanConfig(policy=policy, world_size=world, time_limit_s=0.5))
        except ValueError:  # a fixed degree that cannot hold this batch on these lanes
            continue
        degs = {len(g.lanes) for mb in plan.pools[0].microbatches for g in mb}
        assert degs <= set(degrees), policy
        assert pow2.bound_ms <= simulate_step(plan, cost).step_ms * (1 + 1e-9), (policy, pow2)
        checked += 1
    assert checked >= 5


@given(st.integers(0, 10**6), st.sampled_from([2, 8, 12, 64, 100]), st.sampled_from([1, 2, 3, 5, 10]),
       st.sampled_from([0.0, 0.3, 1.0]))
def test_widths_term_takes_every_degree_where_its_minimum_can_be(seed, lanes, k, lam):
    """The widths term evaluates each doc at a few degrees only: the least over those equals the least over
    every degree from its memory fit to the lanes, for u = (1 - lam) x + lam u_k (checked by brute force)."""
    from balanced_loader.planning.solvers.bound import _width_degrees, dff

    rng = np.random.default_rng(seed)
    cost = cost_of(float(rng.uniform(0, 2e-4)), float(rng.uniform(0.001, 0.1)), float(rng.uniform(0, 50)),
                   float(rng.uniform(0, 1e6)), int(rng.integers(200, 2000)), False)
    sc = cost.shape(1, 1)
    cap = sc.max_tokens_per_lane
    s = rng.integers(1, cap * lanes + 1, 20).astype(np.float64)
    c = np.maximum(1, -(-s.astype(np.int64) // cap))
    cand = _width_degrees(c, lanes, [k], [key for key, _ in sc.bandwidth_gbs], None)

    def weighted(x, d):
        y = sc.segment_ms(x, d) + sc.microbatch_ms * x / (d * cap)
        return ((1 - lam) * d / lanes + lam * float(dff(k, np.asarray(d), lanes))) * y

    for i, x in enumerate(s):
        brute = min(weighted(x, d) for d in range(int(c[i]), lanes + 1))
        assert min(weighted(x, int(d)) for d in cand[i] if d <= lanes) == pytest.approx(brute, rel=1e-12)


def test_widths_term_counts_docs_that_cannot_run_side_by_side():
    """8 lanes of 100 tokens, f(s) = s, bandwidth 20 GB/s from 4 lanes and 5 GB/s at 8: each 600-token doc needs
    6 lanes, so no two run at once (at most one group wider than half the lanes at any time): the step is at
    least the sum of each doc's fastest group over 6-8 lanes. The area term spreads their lane-time over all 8
    lanes as if they could share them, and is lower."""
    cost = cost_of(0.0, 1.0, 0.0, 2e7, 100, False)
    sc = cost.shape(1, 1)
    lengths = np.asarray([600, 600, 600])
    b = step_lower_bound(lengths, cost, 8, [(1, 1)])
    alone = 3 * min(sc.group_ms([600], d) for d in (6, 7, 8))
    assert b.widths_ms == pytest.approx(alone)
    assert b.widths_ms > 1.1 * b.area_ms
    for policy in ("hydra", "greedy", "maxlen"):
        plan = make_plan(BatchItems.from_lengths(lengths), cost, PlanConfig(policy=policy, world_size=8))
        assert b.bound_ms <= simulate_step(plan, cost).step_ms * (1 + 1e-9)
