"""HyDra's closed-form load target, load-driven degrees and placement: hand-computed cases and a
Wikipedia regression against the lower bound and Megatron-Core DCP."""

from __future__ import annotations

import numpy as np
import pytest

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.hydra import LowerBound, load_target
from balanced_loader.presets import cost_preset


def _cost(q=0.0, l=1.0, beta=0.0, comm=0.0, bw=None, cap=10) -> CostModel:
    return CostModel.from_dict({"quadratic_ms": q, "linear_ms": l, "microbatch_ms": beta,
                                "comm_bytes_per_token": comm, "bandwidth_gbs": bw or {2: 1.0},
                                "max_tokens_per_lane": cap})


def _plan(cost, lengths, lanes):
    items = BatchItems.from_lengths(lengths)
    plan = make_plan(items, cost, PlanConfig(policy="hydra", world_size=lanes))
    plan.validate(lengths, cost, doc_ids=range(len(lengths)))
    degree = {s[0]: len(g.lanes) for mb in plan.pools[0].microbatches for g in mb for s in g.segments}
    return plan, [degree[i] for i in range(len(lengths))]


def test_target_is_the_area_when_no_doc_is_critical():
    # f(s) = s. Work 90 on 4 lanes -> T* = 22.5; the 40-token doc needs 4 lanes (10 ms <= T*).
    cost = _cost(cap=10)
    lengths = [40, 10, 10, 10, 10, 5, 5]
    t = load_target(BatchItems.from_lengths(lengths), cost.base, 4)
    assert t.target_ms == pytest.approx(22.5)
    assert t.t_min_ms == pytest.approx(10.0)
    assert t.levels.tolist() == [2, 0, 0, 0, 0, 0, 0]
    plan, degree = _plan(cost, lengths, 4)
    # 10 ms on every lane, then 10+10+10+10+5+5 over 4 lanes: the best split ends at 25
    assert degree == [4, 1, 1, 1, 1, 1, 1]
    assert plan.predicted_ms == pytest.approx(25.0)


def test_load_driven_degree_above_memory_fit():
    # comm 1e5 B/token over 1 GB/s = 0.1 ms per token, split over d lanes.
    # The 400-token doc fits on 4 lanes (g = 100 + 10 = 110) but the area is
    # (800 + 40) / 8 = 105 < 110: the target is 105 and the doc takes 8 lanes (g = 50 + 5 = 55).
    cost = _cost(comm=1e5, bw={2: 1.0}, cap=100)
    lengths = [400] + [50] * 8
    items = BatchItems.from_lengths(lengths)
    t = load_target(items, cost.base, 8)
    assert t.target_ms == pytest.approx(105.0)
    assert t.memory_levels[0] == 2 and t.levels[0] == 3
    plan, degree = _plan(cost, lengths, 8)
    assert degree[0] == 8
    assert plan.predicted_ms == pytest.approx(105.0)
    assert LowerBound.of(items, cost, 8).bound_ms == pytest.approx(105.0)
    mcore = make_plan(items, cost, PlanConfig(policy="mcore-dcp", world_size=8))
    assert mcore.predicted_ms >= 110.0


def test_bandwidth_cliff_keeps_the_memory_fit_degree():
    # At 8 lanes the bandwidth halves: g(8) = 50 + 10 = 60, lane time 880 / 8 = 110 > the
    # memory-fit area 105. Below 110 no degree choice is feasible; at T = 110 degree 4
    # (g = 110) becomes feasible again and is the smaller one.
    cost = _cost(comm=1e5, bw={2: 1.0, 8: 0.5}, cap=100)
    lengths = [400] + [50] * 8
    t = load_target(BatchItems.from_lengths(lengths), cost.base, 8)
    assert t.target_ms == pytest.approx(110.0)
    assert t.levels[0] == 2
    plan, degree = _plan(cost, lengths, 8)
    assert degree[0] == 4
    assert plan.predicted_ms == pytest.approx(110.0)


def test_microbatch_cost_counts_per_pass():
    # beta 5 per pass, passes of 10 tokens: 4 docs of 10 on 2 lanes -> 2 passes per lane,
    # T* = (40 + 5 * 4) / 2 = 30; the lower bound is 40/2 + 5 * ceil(40 / 20) = 30.
    cost = _cost(beta=5.0, cap=10)
    items = BatchItems.from_lengths([10, 10, 10, 10])
    assert load_target(items, cost.base, 2).target_ms == pytest.approx(30.0)
    lb = LowerBound.of(items, cost, 2)
    assert (lb.area_ms, lb.longest_ms) == (pytest.approx(30.0), pytest.approx(10.0))
    plan, _ = _plan(cost, [10, 10, 10, 10], 2)
    assert plan.predicted_ms == pytest.approx(30.0)


def test_quadratic_work():
    # q = 0.01, s = 10: f = 1 per doc; alone on 2 lanes a doc would take 0.5 (the critical path).
    cost = _cost(q=0.01, l=0.0, cap=10)
    t = load_target(BatchItems.from_lengths([10, 10]), cost.base, 2)
    assert (t.target_ms, t.t_min_ms) == (pytest.approx(1.0), pytest.approx(0.5))


def test_few_docs_retarget_to_a_better_breakpoint():
    # 5 tiny docs on 8 lanes (the 7B preset): the area target puts the 200-token doc on all 8
    # lanes (35.2 ms) and the rest after it (66.8 ms). The next breakpoint (4 lanes, 40.3 ms)
    # leaves 4 lanes for the others and is kept.
    cost = cost_preset("hydra-gpt7b-a100")
    lengths = [5, 9, 3, 200, 7]
    t = load_target(BatchItems.from_lengths(lengths), cost.base, 8)
    assert t.levels[3] == 3
    plan, degree = _plan(cost, lengths, 8)
    assert degree[3] == 4
    assert plan.predicted_ms == pytest.approx(cost.base.group_ms([200], 4))


@pytest.mark.parametrize(("context", "speedup"), [(32768, 1.2), (262144, 1.2)])
def test_wikipedia_regression_against_bound_and_mcore(wiki_lengths, context, speedup):
    """128 lanes, docs <= context in a seeded shuffle, 128 x 8192 x 4 tokens (the planner
    benchmark's batch rule): hydra within 2% of the lower bound and faster than mcore-dcp."""
    lanes = 128
    docs = wiki_lengths[wiki_lengths <= context]
    docs = docs[np.random.default_rng(0).permutation(len(docs))]
    n = int(np.searchsorted(np.cumsum(docs), lanes * 8192 * 4, side="right"))
    items = BatchItems.from_lengths(docs[:n])
    cost = cost_preset("hydra-gpt7b-a100")
    hydra = make_plan(items, cost, PlanConfig(policy="hydra", world_size=lanes))
    hydra.validate(docs[:n], cost, doc_ids=range(n))
    bound = LowerBound.of(items, cost, lanes).bound_ms
    assert bound <= hydra.predicted_ms <= 1.02 * bound
    mcore = make_plan(items, cost, PlanConfig(policy="mcore-dcp", world_size=lanes))
    assert mcore.predicted_ms >= speedup * hydra.predicted_ms
