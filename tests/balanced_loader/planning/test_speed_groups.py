"""Planning on lanes that are not alike (contract 2's lane speeds and device classes): every policy's plan
stays valid (each doc tiled once, every lane within its class's cap), gives the slow lanes less work, and
beats the same policy planning as if the lanes were alike; speed groups, the split kernel, and the
mixed-hardware regression figure (A800 + H100 halves, a long-tailed Wikipedia batch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.cost import CostModel, slowest
from balanced_loader.plan import BatchItems
from balanced_loader.planning import longest_segment, make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.kernels.split import split_kernel, split_reference
from balanced_loader.planning.policies.hydraulis import pipe_shapes
from balanced_loader.planning.speed_groups import aligned_runs, merge, speed_groups
from balanced_loader.presets import cost_preset
from balanced_loader.simulate import simulate_step, step_ms

BASE = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 2e4,
        "bandwidth_gbs": {2: 100.0}, "max_tokens_per_lane": 64,
        "strategies": [{"tp": 2, "pp": 1, "quadratic_ms": 5e-5, "linear_ms": 0.005, "max_tokens_per_lane": 128}]}
TOP = CostModel.from_dict(BASE)
SLOW = CostModel.from_dict({**BASE, "lane_speed": {5: 0.5}})  # 8 lanes, lane 5 at half speed
# ranks 0-3 an older device: every time key doubled, a smaller cap; ranks 4-7 the top level's keys
MIXED = CostModel.from_dict({**BASE, "device_classes": {
    "old": {"quadratic_ms": 2e-4, "linear_ms": 0.02, "microbatch_ms": 2.0, "max_tokens_per_lane": 48}, "new": {}},
    "rank_classes": [{"class": "old", "ranks": 4}, {"class": "new", "ranks": 4}]})
ONE_POOL = ("greedy", "maxlen", "static-sp", "token-kk", "mcore-dcp", "hydra", "batch-ada", "flexsp")
LENGTHS = np.random.default_rng(1).integers(4, 100, 48)  # [48] docs of 1-2 lanes' cap: the split can balance


def _config(policy: str, world: int = 8, **kw) -> PlanConfig:
    # one-rank lanes: speed groups plan them, and these tests compare their plans with plans on alike lanes, where
    # hydra would also try lanes of tensor-parallel ranks (make_plan's try_shapes; BASE has a tp-2 shape)
    if policy == "hydra":
        kw["extra"] = {"shapes": False, **kw.get("extra", {})}
    return PlanConfig(policy=policy, world_size=world, time_limit_s=0.1, **kw)


@pytest.mark.parametrize("policy", ONE_POOL)
@pytest.mark.parametrize("cluster", ["slow", "mixed"])
def test_one_pool_policies_balance_lanes_that_are_not_alike(policy, cluster):
    cost = SLOW if cluster == "slow" else MIXED
    items = BatchItems.from_lengths(LENGTHS)
    cfg = _config(policy)
    aware = make_plan(items, cost, cfg, step=2)
    # contract 1 with the cluster's per-lane caps: every doc tiled exactly once, no lane over its class's cap
    aware.validate(LENGTHS, cost, doc_ids=range(len(LENGTHS)))
    assert aware.step == 2 and aware.predicted_ms == pytest.approx(step_ms(aware, cost))
    # the slow lanes get less work (busy ms at speed 1, the class's own keys)
    work = simulate_step(aware, cost.device()).rank_busy_ms  # [8]
    if cluster == "slow":
        assert work[5] < 0.8 * np.median(work), work
    else:
        tokens = np.zeros(8)
        for g in (g for mb in aware.pools[0].microbatches for g in mb):
            tokens[list(g.lanes)] += g.tokens / g.degree
        assert tokens[:4].sum() < 0.8 * tokens[4:].sum(), tokens
    # and the plan is at least as fast on this cluster as the one made as if the lanes were alike
    blind = make_plan(items, cost.device(), cfg, step=2)
    assert step_ms(aware, cost) <= step_ms(blind, cost) * (1 + 1e-9)
    assert step_ms(aware, cost) < 0.85 * step_ms(blind, cost)


@pytest.mark.parametrize("policy", ("hydra", "token-kk", "greedy", "mcore-dcp"))
def test_speeds_of_one_plan_as_no_speeds_and_one_speed_group_as_a_scaled_model(policy):
    items = BatchItems.from_lengths(LENGTHS)
    cfg = _config(policy)
    ones = CostModel.from_dict({**BASE, "lane_speed": {0: 1.0, 5: 1.0, 7: 1.0}})
    assert ones.lane_speed and ones.uniform
    assert make_plan(items, ones, cfg).fingerprint() == make_plan(items, TOP, cfg).fingerprint()
    # every lane at half speed is one speed group: the policy's own plan on the model with times doubled
    half = TOP.with_speeds([0.5] * 8)
    assert not half.uniform
    p_half = make_plan(items, half, cfg)
    assert p_half.fingerprint() == make_plan(items, TOP.scaled(2.0), cfg).fingerprint()
    assert p_half.predicted_ms == pytest.approx(2 * step_ms(make_plan(items, TOP, cfg), TOP))


def test_speed_groups_are_aligned_blocks_of_one_class_and_speed():
    ranks = [list(range(8))]
    g = speed_groups(SLOW, _config("hydra"), ranks, 1, lambda m, c: m.lane_cap() * c.world_size)
    # lane 5 alone, its aligned neighbours in blocks of their own: [0-3], [4], [5], [6-7]
    assert [x.lanes for x in g] == [(0, 1, 2, 3), (4,), (5,), (6, 7)]
    assert g[2].model.linear_ms == pytest.approx(2 * TOP.linear_ms) and g[0].model.linear_ms == TOP.linear_ms
    assert [x.config.world_size for x in g] == [4, 1, 1, 2] and [x.capacity for x in g] == [256, 64, 64, 128]
    # a fixed CP degree keeps its blocks whole: cp=2 -> the block (4, 5) takes the slower speed
    g2 = speed_groups(SLOW, _config("token-kk", cp=2), ranks, 1, lambda m, c: m.lane_cap())
    assert [x.lanes for x in g2] == [(0, 1, 2, 3), (4, 5), (6, 7)]
    assert g2[1].model.linear_ms == pytest.approx(2 * TOP.linear_ms) and g2[1].config.cp == 2
    gm = speed_groups(MIXED, _config("hydra"), ranks, 1, lambda m, c: m.lane_cap())
    assert [x.lanes for x in gm] == [(0, 1, 2, 3), (4, 5, 6, 7)] and [x.capacity for x in gm] == [48, 64]
    with pytest.raises(ValueError, match="cp 3 does not divide"):
        speed_groups(SLOW, _config("token-kk", cp=3), ranks, 1, lambda m, c: 1)


@pytest.mark.parametrize("keys, runs", [
    ("", []),
    ("a", [(0, 1)]),
    ("aaaaaaaa", [(0, 8)]),
    ("aaaaaaa", [(0, 4), (4, 2), (6, 1)]),
    ("aaaaabaa", [(0, 4), (4, 1), (5, 1), (6, 2)]),
    ("baaaaaaa", [(0, 1), (1, 1), (2, 2), (4, 4)]),
    ("aabbaabb", [(0, 2), (2, 2), (4, 2), (6, 2)]),
    ("aaaabbbbbb", [(0, 4), (4, 4), (8, 2)]),
])
def test_aligned_runs(keys, runs):
    out = aligned_runs(list(keys))
    assert out == runs
    # a cover of 0..n-1 by aligned power-of-two blocks of equal keys
    assert sum(size for _, size in out) == len(keys)
    for first, size in out:
        assert size & (size - 1) == 0 and first % size == 0 and len(set(keys[first:first + size])) == 1


@st.composite
def split_case(draw):
    n = draw(st.integers(0, 12))
    k = draw(st.integers(1, 4))
    area = np.asarray(draw(st.lists(st.lists(st.integers(0, 50), min_size=k, max_size=k), min_size=n, max_size=n)),
                      dtype=np.float64).reshape(n, k)
    crit = area * draw(st.sampled_from([0.1, 0.5, 1.0]))
    allowed = np.asarray(draw(st.lists(st.lists(st.booleans(), min_size=k, max_size=k), min_size=n, max_size=n)),
                         dtype=bool).reshape(n, k)
    lanes = np.asarray(draw(st.lists(st.integers(1, 8), min_size=k, max_size=k)), dtype=np.float64)
    order = np.asarray(draw(st.permutations(range(n))), dtype=np.int64)
    return order, area, crit, allowed, lanes


@given(split_case())
def test_split_kernel_equals_its_reference(case):
    order, area, crit, allowed, lanes = case
    got = split_kernel(order, np.ascontiguousarray(area), np.ascontiguousarray(crit), allowed, lanes)
    want = split_reference(order, area, crit, allowed, lanes)
    assert got.tolist() == want.tolist()
    assert all((g < 0) == (not allowed[i].any()) for i, g in enumerate(got.tolist()))
    assert all(g < 0 or allowed[i, g] for i, g in enumerate(got.tolist()))


def test_merge_keeps_each_groups_order_and_maps_lanes_back():
    items = BatchItems.from_lengths(LENGTHS)
    plan = make_plan(items, SLOW, _config("hydra"))
    pool = plan.pools[0]
    groups = [g for mb in pool.microbatches for g in mb]
    assert sorted({x for g in groups for x in g.lanes}) == list(range(8))
    # no group spans two speed groups: the slow lane 5 never shares a CP group
    assert all(g.lanes == (5,) for g in groups if 5 in g.lanes)
    empty = merge(pool, [])
    assert empty.microbatches == () and empty.ranks == pool.ranks


def test_pools_and_hydraulis_plan_valid_and_aware_on_classes():
    items = BatchItems.from_lengths(LENGTHS)
    cfg = _config("pools", extra={"pools": [{"tp": 1, "pp": 1, "lanes": 4}, {"tp": 2, "pp": 1, "lanes": 2}]})
    for cost in (MIXED, SLOW):
        aware = make_plan(items, cost, cfg)
        aware.validate(LENGTHS, cost, doc_ids=range(len(LENGTHS)))
        blind = make_plan(items, cost.device(), cfg)
        assert step_ms(aware, cost) <= step_ms(blind, cost) * (1 + 1e-9)
    hyd = _config("hydraulis")
    aware = make_plan(items, MIXED, hyd)
    aware.validate(LENGTHS, MIXED, doc_ids=range(len(LENGTHS)))
    assert step_ms(aware, MIXED) <= step_ms(make_plan(items, MIXED.device(), hyd), MIXED) * (1 + 1e-9)
    # hydraulis's pipelines take their ranks' class and speed
    shapes = pipe_shapes(MIXED.with_speeds({6: 0.25}), [(2, 1), (2, 1), (2, 1), (2, 1)], 8)
    assert [s.linear_ms for s in shapes] == pytest.approx([0.01, 0.01, 0.005, 0.005 / 0.25])
    assert [s.max_tokens_per_lane for s in shapes] == [96, 96, 128, 128]
    assert pipe_shapes(TOP, [(1, 1), (2, 1)], 3) == [TOP.shape(1, 1), TOP.shape(2, 1)]


def test_longest_segment_on_lanes_that_are_not_alike_is_the_largest_group_that_holds_it():
    assert longest_segment(TOP, _config("hydra")) == 8 * 64
    assert longest_segment(SLOW, _config("hydra")) == 4 * 64  # the block 0-3
    assert longest_segment(MIXED, _config("hydra")) == 4 * 64  # the new block (the old holds 4 * 48)


def test_mixed_hardware_classes_beat_planning_as_if_alike(wiki_lengths):
    """The regression figure: 16 lanes, 8 A800 and 8 H100 (analytic GPT-7B presets), a long-tailed batch of
    Wikipedia docs: hydra and token-kk with classes >= 1.3x faster than planning as if all were A800."""
    a800 = cost_preset("analytic:gpt-7b@a800", world_size=16)
    h100 = cost_preset("analytic:gpt-7b@h100", world_size=16)
    cluster = a800.with_classes({"a800": a800, "h100": h100}, [("a800", 8), ("h100", 8)])
    rng = np.random.default_rng(0)
    sample = wiki_lengths[rng.integers(0, len(wiki_lengths), 4000)]
    cut = int(np.searchsorted(np.cumsum(sample), 256 * 1024))
    lengths = sample[:cut]  # [~200] docs of one 256K-token global batch
    assert lengths.max() > 8 * np.median(lengths)  # long-tailed
    items = BatchItems.from_lengths(lengths)
    for policy in ("hydra", "token-kk"):
        cfg = PlanConfig(policy=policy, world_size=16)
        aware = make_plan(items, cluster, cfg)
        aware.validate(lengths, cluster, doc_ids=range(len(lengths)))
        blind = make_plan(items, cluster.device(), cfg)
        speedup = step_ms(blind, cluster) / step_ms(aware, cluster)
        assert speedup >= 1.3, (policy, speedup)
        m = simulate_step(aware, cluster)
        assert set(m.classes) == {"a800", "h100"}
        # the H100 half does more of the work: more tokens per rank than the A800 half
        tokens = np.zeros(16)
        for g in (g for mb in aware.pools[0].microbatches for g in mb):
            tokens[list(g.lanes)] += g.tokens / g.degree
        assert tokens[8:].sum() > 1.5 * tokens[:8].sum()


@pytest.mark.parametrize("policy", ("token-kk", "static-sp", "maxlen"))
def test_a_fixed_cp_block_across_two_classes_takes_the_slowest_keys(policy):
    # ranks 0-2 old (cap 48), 3-7 new (cap 64): with cp=2 the block (2, 3) holds one old lane, so 2 x 48 tokens
    cost = MIXED.replace(rank_classes=(("old", 3), ("new", 5)))
    cfg = _config(policy, cp=2)
    g = speed_groups(cost, cfg, [list(range(8))], 1, lambda m, c: m.lane_cap() * 2)
    assert [x.lanes for x in g] == [(0, 1), (2, 3), (4, 5, 6, 7)]
    assert [x.capacity for x in g] == [96, 96, 128] and g[1].model.linear_ms == pytest.approx(0.02)
    lengths = np.full(24, 120)  # fits 2 new lanes only
    plan = make_plan(BatchItems.from_lengths(lengths), cost, cfg)
    plan.validate(lengths, cost, doc_ids=range(len(lengths)))
    assert {x for mb in plan.pools[0].microbatches for grp in mb for x in grp.lanes} == {4, 5, 6, 7}


@pytest.mark.parametrize("policy", ("hydra", "greedy", "flexsp", "token-kk"))
def test_a_doc_the_pool_holds_is_planned_when_a_slow_lane_cuts_the_alike_blocks(policy):
    # 8 lanes hold 512 tokens; lane 5 at half speed leaves blocks of 4, 1, 1, 2 alike lanes (256 at most):
    # a 400-token doc (within the loader's max_seq_len from the uniform model) must still be planned
    lengths = np.asarray([400, 30, 50, 20, 60, 10])
    plan = make_plan(BatchItems.from_lengths(lengths), SLOW, _config(policy))
    plan.validate(lengths, SLOW, doc_ids=range(len(lengths)))
    (big,) = [g for mb in plan.pools[0].microbatches for g in mb if any(d == 0 for d, _, _ in g.segments)]
    assert big.degree == 8
    too_long = np.asarray([513, 10])
    with pytest.raises(ValueError, match=r"doc 0 \(513 tokens\)"):
        make_plan(BatchItems.from_lengths(too_long), SLOW, _config(policy))


@pytest.mark.parametrize("policy", ("hydra", "greedy", "mcore-dcp"))
def test_aware_is_not_slower_than_blind_when_a_slow_lane_splits_the_only_other_pair(policy):
    # speed groups cut a fast+slow pair into two one-lane groups, so docs needing 2 lanes all go to the old
    # pair; the plan of the whole pool as if every lane were the slowest (plan_pool's safety net) wins here
    # ranks 0, 1 old (cap 48), 2, 3 new (cap 64) with rank 3 at half speed: a 90-token doc needs 2 lanes, and
    # only the old pair is a speed group of 2; planning as if alike uses the pair (2, 3) too and is faster
    cost = CostModel.from_dict({**BASE, "device_classes": {"old": {"linear_ms": 0.02, "max_tokens_per_lane": 48},
                                                           "new": {}},
                                "rank_classes": [{"class": "old", "ranks": 2}, {"class": "new", "ranks": 2}],
                                "lane_speed": {3: 0.5}})
    lengths = np.asarray([90] * 12 + [20, 30, 40, 10])
    items = BatchItems.from_lengths(lengths)
    aware = make_plan(items, cost, _config(policy, world=4))
    # the whole pool planned as if every lane were the slowest (key by key): valid on this cluster
    worst = slowest(cost.lanes([list(range(4))], 1, 4).lane_models())
    blind = make_plan(items, worst, _config(policy, world=4))
    blind.validate(lengths, cost)
    assert step_ms(aware, cost) <= step_ms(blind, cost) * (1 + 1e-9)
