"""Contract 2: cost file parsing and the group / pool / step time formulas, hand-computed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.cost import CostModel, allowed_degrees, fit_degrees, fit_levels, floor_level, pow2_divisor
from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
from balanced_loader.presets import HARDWARE, MODELS, analytic_cost, cost_preset, preset_names
from balanced_loader.simulate import lane_finish_ms, pool_ms, step_ms

DESIGN_EXAMPLE = """
quadratic_ms: 5.128e-6
linear_ms: 0.184
microbatch_ms: 629
comm_bytes_per_token: 2097152
bandwidth_gbs: {2: 119.5, 4: 104.1, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
max_tokens_per_lane: 5950
gpus_per_node: 8
strategies:
  - {tp: 4, pp: 1, quadratic_ms: 1.03e-6, linear_ms: 0.0565, microbatch_ms: 56.7, max_tokens_per_lane: 46000}
"""


@pytest.fixture
def cost(tmp_path) -> CostModel:
    p = tmp_path / "cost.yaml"
    p.write_text(DESIGN_EXAMPLE)
    return CostModel.from_file(str(p))


def test_group_time_matches_the_formula(cost):
    s = np.array([4096, 1000])
    d = 8
    expected = 629 + sum((5.128e-6 * x * x + 0.184 * x) / d + 2097152 * x / d / (96.5 * 1e6) for x in s)
    assert math.isclose(cost.group_ms(s, d), expected, rel_tol=1e-12)
    # d = 1: no communication term; bandwidth key is the largest <= d
    assert math.isclose(cost.group_ms([100], 1), 629 + 5.128e-6 * 1e4 + 18.4, rel_tol=1e-12)
    assert cost.base.bandwidth(12) == 96.5 and cost.base.bandwidth(64) == 4.87
    t4 = cost.shape(4, 1)
    assert t4.quadratic_ms == 1.03e-6 and t4.comm_bytes_per_token == 2097152 and t4.max_tokens_per_lane == 46000


def test_pool_time_is_1f1b_for_uniform_microbatches(cost):
    # one group spanning all lanes per microbatch, pp = 2: (m + pp - 1) * t / pp ... with t whole-model
    c = cost.replace(strategies=(*cost.strategies,
                                 cost.shape(1, 1).__class__(**{**_fields(cost.shape(1, 1)), "pp": 2})))
    m = 5
    g = Group(lanes=(0, 1), segments=((0, 0, 1000),))
    pool = Pool(tp=1, pp=2, ranks=single_pool_ranks(4, 1, 2), microbatches=tuple((g,) for _ in range(m)))
    t = c.shape(1, 2).group_ms([1000], 2)
    assert math.isclose(pool_ms(pool, c), (m + 2 - 1) * t / 2, rel_tol=1e-12)


def _fields(sc):
    return {k: getattr(sc, k) for k in sc.__slots__}


def test_lanes_run_ahead_and_groups_wait_for_all_lanes(cost):
    c = cost.replace(microbatch_ms=0.0, quadratic_ms=0.0, linear_ms=1.0, comm_bytes_per_token=0.0)
    mbs = (
        (Group(lanes=(0,), segments=((0, 0, 10),)), Group(lanes=(1,), segments=((1, 0, 30),))),
        (Group(lanes=(0, 1), segments=((2, 0, 40),)),),  # waits for lane 1 (30), then 40/2 = 20
        (Group(lanes=(0,), segments=((3, 0, 5),)),),
    )
    plan = StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=mbs),))
    finish, gmax = lane_finish_ms(plan.pools[0], c)
    assert finish.tolist() == [55.0, 50.0] and gmax == 30.0
    assert step_ms(plan, c) == 55.0


def test_strict_cost_file_errors(tmp_path):
    base = yaml.safe_load(DESIGN_EXAMPLE)
    bad = dict(base, quadratc_ms=1.0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['quadratc_ms'\]"):
        CostModel.from_dict(bad)
    missing = {k: v for k, v in base.items() if k != "linear_ms"}
    with pytest.raises(ValueError, match="missing key 'linear_ms'"):
        CostModel.from_dict(missing)
    with pytest.raises(ValueError, match="'microbatch_ms' must be a number"):
        CostModel.from_dict(dict(base, microbatch_ms="fast"))
    with pytest.raises(ValueError, match=r"strategies\[0\]: unknown key"):
        CostModel.from_dict(dict(base, strategies=[{"tp": 2, "pp": 1, "speed": 3}]))
    p = tmp_path / "c.yaml"
    p.write_text("a: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        CostModel.from_file(str(p))


def test_yaml_round_trip(cost, tmp_path):
    out = tmp_path / "again.yaml"
    cost.save(str(out))
    again = CostModel.from_file(str(out))
    assert again.to_dict() == cost.to_dict()
    assert again.shape(4, 1) == cost.shape(4, 1)


def test_presets_load_and_are_sane():
    names = [n for n in preset_names() if not n.startswith("analytic:")]
    names += ["analytic:tiny@cpu", "analytic:llama3-8b@h100", "analytic:llama2-7b@a800", "analytic:gpt-7b@a100-40g"]
    for name in names:
        c = cost_preset(name)
        assert any(s.usable for s in c.shapes(usable_only=False)), name
    f7 = cost_preset("flexsp-gpt7b-a100")
    assert f7.max_tokens_per_lane == 5950 and f7.comm_bytes_per_token == 2097152
    h = cost_preset("hydraulis-llama7b-a800")
    assert [(s.tp, s.pp) for s in h.shapes()] == [(1, 2), (4, 1), (8, 1)]
    with pytest.raises(ValueError, match="unknown cost preset"):
        cost_preset("nope")


def test_analytic_cost_orders_shapes_sensibly():
    c = analytic_cost(MODELS["llama3-8b"], HARDWARE["h100"], world_size=64)
    s1, s2 = c.shape(1, 1), c.shape(2, 1)
    assert s2.max_tokens_per_lane > s1.max_tokens_per_lane  # TP shards activations
    assert s2.linear_ms < s1.linear_ms and s2.quadratic_ms < s1.quadratic_ms
    big = analytic_cost(MODELS["llama3-8b"], HARDWARE["h200"], world_size=64)
    assert big.max_tokens_per_lane > c.max_tokens_per_lane  # more memory, more tokens
    # 7B-class fwd+bwd of 8K tokens on one H100 lands in the hundreds of ms
    assert 100 < s1.group_ms([8192], 1) < 2000


def test_allowed_degrees():
    assert allowed_degrees(12) == [1, 2, 4, 8]
    assert allowed_degrees(12, powers_of_two=False) == [1, 2, 3, 4, 6, 12]
    assert allowed_degrees(12, min_degree=4) == [4, 8]


@given(st.integers(1, 5000))
def test_power_of_two_helpers_match_their_definitions(n):
    assert floor_level(n) == max(v for v in range(14) if 2**v <= n)
    assert pow2_divisor(n) == max(2**v for v in range(14) if n % 2**v == 0)


@given(st.lists(st.integers(0, 5000), max_size=20), st.integers(1, 700), st.integers(1, 40))
def test_fit_degrees_and_levels_are_the_smallest_that_hold(lengths, cap, lanes):
    degrees = allowed_degrees(lanes)
    got = fit_degrees(lengths, cap, degrees)
    for s, d in zip(lengths, got):
        assert d == min((x for x in degrees if s <= x * cap), default=0)
    for s, v in zip(lengths, fit_levels(lengths, cap)):
        assert v == min(v2 for v2 in range(14) if s <= 2**v2 * cap)


def test_segment_time_takes_one_degree_per_segment(cost):
    sc = cost.base
    s = np.array([4096.0, 1000.0, 77.0])
    d = np.array([8.0, 1.0, 2.0])
    np.testing.assert_array_equal(sc.segment_ms(s, d), [sc.segment_ms(x, int(y)) for x, y in zip(s, d)])
