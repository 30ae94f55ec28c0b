"""simulate: equals the contract-2 cost model on random plans; bubbles, skew and MFU on hand-computed plans."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.outputs.files import write_text
from balanced_loader.plan import Group, Plan, Pool, StepPlan, plan_lengths
from balanced_loader.presets import HARDWARE, MODELS
from balanced_loader.simulate import (
    PoolArrays,
    lane_finish_ms,
    lane_schedule,
    lane_schedule_py,
    model_flops,
    placed_pool_ms,
    pool_ms,
    serial_pool_ms,
    simulate_plan,
    simulate_step,
    simulate_step_json,
    step_ms,
    summarize,
)

SHAPES = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4))


def random_cost(draw) -> CostModel:
    coef = st.floats(0.0, 1e-3)
    strategies = [{"tp": tp, "pp": pp, "quadratic_ms": draw(coef), "linear_ms": draw(st.floats(0.0, 0.5)),
                   "microbatch_ms": draw(st.floats(0.0, 50.0)), "max_tokens_per_lane": 10**6}
                  for tp, pp in SHAPES[1:]]
    return CostModel.from_dict({
        "quadratic_ms": draw(coef), "linear_ms": draw(st.floats(0.0, 0.5)),
        "microbatch_ms": draw(st.floats(0.0, 50.0)), "comm_bytes_per_token": draw(st.floats(0.0, 1e7)),
        "bandwidth_gbs": {2: draw(st.floats(1.0, 200.0)), 8: draw(st.floats(0.5, 50.0))},
        "max_tokens_per_lane": 10**6, "strategies": strategies,
    })


@st.composite
def random_plans(draw) -> tuple[CostModel, StepPlan]:
    cost = random_cost(draw)
    pools, offset, doc = [], 0, 0
    for _ in range(draw(st.integers(1, 3))):
        tp, pp = draw(st.sampled_from(SHAPES))
        lanes = draw(st.integers(1, 12))
        width = lanes * tp
        ranks = tuple(tuple(range(offset + s * width, offset + (s + 1) * width)) for s in range(pp))
        offset += width * pp
        mbs = []
        for _ in range(draw(st.integers(0, 5))):
            free = draw(st.permutations(range(lanes)))[: draw(st.integers(1, lanes))]
            groups, i = [], 0
            while i < len(free):
                d = draw(st.integers(1, len(free) - i))
                segs = []
                for s in draw(st.lists(st.integers(1, 40000), min_size=1, max_size=4)):
                    segs.append((doc, 0, s))
                    doc += 1
                groups.append(Group(lanes=tuple(free[i:i + d]), segments=tuple(segs)))
                i += d
            mbs.append(tuple(groups))
        bars = tuple(sorted(draw(st.sets(st.integers(1, len(mbs) - 1)))) if len(mbs) > 1 else ())
        pools.append(Pool(tp=tp, pp=pp, ranks=ranks, microbatches=tuple(mbs), barriers=bars))
    return cost, StepPlan(step=0, world_size=offset, pools=tuple(pools))


def reference_pool(pool: Pool, cost: CostModel) -> tuple[list[float], float, float]:
    """Contract 2 read literally, one group at a time: (lane finish, largest group ms, pool ms).
    A barrier before microbatch k: every lane of the pool starts it at the last lane's finish."""
    sc = cost.shape(pool.tp, pool.pp)
    finish = [0.0] * pool.num_lanes
    gmax = 0.0
    for k, mb in enumerate(pool.microbatches):
        if k in pool.barriers:
            finish = [max(finish)] * pool.num_lanes
        for g in mb:
            t = sc.group_ms([s[2] for s in g.segments], len(g.lanes))
            gmax = max(gmax, t)
            start = max(finish[x] for x in g.lanes)
            for x in g.lanes:
                finish[x] = start + t / pool.pp
    return finish, gmax, (max(finish) + (pool.pp - 1) * gmax / pool.pp) if gmax > 0 else 0.0


@given(random_plans())
def test_step_time_equals_the_cost_model(case):
    cost, plan = case
    m = simulate_step(plan, cost)
    refs = [reference_pool(pool, cost) for pool in plan.pools]
    ref = max((r[2] for r in refs), default=0.0)
    assert math.isclose(m.step_ms, ref, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(step_ms(plan, cost), ref, rel_tol=1e-9, abs_tol=1e-12)
    for pm, pool, (ref_finish, ref_gmax, ref_ms) in zip(m.pools, plan.pools, refs):
        assert math.isclose(pm.makespan_ms, ref_ms, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(pool_ms(pool, cost), ref_ms, rel_tol=1e-9, abs_tol=1e-12)
        if pool.microbatches:
            finish, gmax = lane_finish_ms(pool, cost)
            np.testing.assert_allclose(pm.lane_finish_ms, ref_finish, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(finish, ref_finish, rtol=1e-9, atol=1e-9)
            assert math.isclose(pm.max_group_ms, ref_gmax, rel_tol=1e-9)
            assert math.isclose(gmax, ref_gmax, rel_tol=1e-9)
    # every rank-ms is either busy or idle, and the bubbles are shares in [0, 1]
    assert 0 <= m.idle <= 1 and 0 <= m.pp_bubble <= 1 and 0 <= m.dp_bubble <= 1
    assert m.skew >= 1 - 1e-12
    # JSON fast path gives the same numbers
    j = simulate_step_json(plan.to_json(), plan.world_size, cost)
    assert j.to_json() == m.to_json()


@given(random_plans())
def test_lane_kernel_equals_its_reference(case):
    cost, plan = case
    for pool in plan.pools:
        arr = PoolArrays.from_pool(pool)
        gms = arr.group_ms(cost.shape(pool.tp, pool.pp))
        expect = [cost.group_ms([s[2] for s in g.segments], len(g.lanes), pool.tp, pool.pp)
                  for mb in pool.microbatches for g in mb]
        np.testing.assert_allclose(gms, expect, rtol=1e-12)
        a = lane_schedule(arr.lane_ptr, arr.lanes, gms, pool.pp, pool.num_lanes, arr.barrier_g)
        b = lane_schedule_py(arr.lane_ptr, arr.lanes, gms, pool.pp, pool.num_lanes, arr.barrier_g)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], rtol=1e-12)
        np.testing.assert_allclose(a[2], b[2], rtol=1e-9, atol=1e-9)


@given(random_plans())
def test_barriers_only_add_time(case):
    """Without its barriers a pool is never slower; the barrier wait is idle time inside the step."""
    cost, plan = case
    bare = StepPlan(step=0, world_size=plan.world_size, pools=tuple(
        Pool(tp=p.tp, pp=p.pp, ranks=p.ranks, microbatches=p.microbatches) for p in plan.pools))
    m, m0 = simulate_step(plan, cost), simulate_step(bare, cost)
    assert m.step_ms >= m0.step_ms * (1 - 1e-12)
    for pm, p0 in zip(m.pools, m0.pools):
        assert pm.makespan_ms >= p0.makespan_ms * (1 - 1e-12)
        np.testing.assert_allclose(pm.lane_busy_ms, p0.lane_busy_ms, rtol=1e-12)
        assert np.all(pm.lane_barrier_ms >= 0)
        # a lane's finish is its busy time plus its contract-2 waits: the barrier share never exceeds it
        assert np.all(pm.lane_barrier_ms <= pm.lane_finish_ms - pm.lane_busy_ms + 1e-6)
    assert 0 <= m.barrier_idle <= m.idle + 1e-12
    assert m0.barrier_idle == 0


def test_barrier_hand_computed():
    """Two lanes: mb 0 = a 100 ms group on lane 0, mb 1 = 10 ms groups on each lane. A barrier before
    mb 1 holds lane 1 back 100 ms (step 110 ms, not 110 vs 100 on the lanes: same step; lane 1 ends at 110)."""
    cost = CostModel.from_dict({"quadratic_ms": 0.0, "linear_ms": 1.0, "microbatch_ms": 0.0,
                                "comm_bytes_per_token": 0.0, "bandwidth_gbs": {2: 1.0},
                                "max_tokens_per_lane": 10**6})
    mbs = ((Group(lanes=(0,), segments=((0, 0, 100),)),),
           (Group(lanes=(0,), segments=((1, 0, 10),)), Group(lanes=(1,), segments=((2, 0, 10),))))
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=mbs, barriers=(1,))
    m = simulate_step(StepPlan(step=0, world_size=2, pools=(pool,)), cost)
    assert m.step_ms == 110.0
    np.testing.assert_allclose(m.pools[0].lane_finish_ms, [110.0, 110.0])
    np.testing.assert_allclose(m.rank_barrier_ms, [0.0, 100.0])
    assert math.isclose(m.barrier_idle, 100.0 / 220.0)
    bare = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=mbs)
    np.testing.assert_allclose(lane_finish_ms(bare, cost)[0], [110.0, 10.0])
    assert placed_pool_ms([(0,), (0,), (1,)], [100.0, 10.0, 10.0], 1, 2, barrier_groups=[1]) == 110.0


@given(random_plans())
def test_placed_groups_time_like_the_pool(case):
    cost, plan = case
    for pool in plan.pools:
        sc = cost.shape(pool.tp, pool.pp)
        groups = [g for mb in pool.microbatches for g in mb]
        gms = [sc.group_ms([s[2] for s in g.segments], g.degree) for g in groups]
        first = np.cumsum([0] + [len(mb) for mb in pool.microbatches])  # group index of each microbatch
        got = placed_pool_ms([g.lanes for g in groups], gms, pool.pp, pool.num_lanes,
                             barrier_groups=[int(first[k]) for k in pool.barriers])
        assert math.isclose(got, pool_ms(pool, cost), rel_tol=1e-9, abs_tol=1e-12)


@given(st.lists(st.integers(1, 30000), min_size=1, max_size=8), st.sampled_from(SHAPES[1:]), st.integers(1, 4))
def test_serial_closed_form_equals_the_lane_schedule(seq, shape, lanes):
    tp, pp = shape
    cost = CostModel.from_dict({"quadratic_ms": 1e-6, "linear_ms": 0.01, "microbatch_ms": 3.0,
                                "comm_bytes_per_token": 1e5, "bandwidth_gbs": {2: 50.0}, "max_tokens_per_lane": 10**6,
                                "strategies": [{"tp": tp, "pp": pp, "microbatch_ms": 7.0}]})
    sc = cost.shape(tp, pp)
    mbs = tuple((Group(lanes=tuple(range(lanes)), segments=((i, 0, s),)),) for i, s in enumerate(seq))
    pool = Pool(tp=tp, pp=pp, ranks=tuple(tuple(range(k * lanes * tp, (k + 1) * lanes * tp)) for k in range(pp)),
                microbatches=mbs)
    work = np.array([(sc.group_ms([s], lanes) - sc.microbatch_ms) / pp for s in seq])  # [v] per-stage work
    assert math.isclose(serial_pool_ms(work, pp, sc.microbatch_ms / pp), pool_ms(pool, cost), rel_tol=1e-9)


# ---- hand-computed plans -------------------------------------------------------------------

# 1 ms per token, nothing else: group time = tokens.
LINEAR = CostModel.from_dict({
    "quadratic_ms": 0.0, "linear_ms": 1.0, "microbatch_ms": 0.0, "comm_bytes_per_token": 0.0,
    "bandwidth_gbs": {2: 100.0}, "max_tokens_per_lane": 1000, "strategies": [{"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}],
})


def g(lanes, *lengths, doc=0):
    return Group(lanes=tuple(lanes), segments=tuple((doc + i, 0, s) for i, s in enumerate(lengths)))


def test_one_pool_bubble_and_skew_by_hand():
    # lane 0 runs 300 ms, lane 1 runs 100 ms: T = 300, mean busy 200
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0], 200, doc=0), g([1], 100, doc=1)),
                                                            (g([0], 100, doc=2),)))
    m = simulate_step(StepPlan(step=0, world_size=2, pools=(pool,)), LINEAR)
    assert m.step_ms == pytest.approx(300)
    assert m.pp_bubble == pytest.approx(1 - 200 / 300)
    assert m.dp_bubble == pytest.approx(0.0)
    assert m.idle == pytest.approx(1 - 400 / 600)
    assert m.skew == pytest.approx(1.5)
    assert m.tokens == 400 and m.tokens_per_s == pytest.approx(400 / 0.3)
    np.testing.assert_allclose(m.rank_busy_ms, [300, 100])


def test_two_pools_with_a_pipeline_by_hand():
    # pool A: 2 lanes, pp 1, ranks 0-1: 300 ms and 300 ms (busy 300 each), makespan 300
    a = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0], 300, doc=0), g([1], 300, doc=1)),))
    # pool B: 1 lane, pp 2, ranks 2 (stage 0) and 3 (stage 1): two microbatches of 100 tokens.
    # Each group occupies the lane 100 / 2 = 50 ms: finish 100, plus fill/drain (2-1)*100/2 = 50 -> 150.
    b = Pool(tp=1, pp=2, ranks=((2,), (3,)), microbatches=((g([0], 100, doc=2),), (g([0], 100, doc=3),)))
    m = simulate_step(StepPlan(step=5, world_size=4, pools=(a, b)), LINEAR)
    assert [p.makespan_ms for p in m.pools] == pytest.approx([300, 150])
    assert m.step_ms == pytest.approx(300)
    assert m.pools[0].pp_bubble == pytest.approx(0.0)
    assert m.pools[1].pp_bubble == pytest.approx(1 - 100 / 150)
    assert m.pp_bubble == pytest.approx((2 * 0.0 + 2 * (1 / 3)) / 4)
    assert m.dp_bubble == pytest.approx(1 - (2 * 300 + 2 * 150) / (4 * 300))
    assert m.idle == pytest.approx(1 - (300 + 300 + 100 + 100) / 1200)
    np.testing.assert_allclose(m.rank_busy_ms, [300, 300, 100, 100])
    assert m.skew == pytest.approx(300 / 200)
    # the three idle shares add up: idle = 1 - (1 - pp_bubble of pools weighted by N*M) ...
    busy = sum(p.num_ranks * p.makespan_ms * (1 - p.pp_bubble) for p in m.pools)
    assert 1 - busy / (4 * m.step_ms) == pytest.approx(m.idle)


def test_tp_ranks_share_their_lane_busy_time():
    pool = Pool(tp=2, pp=1, ranks=((3, 2, 1, 0),), microbatches=((g([0], 10), g([1], 30, doc=1)),))
    m = simulate_step(StepPlan(step=0, world_size=4, pools=(pool,)), LINEAR)
    # lane 0 = ranks 3, 2; lane 1 = ranks 1, 0
    np.testing.assert_allclose(m.rank_busy_ms, [30, 30, 10, 10])


def test_empty_step_and_empty_pool():
    empty = StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=()),))
    m = simulate_step(empty, LINEAR)
    assert (m.step_ms, m.pp_bubble, m.dp_bubble, m.skew, m.tokens) == (0.0, 0.0, 0.0, 1.0, 0)
    # a pool with no work in a step with work: all its ranks are idle, counted as dp bubble
    busy = Pool(tp=1, pp=1, ranks=((0,),), microbatches=((g([0], 50),),))
    idle = Pool(tp=1, pp=1, ranks=((1,),), microbatches=())
    m = simulate_step(StepPlan(step=0, world_size=2, pools=(busy, idle)), LINEAR)
    assert m.dp_bubble == pytest.approx(0.5) and m.pp_bubble == 0.0 and m.skew == pytest.approx(2.0)


def test_mfu_by_hand():
    model, hw = MODELS["tiny"], HARDWARE["cpu"]
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0, 1], 100, 20),),))
    m = simulate_step(StepPlan(step=0, world_size=2, pools=(pool,)), LINEAR, model=model, hardware=hw)
    flops = 6 * model.matmul_params * 120 + 6 * model.layers * model.hidden * (100**2 + 20**2)
    assert model_flops(model, 120, 100**2 + 20**2) == pytest.approx(flops)
    assert m.mfu == pytest.approx(flops / (m.step_ms / 1e3 * 2 * hw.peak_tflops * 1e12))
    s = summarize([m, m])
    assert s["mfu"] == pytest.approx(m.mfu) and s["steps"] == 2 and s["total_ms"] == pytest.approx(2 * m.step_ms)


def test_plan_lengths_are_the_furthest_segment_ends():
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=(
        (Group(lanes=(0,), segments=((4, 0, 10),)), Group(lanes=(1,), segments=((4, 10, 5), (1, 0, 3)))),))
    np.testing.assert_array_equal(plan_lengths([StepPlan(step=0, world_size=2, pools=(pool,))]), [0, 3, 0, 0, 15])


# ---- the command ---------------------------------------------------------------------------


def _write_plan(tmp_path, steps):
    p = tmp_path / "plan.json"
    write_text(str(p), Plan(policy="hand", world_size=steps[0].world_size, steps=tuple(steps)).dumps())
    c = tmp_path / "cost.yaml"
    LINEAR.save(str(c))
    return str(p), str(c)


def test_simulate_command_json(tmp_path, capsys):
    a = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0], 300, doc=0), g([1], 100, doc=1)),))
    steps = [StepPlan(step=k, world_size=2, pools=(a,), predicted_ms=300.0) for k in range(3)]
    plan, cost = _write_plan(tmp_path, steps)
    for extra in ([], ["--no-validate"]):
        assert cli.main(["simulate", plan, "--cost-file", cost, "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [s["step"] for s in out["steps"]] == [0, 1, 2]
        s0 = out["steps"][0]
        assert s0["step_ms"] == pytest.approx(300) and s0["skew"] == pytest.approx(1.5)
        assert s0["pp_bubble"] == pytest.approx(1 / 3) and s0["dp_bubble"] == pytest.approx(0)
        assert out["summary"]["steps"] == 3
    assert cli.main(["simulate", plan, "--cost-file", cost, "--model", "tiny", "--hardware", "cpu"]) == 0
    text = capsys.readouterr()
    assert "MFU" in text.out and "mean" in text.out and text.err == ""


def test_simulate_reports_a_predicted_time_from_another_cost_model(tmp_path, capsys):
    a = Pool(tp=1, pp=1, ranks=((0,),), microbatches=((g([0], 300),),))
    plan, cost = _write_plan(tmp_path, [StepPlan(step=0, world_size=1, pools=(a,), predicted_ms=999.0)])
    assert cli.main(["simulate", plan, "--cost-file", cost]) == 0
    assert "predicted_ms different" in capsys.readouterr().err


def test_simulate_validates_against_a_length_file(tmp_path, capsys):
    a = Pool(tp=1, pp=1, ranks=((0,),), microbatches=((g([0], 300),),))
    plan, cost = _write_plan(tmp_path, [StepPlan(step=0, world_size=1, pools=(a,))])
    ln = tmp_path / "l.txt"
    ln.write_text("400\n")
    assert cli.main(["simulate", plan, "--cost-file", cost, "--lengths", str(ln)]) == 2
    err = capsys.readouterr().err
    assert "fails validation" in err and "covers 300 of its 400" in err and len(err.strip().splitlines()) == 1


def test_simulate_plan_matches_step_by_step():
    a = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0, 1], 1000),),))
    steps = [StepPlan(step=k, world_size=2, pools=(a,)) for k in range(2)]
    ms = simulate_plan(Plan(policy="x", world_size=2, steps=tuple(steps)), LINEAR)
    assert [m.step for m in ms] == [0, 1] and ms[0].step_ms == pytest.approx(500)


def test_simulate_text_lists_pools_of_heterogeneous_steps(tmp_path, capsys):
    a = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([0], 300, doc=0), g([1], 300, doc=1)),))
    b = Pool(tp=1, pp=2, ranks=((2,), (3,)), microbatches=((g([0], 100, doc=2),), (g([0], 100, doc=3),)))
    plan, cost = _write_plan(tmp_path, [StepPlan(step=0, world_size=4, pools=(a, b))])
    assert cli.main(["simulate", plan, "--cost-file", cost]) == 0
    out = capsys.readouterr().out
    assert "pool 0 (tp1 pp1, 2 ranks): makespan 300.0 ms, pp_bubble 0.0%" in out
    assert "pool 1 (tp1 pp2, 2 ranks): makespan 150.0 ms, pp_bubble 33.3%" in out
