"""The planning-core policies (maxlen, static-sp, token-kk, mcore-dcp, hydra) on random batches:
every plan validates (contract 1), and each policy keeps its own structure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.batches.items import to_items
from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import fixed_pools, longest_segment, make_plan, pool_shapes
from balanced_loader.planning.config import PlanConfig
from balanced_loader.simulate import step_ms

CORE = ("maxlen", "static-sp", "token-kk", "mcore-dcp", "hydra")
STATIC = ("maxlen", "static-sp", "token-kk")

COST = CostModel.from_dict({
    "quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 2e4,
    "bandwidth_gbs": {2: 100.0, 16: 10.0}, "max_tokens_per_lane": 64, "gpus_per_node": 8,
    "strategies": [
        {"tp": 2, "pp": 1, "quadratic_ms": 5e-5, "linear_ms": 0.005, "max_tokens_per_lane": 128},
        {"tp": 4, "pp": 1, "quadratic_ms": 2.5e-5, "linear_ms": 0.003, "max_tokens_per_lane": 256},
        {"tp": 1, "pp": 2, "microbatch_ms": 2.0, "max_tokens_per_lane": 96},
        {"tp": 2, "pp": 2, "max_tokens_per_lane": 160},
        {"tp": 8, "pp": 1, "max_tokens_per_lane": 0},
    ],
})
SHAPES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))


def _pow2_dividing(n: int) -> int:
    return n & -n


def _pow2_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@st.composite
def policy_case(draw):
    policy = draw(st.sampled_from(CORE))
    world = draw(st.integers(1, 128))
    tp, pp = draw(st.sampled_from([s for s in SHAPES if world % (s[0] * s[1]) == 0]))
    lanes = world // (tp * pp)
    cap = COST.shape(tp, pp).max_tokens_per_lane
    cp = None
    if policy in STATIC:
        options = [d for d in (1, 2, 4, 8, 16) if lanes % d == 0]
        cp = draw(st.sampled_from([None, *options]))
        most = cap * (cp if cp is not None else _pow2_dividing(lanes))
    else:
        most = cap * _pow2_below(lanes)
    special = st.sampled_from([1, cap, most])
    lengths = draw(st.lists(st.one_of(st.integers(1, most), st.integers(1, cap), special), max_size=50))
    explicit = draw(st.booleans())
    config = PlanConfig(policy=policy, world_size=world, tp=tp if explicit or tp > 1 else None,
                        pp=pp if explicit or pp > 1 else None, cp=cp)
    return config, np.asarray(lengths, dtype=np.int64)


@given(policy_case())
def test_every_core_policy_plan_validates(case):
    config, lengths = case
    items = BatchItems.from_lengths(lengths)
    plan = make_plan(items, COST, config, step=3)
    plan.validate(lengths, COST, doc_ids=range(len(lengths)))
    assert plan.step == 3
    assert plan.predicted_ms == pytest.approx(step_ms(plan, COST))
    assert [(p.tp, p.pp) for p in plan.pools] == [(config.tp or 1, config.pp or 1)]
    pool = plan.pools[0]
    cap = COST.shape(pool.tp, pool.pp).max_tokens_per_lane
    groups = [g for mb in pool.microbatches for g in mb]
    if not len(lengths):
        assert groups == [] and plan.predicted_ms == 0.0
        return
    need = {int(i): 1 << max(0, int(np.ceil(np.log2(-(-int(s) // cap))))) for i, s in enumerate(lengths)}
    for g in groups:
        d = len(g.lanes)
        assert g.lanes == tuple(range(g.lanes[0], g.lanes[0] + d))  # contiguous lanes
        if config.policy in STATIC:
            assert d == (config.cp or d) and g.lanes[0] % d == 0
        if config.policy in ("hydra", "mcore-dcp"):
            assert all(d >= need[s[0]] for s in g.segments)  # never below the memory-fit degree
        if config.policy == "hydra":
            assert d & (d - 1) == 0 and g.lanes[0] % d == 0  # aligned power-of-two blocks
        if config.policy == "mcore-dcp":
            assert len(g.segments) == 1  # each sub-sample is its own pass
    if config.policy in STATIC:  # one fixed degree for every doc
        assert len({len(g.lanes) for g in groups}) == 1


@pytest.mark.parametrize("policy", CORE)
def test_empty_batch_is_an_empty_step(policy):
    z = np.zeros(0, dtype=np.int64)
    plan = make_plan(BatchItems(doc_ids=z, starts=z, lengths=z), COST, PlanConfig(policy=policy, world_size=8))
    plan.validate(z, COST, doc_ids=[])
    assert plan.pools[0].microbatches == () and plan.predicted_ms == 0.0
    assert sorted(r for p in plan.pools for s in p.ranks for r in s) == list(range(8))


@pytest.mark.parametrize("policy", CORE)
def test_split_docs_plan_as_independent_segments(policy):
    lengths = np.asarray([300, 5, 64, 129, 1], dtype=np.int64)
    items, stats = to_items(lengths, np.arange(5), 128, "split")
    assert stats.split == 2
    plan = make_plan(items, COST, PlanConfig(policy=policy, world_size=8))
    plan.validate(lengths, COST, doc_ids=range(5))


def test_static_policies_run_equal_microbatch_counts():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 64, 300)
    for policy in STATIC:
        plan = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy=policy, world_size=16, cp=2))
        per_lane = np.zeros(16, dtype=int)
        for mb in plan.pools[0].microbatches:
            for g in mb:
                per_lane[list(g.lanes)] += 1
        assert len(set(per_lane.tolist())) == 1, (policy, per_lane)


def test_token_kk_respects_the_token_cap_and_balances_work():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 64, 2000)
    plan = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="token-kk", world_size=8))
    sc = COST.base
    lane_work = np.zeros(8)
    for mb in plan.pools[0].microbatches:
        for g in mb:
            assert g.tokens <= 64
            lane_work[g.lanes[0]] += sum(sc.compute_ms(s[2]) for s in g.segments)
    assert lane_work.max() / lane_work.mean() < 1.01


@pytest.mark.parametrize(("policy", "config", "message"), [
    ("maxlen", {"cp": 2}, r"doc 7 \(300 tokens\) does not fit: max_tokens_per_lane 64 x cp 2 = 128 tokens"),
    ("static-sp", {"cp": 4}, r"doc 7 \(300 tokens\) does not fit: max_tokens_per_lane 64 x cp 4 = 256"),
    ("token-kk", {"cp": 1}, r"doc 7 \(300 tokens\) does not fit: max_tokens_per_lane 64 x SP degree 1 = 64"),
    ("mcore-dcp", {}, r"doc 7 \(300 tokens\) does not fit: max_tokens_per_lane 64 x largest degree 4 = 256"),
    ("hydra", {}, r"doc 7 \(300 tokens\) does not fit: max_tokens_per_lane 64 x largest degree 4 = 256"),
])
def test_a_doc_no_degree_holds_is_one_error_naming_it(policy, config, message):
    items = BatchItems.from_lengths([10, 300], doc_ids=[3, 7])
    with pytest.raises(ValueError, match=message):
        make_plan(items, COST, PlanConfig(policy=policy, world_size=4, **config))


def test_bad_configs_name_the_field():
    items = BatchItems.from_lengths([10, 20])
    with pytest.raises(ValueError, match="tp=4, pp=2 is not in the cost file.*strategies"):
        make_plan(items, COST, PlanConfig(policy="maxlen", world_size=8, tp=4, pp=2))
    with pytest.raises(ValueError, match="marked unusable"):
        make_plan(items, COST, PlanConfig(policy="hydra", world_size=8, tp=8))
    with pytest.raises(ValueError, match="world_size 6 is not divisible by tp\\*pp = 4"):
        PlanConfig(policy="maxlen", world_size=6, tp=4)
    with pytest.raises(ValueError, match="unknown policy 'megatron'"):
        PlanConfig(policy="megatron", world_size=8)
    with pytest.raises(ValueError, match="cp 3 must divide the 8 lanes"):
        make_plan(items, COST, PlanConfig(policy="maxlen", world_size=8, cp=3))
    bad = BatchItems(doc_ids=np.arange(2), starts=np.zeros(2, np.int64), lengths=np.asarray([5, 0]))
    for policy in CORE:
        with pytest.raises(ValueError, match="lengths must be positive: doc 1 has length 0"):
            make_plan(bad, COST, PlanConfig(policy=policy, world_size=4))


def test_greedy_uses_the_configured_shape():
    lengths = np.asarray([300, 5, 96, 129, 1, 40], dtype=np.int64)
    config = PlanConfig(policy="greedy", world_size=8, tp=2, pp=2)
    plan = make_plan(BatchItems.from_lengths(lengths), COST, config)
    plan.validate(lengths, COST, doc_ids=range(len(lengths)))
    (pool,) = plan.pools
    assert (pool.tp, pool.pp, pool.num_lanes) == (2, 2, 2)
    assert plan.predicted_ms == pytest.approx(step_ms(plan, COST))


@pytest.mark.parametrize("config", [
    PlanConfig(policy="pools", world_size=6,
               extra={"pools": [{"tp": 1, "pp": 2, "lanes": 1}, {"tp": 2, "pp": 1, "lanes": 2}]}),
    PlanConfig(policy="hydra", world_size=8, tp=2),
    PlanConfig(policy="maxlen", world_size=12, cp=2),
])
def test_registry_tells_the_pools_and_longest_segment_before_planning(config):
    pools = fixed_pools(config)
    lengths = np.full(12, longest_segment(COST, config), dtype=np.int64)
    plan = make_plan(BatchItems.from_lengths(lengths), COST, config)
    plan.validate(lengths, COST, doc_ids=range(len(lengths)))  # the longest segment is plannable
    assert [(p.tp, p.pp, p.ranks) for p in pools] == [(p.tp, p.pp, p.ranks) for p in plan.pools]
    shapes = pool_shapes(COST, config)
    assert all(shapes[(p.tp, p.pp)] >= p.num_lanes for p in plan.pools)


def test_hydraulis_pools_change_per_step():
    config = PlanConfig(policy="hydraulis", world_size=4)
    assert fixed_pools(config) is None
    # one-lane pipelines, or one pool per shape with all its replicas as lanes (CP inside)
    assert pool_shapes(COST, config) == {(1, 1): 4, (2, 1): 2, (4, 1): 1, (1, 2): 2, (2, 2): 1}
    assert longest_segment(COST, config) == 256
