"""Contract 2 on clusters that are not uniform: device classes, rank classes and lane speeds in the cost
model (parsing, round trips, inherited and scaled strategies, lane profiles, bad input), and the
contract-2 group time of plans whose lanes are not alike (hand-computed), with per-class figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems, Group, Pool, StepPlan
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.simulate import PoolArrays, lane_finish_ms, simulate_step, step_ms

BASE = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 2e4,
        "bandwidth_gbs": {2: 100.0, 4: 50.0}, "max_tokens_per_lane": 64,
        "strategies": [{"tp": 2, "pp": 1, "quadratic_ms": 5e-5, "linear_ms": 0.005, "microbatch_ms": 0.5,
                        "max_tokens_per_lane": 128}]}
# "old": half as fast per token, a smaller cap, a cheaper microbatch; "new": the top level's keys
OLD = {"linear_ms": 0.02, "microbatch_ms": 0.25, "max_tokens_per_lane": 32}
CLUSTER = {**BASE, "device_classes": {"old": OLD, "new": {}},
           "rank_classes": [{"class": "new", "ranks": 2}, {"class": "old", "ranks": 2}],
           "lane_speed": {1: 0.5}}


def _cost(**extra) -> CostModel:
    return CostModel.from_dict({**BASE, **extra})


# ---- parsing and round trips ------------------------------------------------------------------


def test_cluster_keys_parse_and_round_trip_through_yaml_and_json():
    c = CostModel.from_dict(CLUSTER)
    assert c.class_names == ("old", "new") and not c.uniform
    assert c.rank_classes == (("new", 2), ("old", 2)) and c.lane_speed == ((1, 0.5),)
    assert CostModel.from_dict(c.to_dict()) == c
    assert CostModel.from_dict(yaml.safe_load(c.to_yaml())) == c
    # JSON writes every mapping key as a string (bandwidth degrees, lane_speed ranks): still the same model
    via_json = json.loads(json.dumps(c.to_dict()))
    assert "1" in via_json["lane_speed"] and "2" in via_json["bandwidth_gbs"]
    assert CostModel.from_dict(via_json) == c
    # a model without cluster keys writes none (old cost files stay byte-for-byte what they were)
    plain = _cost()
    assert not {"device_classes", "rank_classes", "lane_speed"} & set(plain.to_dict())
    assert plain.uniform and plain.device() is plain


def test_a_class_inherits_the_top_level_and_scales_its_strategies():
    c = CostModel.from_dict(CLUSTER)
    old, new = c.class_model("old"), c.class_model("new")
    top = c.device()
    assert new.base == top.base and new.shape(2, 1) == top.shape(2, 1)
    # keys the class lists replace the top level's; the others are inherited
    assert (old.linear_ms, old.microbatch_ms, old.max_tokens_per_lane) == (0.02, 0.25, 32)
    assert old.quadratic_ms == 1e-4 and old.comm_bytes_per_token == 2e4 and old.bandwidth_gbs == top.bandwidth_gbs
    # the tp=2 shape it does not list: the top level's, each key scaled by the class's base ratio
    s = old.shape(2, 1)
    assert s.linear_ms == pytest.approx(0.005 * 2) and s.microbatch_ms == pytest.approx(0.5 * 0.25)
    assert s.quadratic_ms == pytest.approx(5e-5) and s.max_tokens_per_lane == 64  # 128 * 32 / 64
    # a class with its own strategies keeps them as written
    own = CostModel.from_dict({**CLUSTER, "device_classes": {
        "old": {**OLD, "strategies": [{"tp": 2, "pp": 1, "linear_ms": 0.5}]}, "new": {}}})
    assert own.class_model("old").shape(2, 1).linear_ms == 0.5
    assert own.class_model("old").shape(2, 1).max_tokens_per_lane == 32  # inherited from the class's base
    assert c.class_model("") == top
    with pytest.raises(ValueError, match="unknown device class 'mid'"):
        c.class_model("mid")


def test_scaled_multiplies_every_time_key_and_keeps_caps():
    c = _cost()
    s = c.scaled(4.0)
    for sc, base in ((s.base, c.base), (s.shape(2, 1), c.shape(2, 1))):
        assert sc.quadratic_ms == pytest.approx(4 * base.quadratic_ms)
        assert sc.linear_ms == pytest.approx(4 * base.linear_ms)
        assert sc.microbatch_ms == pytest.approx(4 * base.microbatch_ms)
        assert sc.comm_bytes_per_token == pytest.approx(4 * base.comm_bytes_per_token)
        assert sc.max_tokens_per_lane == base.max_tokens_per_lane and sc.bandwidth_gbs == base.bandwidth_gbs
    # contract 2's formula / speed: a group at speed 0.25 takes 4x as long, communication included
    assert s.group_ms([40, 30], 2) == pytest.approx(4 * c.group_ms([40, 30], 2))
    assert c.scaled(1.0) is c


def test_rank_maps_speeds_and_with_helpers():
    c = CostModel.from_dict(CLUSTER)
    assert c.rank_class_index(4).tolist() == [1, 1, 0, 0]
    assert c.rank_speeds(4).tolist() == [1.0, 0.5, 1.0, 1.0]
    assert _cost().rank_class_index(3).tolist() == [0, 0, 0]
    sp = _cost().with_speeds([1.0, 0.25, 1.0])
    assert sp.lane_speed == ((1, 0.25),) and not sp.uniform
    assert _cost().with_speeds({2: 0.5}).rank_speeds(4).tolist() == [1, 1, 0.5, 1]
    assert _cost().with_speeds([1.0, 1.0]).uniform  # 1s are left out
    # speeds listed as 1.0 in a file are as if absent
    assert _cost(lane_speed={0: 1.0, 3: 1.0}).uniform
    wc = _cost().with_classes({"a": _cost(), "b": _cost().scaled(2.0)}, [("a", 3), ("b", 1)])
    assert wc.class_names == ("a", "b") and wc.rank_class_index(4).tolist() == [0, 0, 0, 1]
    assert wc.class_model("b").linear_ms == pytest.approx(0.02)
    assert CostModel.from_dict(wc.to_dict()) == wc
    with pytest.raises(ValueError, match="must be > 0"):
        _cost().with_speeds([1.0, 0.0])
    # a negative rank would index from the end of the world: refused, like in a cost file
    with pytest.raises(ValueError, match="lane_speed rank must be >= 0, got -1"):
        _cost().with_speeds({-1: 0.5})
    with pytest.raises(ValueError, match="lane_speed of rank 0 must be a number"):
        _cost().with_speeds({0: "slow"})
    assert _cost().with_speeds({np.int64(2): np.float32(0.5)}).lane_speed == ((2, 0.5),)


def test_lane_profile_speed_is_the_smallest_and_a_mixed_lane_the_slowest_key_by_key():
    c = CostModel.from_dict(CLUSTER)  # ranks 0, 1 new (rank 1 at half speed), ranks 2, 3 old
    p1 = c.lanes([[0, 1, 2, 3]], 1, 4)
    assert p1.cls.tolist() == [1, 1, 0, 0] and p1.speed.tolist() == [1.0, 0.5, 1.0, 1.0] and not p1.uniform
    p2 = c.lanes([[0, 1, 2, 3]], 2, 4)  # two tp=2 lanes: (0, 1) and (2, 3)
    assert p2.speed.tolist() == [0.5, 1.0] and p2.cls.tolist() == [1, 0]
    # tp=2 lanes (1, 2) mixing both classes: a third model, the slower value of every key, the smaller cap
    p3 = c.lanes([[1, 2, 0, 3]], 2, 4)
    assert p3.cls.tolist() == [2, 2] and len(p3.models) == 3
    mixed = p3.models[2]
    old, new = c.class_model("old"), c.class_model("new")
    for tp in (1, 2):
        m, o, n = mixed.shape(tp, 1), old.shape(tp, 1), new.shape(tp, 1)
        assert m.linear_ms == max(o.linear_ms, n.linear_ms) == o.linear_ms
        assert m.microbatch_ms == max(o.microbatch_ms, n.microbatch_ms) == n.microbatch_ms
        assert m.max_tokens_per_lane == min(o.max_tokens_per_lane, n.max_tokens_per_lane)
    # ranks_model: a lane's class model with its speed applied
    rm = c.ranks_model([0, 1], 4)
    assert rm.linear_ms == pytest.approx(new.linear_ms / 0.5) and rm.max_tokens_per_lane == new.max_tokens_per_lane
    # per-lane caps: None without classes, else each lane's class cap of the shape
    assert _cost(lane_speed={1: 0.5}).pool_lane_caps(1, 1, [[0, 1, 2, 3]], 4) is None
    assert c.pool_lane_caps(1, 1, [[0, 1, 2, 3]], 4).tolist() == [64, 64, 32, 32]
    assert c.pool_lane_caps(2, 1, [[1, 2, 0, 3]], 4).tolist() == [64, 64]  # mixed: min(128, 64)


# ---- bad input: one line naming the problem -------------------------------------------------------

CLASSES = {"device_classes": {"old": OLD}, "rank_classes": [{"class": "old", "ranks": 4}]}
BAD = {
    "speed 0": ({"lane_speed": {0: 0}}, "lane_speed of rank 0 must be > 0"),
    "speed nan": ({"lane_speed": {0: float("nan")}}, "lane_speed of rank 0 must be a finite number"),
    "speed negative": ({"lane_speed": {2: -0.5}}, "lane_speed of rank 2 must be > 0"),
    "speed over 1000": ({"lane_speed": {0: 1001}}, "must be <= 1000"),
    "speed not a number": ({"lane_speed": {0: "fast"}}, "must be a number"),
    "speed bool": ({"lane_speed": {0: True}}, "must be a number"),
    "speed rank negative": ({"lane_speed": {-1: 0.5}}, "lane_speed key must be >= 0"),
    "speed not a mapping": ({"lane_speed": [0.5, 1.0]}, "'lane_speed' must be a mapping"),
    "unknown class": ({**CLASSES, "rank_classes": [{"class": "new", "ranks": 4}]}, "unknown device class 'new'"),
    "rank_classes alone": ({"rank_classes": [{"class": "old", "ranks": 4}]}, "there is no 'device_classes'"),
    "device_classes alone": ({"device_classes": {"old": OLD}}, "needs 'rank_classes'"),
    "zero ranks": ({**CLASSES, "rank_classes": [{"class": "old", "ranks": 0}]}, "'ranks' must be >= 1"),
    "class key negative": ({**CLASSES, "device_classes": {"old": {"linear_ms": -1}}}, "'linear_ms' must be >= 0"),
    "class unknown key": ({**CLASSES, "device_classes": {"old": {"gpus_per_node": 4}}}, "unknown key"),
    "class not a mapping": ({**CLASSES, "device_classes": {"old": 3}}, "expected a mapping"),
    "rank_classes empty": ({**CLASSES, "rank_classes": []}, "'rank_classes' must be a list"),
    "speed rank twice": ({"lane_speed": {0: 0.5, "0": 0.7}}, "lane_speed lists rank 0 twice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cluster_keys_are_one_line(case):
    extra, needle = BAD[case]
    with pytest.raises(ValueError) as e:
        CostModel.from_dict({**BASE, **extra})
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_world_mismatches_are_one_line_at_plan_time():
    items = BatchItems.from_lengths([10, 20, 30])
    few = CostModel.from_dict({**BASE, **CLASSES, "rank_classes": [{"class": "old", "ranks": 2}]})
    with pytest.raises(ValueError, match="rank_classes covers 2 ranks but the world has 4"):
        make_plan(items, few, PlanConfig(policy="greedy", world_size=4))
    outside = _cost(lane_speed={7: 0.5})
    with pytest.raises(ValueError, match=r"lane_speed lists rank 7 but the world has 4 ranks \(0..3\)"):
        make_plan(items, outside, PlanConfig(policy="hydra", world_size=4))
    with pytest.raises(ValueError, match="needs the plan's world size"):
        lane_finish_ms(_pool([[0, 1]], [[Group(lanes=(0,), segments=((0, 0, 10),))]]), outside)


def _cost_file(tmp_path, name: str, extra: dict) -> str:
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({**BASE, **extra}))
    return str(p)


CLI_BAD = {
    "speed 0": ({"lane_speed": {1: 0}}, "lane_speed of rank 1 must be > 0"),
    "speed negative": ({"lane_speed": {1: -2}}, "must be > 0"),
    "unknown class": ({**CLASSES, "rank_classes": [{"class": "h100", "ranks": 4}]}, "unknown device class 'h100'"),
    "coverage": ({**CLASSES, "rank_classes": [{"class": "old", "ranks": 3}]}, "covers 3 ranks but the world has 4"),
    "speed rank outside": ({"lane_speed": {9: 0.5}}, "lane_speed lists rank 9"),
}


@pytest.mark.parametrize("case", sorted(CLI_BAD))
def test_plan_cli_bad_cluster_cost_file_exits_2_with_one_line(case, tmp_path, capsys):
    extra, needle = CLI_BAD[case]
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n30\n40\n")
    rc = cli.main(["plan", "--lengths", str(lengths), "--world-size", "4", "--policy", "hydra",
                   "--cost-file", _cost_file(tmp_path, "bad", extra), "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and needle in lines[0], err


def test_plan_cli_entry_point_prints_no_traceback_for_a_bad_speed(tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n")
    r = subprocess.run([sys.executable, "-m", "balanced_loader", "plan", "--lengths", str(lengths),
                        "--world-size", "2", "--policy", "greedy", "--cost-file",
                        _cost_file(tmp_path, "nan", {"lane_speed": {0: float("nan")}})],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "finite number" in r.stderr, r.stderr


# ---- simulate: contract-2 time on lanes that are not alike, by hand ---------------------------------


def _pool(ranks, microbatches, tp: int = 1) -> Pool:
    return Pool(tp=tp, pp=1, ranks=tuple(tuple(r) for r in ranks),
                microbatches=tuple(tuple(mb) for mb in microbatches))


def _formula(keys: dict, lengths, d: int) -> float:
    """Contract 2 by hand (the bandwidth key: the largest <= d)."""
    bw = max((v for k, v in keys["bandwidth_gbs"].items() if k <= d), default=min(keys["bandwidth_gbs"].values()))
    t = keys["microbatch_ms"]
    for s in lengths:
        t += (keys["quadratic_ms"] * s * s + keys["linear_ms"] * s) / d
        if d > 1:
            t += keys["comm_bytes_per_token"] * s / d / (bw * 1e6)
    return t


# mb 0: A = doc 0 (40 tok) on lanes 0, 1 (CP spanning the slow lane 1); B = doc 1 (30) on lane 2; C = doc 2 on 3
# mb 1: D = docs 3, 4 on lane 0; E = doc 5 (50 tok) on lanes 2, 3
A = Group(lanes=(0, 1), segments=((0, 0, 40),))
B = Group(lanes=(2,), segments=((1, 0, 30),))
C = Group(lanes=(3,), segments=((2, 0, 20),))
D = Group(lanes=(0,), segments=((3, 0, 10), (4, 0, 12)))
E = Group(lanes=(2, 3), segments=((5, 0, 50),))
HAND = StepPlan(step=0, world_size=4, pools=(_pool([[0, 1, 2, 3]], [[A, B, C], [D, E]]),))
HAND_LENGTHS = [40, 30, 20, 10, 12, 50]


def test_uniform_cost_times_are_the_formula_and_speeds_of_one_change_nothing():
    c = _cost()
    t = {"A": _formula(BASE, [40], 2), "B": _formula(BASE, [30], 1), "C": _formula(BASE, [20], 1),
         "D": _formula(BASE, [10, 12], 1), "E": _formula(BASE, [50], 2)}
    m = simulate_step(HAND, c)
    # lanes: 0 runs A then D; 1 runs A; 2 runs B then E; 3 runs C then E (E starts when lane 2 and 3 are free)
    e_start = max(t["B"], t["C"])
    assert m.rank_busy_ms.tolist() == pytest.approx([t["A"] + t["D"], t["A"], t["B"] + t["E"], t["C"] + t["E"]])
    assert m.step_ms == pytest.approx(max(t["A"] + t["D"], e_start + t["E"]))
    assert m.classes == {}
    ones = _cost(lane_speed={0: 1.0, 1: 1.0})
    m1 = simulate_step(HAND, ones)
    assert m1.step_ms == m.step_ms and m1.rank_busy_ms.tolist() == m.rank_busy_ms.tolist() and m1.classes == {}


def test_a_group_takes_the_time_of_its_slowest_lane():
    c = _cost(lane_speed={1: 0.5, 3: 0.8})
    t = {"A": _formula(BASE, [40], 2) / 0.5, "B": _formula(BASE, [30], 1), "C": _formula(BASE, [20], 1) / 0.8,
         "D": _formula(BASE, [10, 12], 1), "E": _formula(BASE, [50], 2) / 0.8}
    arr = PoolArrays.from_pool(HAND.pools[0])
    assert arr.times(c, 1, 1, np.asarray([[0, 1, 2, 3]]), 4).tolist() == pytest.approx(
        [t["A"], t["B"], t["C"], t["D"], t["E"]])
    m = simulate_step(HAND, c)
    e_start = max(t["B"], t["C"])
    assert m.rank_busy_ms.tolist() == pytest.approx([t["A"] + t["D"], t["A"], t["B"] + t["E"], t["C"] + t["E"]])
    assert m.step_ms == pytest.approx(max(t["A"] + t["D"], e_start + t["E"]))
    assert step_ms(HAND, c) == pytest.approx(m.step_ms)
    # lane speeds only: one figure over every rank, with the slowest speed
    assert set(m.classes) == {"all"} and m.classes["all"]["min_speed"] == 0.5 and m.classes["all"]["ranks"] == 4
    HAND.validate(HAND_LENGTHS, c)


def test_device_classes_time_each_lane_by_its_class_and_figures_per_class():
    c = CostModel.from_dict(CLUSTER)  # ranks 0, 1 new (rank 1 at 0.5), ranks 2, 3 old
    old = {**BASE, **OLD}
    t = {"A": _formula(BASE, [40], 2) / 0.5, "B": _formula(old, [30], 1), "C": _formula(old, [20], 1),
         "D": _formula(BASE, [10, 12], 1), "E": _formula(old, [50], 2)}
    m = simulate_step(HAND, c)
    e_start = max(t["B"], t["C"])
    assert m.rank_busy_ms.tolist() == pytest.approx([t["A"] + t["D"], t["A"], t["B"] + t["E"], t["C"] + t["E"]])
    assert m.step_ms == pytest.approx(max(t["A"] + t["D"], e_start + t["E"]))
    assert set(m.classes) == {"old", "new"}
    assert m.classes["new"]["ranks"] == 2 and m.classes["new"]["min_speed"] == 0.5
    assert m.classes["old"]["mean_busy_ms"] == pytest.approx((t["B"] + t["C"]) / 2 + t["E"])
    assert m.classes["old"]["busy_share"] == pytest.approx(m.classes["old"]["mean_busy_ms"] / m.step_ms)
    assert "classes" in m.to_json() and "classes" not in simulate_step(HAND, _cost()).to_json()


def test_a_mixed_class_lane_uses_the_slowest_keys():
    # tp=2 lanes: lane 0 = ranks (0, 1) new; lane 1 = ranks (2, 3), rank 3 old: the mixed lane's keys are the
    # larger linear_ms (old's) and the larger microbatch_ms (new's), at tp=2
    c = CostModel.from_dict({**CLUSTER, "rank_classes": [{"class": "new", "ranks": 3}, {"class": "old", "ranks": 1}],
                             "lane_speed": {}})
    g0 = Group(lanes=(0,), segments=((0, 0, 60),))
    g1 = Group(lanes=(1,), segments=((1, 0, 60),))
    plan = StepPlan(step=0, world_size=4, pools=(_pool([[0, 1, 2, 3]], [[g0, g1]], tp=2),))
    tp2 = BASE["strategies"][0]
    new_keys = {**BASE, **tp2}
    old_tp2 = c.class_model("old").shape(2, 1)
    mixed = {**new_keys, "linear_ms": max(old_tp2.linear_ms, tp2["linear_ms"]),
             "microbatch_ms": max(old_tp2.microbatch_ms, tp2["microbatch_ms"]),
             "quadratic_ms": max(old_tp2.quadratic_ms, tp2["quadratic_ms"])}
    assert mixed["linear_ms"] == old_tp2.linear_ms and mixed["microbatch_ms"] == tp2["microbatch_ms"]
    m = simulate_step(plan, c)
    assert m.rank_busy_ms.tolist() == pytest.approx([_formula(new_keys, [60], 1)] * 2 + [_formula(mixed, [60], 1)] * 2)
    # memory: the mixed lane holds the smaller cap (old's 64 at tp=2, not new's 128)
    plan.validate([60, 60], c)
    big = Group(lanes=(1,), segments=((1, 0, 60), (2, 0, 20)))
    over = StepPlan(step=0, world_size=4, pools=(_pool([[0, 1, 2, 3]], [[g0, big]], tp=2),))
    with pytest.raises(ValueError, match="exceed max_tokens_per_lane 64"):
        over.validate([60, 60, 20], c)
    over.validate([60, 60, 20], c.device())  # 80 <= 128: fine on alike lanes


def _one_group(lanes, tokens: int) -> StepPlan:
    return StepPlan(step=0, world_size=4,
                    pools=(_pool([[0, 1, 2, 3]], [[Group(lanes=lanes, segments=((0, 0, tokens),))]]),))


def test_validate_checks_every_lane_with_its_class_cap():
    c = CostModel.from_dict(CLUSTER)  # caps: lanes 0, 1 new 64, lanes 2, 3 old 32
    _one_group((1,), 60).validate([60], c)
    with pytest.raises(ValueError, match="exceed max_tokens_per_lane 32"):
        _one_group((2,), 60).validate([60], c)
    # a CP group spanning both classes holds the smaller cap on each of its lanes: 2 x 32
    span = _one_group((1, 2), 70)
    with pytest.raises(ValueError, match=r"exceed max_tokens_per_lane 32 \(x2\)"):
        span.validate([70], c)
    span.validate([70], c.device())
    assert math.isfinite(step_ms(span, c))
