"""Traces: the group-start kernel, plan traces equal simulate's schedule, the measured-records writer, the CLI."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from pngcheck import assert_png
from test_simulate import random_plans

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.diagnostics.trace import TraceRecord, plan_trace, read_trace, trace_events, write_trace
from balanced_loader.outputs.files import write_text
from balanced_loader.plan import BatchItems, Group, Plan, Pool, StepPlan
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.presets import cost_preset
from balanced_loader.simulate import (
    PoolArrays,
    group_schedule,
    group_schedule_py,
    lane_schedule,
    simulate_step,
)

EPS_US = 1e-6  # slack for float sums; ts/dur are rounded to 1e-3 us

COST = cost_preset("hydra-gpt7b-a100")
HYD = cost_preset("hydraulis-llama7b-a800")


def check_trace(trace: dict) -> dict:
    """Structural checks every trace must pass; returns per-track X slices ``{(pid, tid): [event]}``."""
    trace = json.loads(json.dumps(trace, allow_nan=False))  # plain JSON, no NaN or Infinity
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["format"] == "balanced-loader/trace"
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    named = set()
    for e in trace["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            if e["name"] == "thread_name":
                named.add((e["pid"], e["tid"]))
            continue
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["args"], dict) and e["cat"]
            tracks[(e["pid"], e["tid"])].append(e)
        else:
            assert e["ph"] in ("i", "s", "f"), e
    assert set(tracks) <= named  # every track with slices has a name
    for key, evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], e["dur"]))
        for a, b in zip(evs, evs[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - EPS_US, (key, a, b)  # no overlap on a track
    # flows: each start has its finish, both inside a slice of their track
    ends: dict[int, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "f"):
            ends[e["id"]].append(e)
            assert any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in tracks[(e["pid"], e["tid"])])
    assert all(sorted(x["ph"] for x in v) == ["f", "s"] for v in ends.values())
    return tracks


def rank_figures(trace: dict, world: int) -> tuple[dict, dict, dict]:
    """``{step: [world] compute ms}``, ``{step: [world] wait ms}``, ``{step: (start ms, end ms)}`` from a trace."""
    busy: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(world))
    wait: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(world))
    spans = {}
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        if e["cat"] == "step":
            spans[e["args"]["step"]] = (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
        elif e["cat"] in ("compute", "wait"):
            (busy if e["cat"] == "compute" else wait)[e["args"]["step"]][e["tid"]] += e["dur"] / 1e3
    return busy, wait, spans


def check_equals_simulate(steps: list[StepPlan], cost) -> dict:
    """The plan trace's slices are simulate's schedule: busy and wait per rank, steps end to end."""
    trace = plan_trace(steps, cost)
    tracks = check_trace(trace)
    world = max(sp.world_size for sp in steps)
    busy, wait, spans = rank_figures(trace, world)
    offset = 0.0
    for sp in steps:
        m = simulate_step(sp, cost)
        tol = 1e-6 * max(m.step_ms + offset, 1.0)
        np.testing.assert_allclose(busy[sp.step], m.rank_busy_ms, rtol=0, atol=tol)
        np.testing.assert_allclose(wait[sp.step], m.rank_barrier_ms, rtol=0, atol=tol)
        if m.step_ms > 1e-6:  # a step under a nanosecond is an instant (no span)
            a, b = spans[sp.step]
            assert abs(a - offset) <= tol and abs(b - (offset + m.step_ms)) <= tol  # each step starts at the last's end
            last = max((e["ts"] + e["dur"]) / 1e3 for evs in tracks.values() for e in evs
                       if e["args"].get("step") == sp.step and e["cat"] == "compute")
            assert abs(last - (offset + m.step_ms)) <= tol  # step_ms = the end of the last slice
        else:
            assert sp.step not in spans
        offset += m.step_ms
    return trace


# ---------------------------------------------------------------------------------------------
# the group-start kernel
# ---------------------------------------------------------------------------------------------


@given(random_plans())
def test_group_schedule_kernel_equals_reference_and_lane_schedule(case):
    cost, plan = case
    for pool in plan.pools:
        arr = PoolArrays.from_pool(pool)
        gms = arr.group_ms(cost.shape(pool.tp, pool.pp))  # [G]
        args = (arr.lane_ptr, arr.lanes, gms, pool.pp, pool.num_lanes, arr.barrier_g)
        start, arrive, release = group_schedule(*args)
        ref = group_schedule_py(*args)
        for x, y in zip((start, arrive, release), ref):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-9)
        finish, busy, wait = lane_schedule(*args)
        end = np.zeros(pool.num_lanes)
        dur = np.zeros(pool.num_lanes)
        for g in range(len(gms)):
            for lane in arr.lanes[arr.lane_ptr[g]:arr.lane_ptr[g + 1]]:
                end[lane] = max(end[lane], start[g] + gms[g] / pool.pp)
                dur[lane] += gms[g] / pool.pp
        if release.size:
            end = np.maximum(end, release.max())
        np.testing.assert_allclose(end, finish, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(dur, busy, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose((release[:, None] - arrive).sum(axis=0), wait, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# plan traces
# ---------------------------------------------------------------------------------------------


@given(random_plans())
def test_plan_trace_equals_simulate_on_random_plans(case):
    cost, plan = case
    check_equals_simulate([plan, plan.with_step(1)], cost)


def g(lanes, *lengths, doc=0):
    return Group(lanes=tuple(lanes), segments=tuple((doc + i, 0, n) for i, n in enumerate(lengths)))


def hand_plan() -> StepPlan:
    """A pipeline pool (tp1 pp2, 3 lanes, a barrier before microbatch 2) beside a tp2 pool of 2 lanes."""
    pipe = Pool(tp=1, pp=2, ranks=((0, 1, 2), (3, 4, 5)), barriers=(2,), microbatches=(
        (g([0, 1], 6000, doc=0), g([2], 1000, doc=1)),
        (g([2], 3000, doc=2),),
        (g([0], 500, doc=3), g([1, 2], 2000, doc=4)),
    ))
    wide = Pool(tp=2, pp=1, ranks=((6, 7, 8, 9),), microbatches=(
        (g([0, 1], 9000, doc=5),),
        (g([0], 2500, 700, doc=6), g([1], 4000, doc=8)),
    ))
    return StepPlan(step=0, world_size=10, pools=(pipe, wide))


def test_pipeline_stages_barriers_and_tracks_of_a_hand_plan():
    cost = CostModel.from_dict({
        "quadratic_ms": 1e-6, "linear_ms": 0.1, "microbatch_ms": 20, "comm_bytes_per_token": 1e5,
        "bandwidth_gbs": {2: 100.0}, "max_tokens_per_lane": 10**5, "strategies": [
            {"tp": 1, "pp": 2, "quadratic_ms": 2e-6, "linear_ms": 0.2, "microbatch_ms": 30,
             "max_tokens_per_lane": 10**5},
            {"tp": 2, "pp": 1, "quadratic_ms": 5e-7, "linear_ms": 0.05, "microbatch_ms": 10,
             "max_tokens_per_lane": 10**5}]})
    sp = hand_plan()
    trace = check_equals_simulate([sp, sp.with_step(1)], cost)
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["pool 0 (tp1 pp2) stage 0", "pool 0 (tp1 pp2) stage 1", "pool 1 (tp2 pp1)",
                                      "steps"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert sorted(t for (p, t), n in threads.items() if n.startswith("rank")) == list(range(10))
    stage_of = {r: 0 for r in (0, 1, 2)} | {r: 1 for r in (3, 4, 5)}
    assert all(procs[p] == f"pool 0 (tp1 pp2) stage {stage_of[t]}" for (p, t) in threads if t in stage_of)
    comp = [e for e in ev if e["ph"] == "X" and e["cat"] == "compute" and e["args"]["step"] == 0]
    # stage 1 runs stage 0's schedule max_g t(g) / pp later, for time(g) / pp each
    gmax = max(cost.group_ms([s[2] for s in grp.segments], grp.degree, 1, 2)
               for mb in sp.pools[0].microbatches for grp in mb)
    by = {(e["args"]["microbatch"], e["args"]["group"], e["tid"]): e for e in comp if e["args"]["pool"] == 0}
    for (k, gi, r), e in by.items():
        if r < 3:
            lane_peer = by[(k, gi, r + 3)]
            assert lane_peer["ts"] == pytest.approx(e["ts"] + gmax / 2 * 1e3, abs=1e-3)
            assert lane_peer["dur"] == pytest.approx(e["dur"], abs=2e-3)
            grp = sp.pools[0].microbatches[k][gi]
            assert e["dur"] / 1e3 == pytest.approx(cost.group_ms([s[2] for s in grp.segments], grp.degree, 1, 2) / 2)
    e = by[(0, 0, 0)]["args"]
    assert e["docs"] == [{"doc_id": 0, "start": 0, "length": 6000}] and e["degree"] == 2 and e["lanes"] == [0, 1]
    assert e["ranks"] == [0, 1] and by[(0, 0, 3)]["args"]["ranks"] == [3, 4] and e["tp"] == 1 and e["pp"] == 2
    # tp ranks of a lane share its slices; the tp2 pool's group on lanes [0, 1] lists all four ranks
    wide = [e for e in comp if e["args"]["pool"] == 1 and e["args"]["microbatch"] == 0]
    assert sorted(e["tid"] for e in wide) == [6, 7, 8, 9] and wide[0]["args"]["ranks"] == [6, 7, 8, 9]
    bars = [e for e in ev if e["ph"] == "i" and e["cat"] == "barrier"]
    assert len(bars) == 4 and {b["args"]["microbatch"] for b in bars} == {2}  # per step and stage
    waits = [e for e in ev if e["ph"] == "X" and e["cat"] == "wait" and e["args"]["step"] == 0]
    assert waits and all(e["name"] == "barrier wait" for e in waits)
    flows = [e for e in ev if e["ph"] == "s"]
    assert len(flows) == 2 * 5  # one arrow per group of the pipeline pool per step
    steps = [e for e in ev if e["ph"] == "X" and e["cat"] == "step"]
    assert [s["args"]["step"] for s in steps] == [0, 1] and "skew" in steps[0]["args"]
    pools = [e for e in ev if e["ph"] == "X" and e["cat"] == "pool"]
    assert len(pools) == 4 and all("makespan_ms" in p["args"] for p in pools)


def test_plans_of_policies_with_barriers_pipelines_and_pools():
    lengths = [30000, 9000, 6000, 6000, 3000, 12000, 500, 800, 7000, 16000]
    dcp = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="mcore-dcp", world_size=8))
    assert dcp.pools[0].barriers  # Megatron-Core's rounds
    trace = check_equals_simulate([dcp], COST)
    assert any(e["ph"] == "i" and e["cat"] == "barrier" for e in trace["traceEvents"])
    small = [9000, 6000, 6000, 3000, 10000, 500, 800, 7000, 11000]
    pipe = make_plan(BatchItems.from_lengths(small), HYD, PlanConfig(policy="maxlen", world_size=8, tp=1, pp=2))
    assert pipe.pools[0].pp == 2
    check_equals_simulate([pipe], HYD)
    hyd = make_plan(BatchItems.from_lengths(small * 3), HYD, PlanConfig(policy="hydraulis", world_size=16))
    assert len(hyd.pools) > 1
    pipe16 = make_plan(BatchItems.from_lengths(small), HYD, PlanConfig(policy="maxlen", world_size=16, tp=1, pp=2),
                       step=1)
    trace = check_equals_simulate([hyd, pipe16], HYD)  # pools change between steps: one "ranks" process
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"steps", "ranks"}


def test_an_empty_step_has_no_slices():
    empty = StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=()),))
    one = StepPlan(step=1, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((g([1], 10),),)),))
    trace = check_equals_simulate([empty, one], COST)
    assert [e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"] == [1]


# ---------------------------------------------------------------------------------------------
# measured records
# ---------------------------------------------------------------------------------------------


def test_measured_records_write_the_same_format(tmp_path):
    t = 1000.0  # seconds on the ranks' shared clock
    seg = ((4, 0, 100), (9, 20, 50))
    recs = [
        TraceRecord(rank=0, step=3, kind="pull", start_s=t, end_s=t + 0.010),
        TraceRecord(rank=1, step=3, kind="pull", start_s=t, end_s=t + 0.012),
        *[TraceRecord(rank=r, step=3, start_s=t + 0.012, end_s=t + 0.050, microbatch=0, group=0, pool=0, stage=0,
                      tp=1, pp=1, lanes=(0, 1), ranks=(0, 1), segments=seg, args={"predicted_ms": 35.0})
          for r in (0, 1)],
        TraceRecord(rank=0, step=3, kind="wait", start_s=t + 0.050, end_s=t + 0.061, pool=0, stage=0, tp=1, pp=1),
        TraceRecord(rank=1, step=3, kind="compute", start_s=t + 0.050, end_s=t + 0.061, microbatch=1, group=0,
                    pool=0, stage=0, tp=1, pp=1, lanes=(1,), ranks=(1,), segments=((5, 0, 30),)),
        TraceRecord(rank=0, step=3, kind="barrier", start_s=t + 0.061, end_s=t + 0.061, pool=0, stage=0, tp=1, pp=1),
        *[TraceRecord(rank=r, step=3, kind=k, start_s=t + a, end_s=t + b, pool=0, stage=0, tp=1, pp=1)
          for r in (0, 1) for k, a, b in (("push", 0.061, 0.070), ("optimizer", 0.070, 0.075))],
    ]
    path = write_trace(str(tmp_path / "trace.json"), recs, world_size=3, step_args={3: {"measured_ms": 75.0}},
                       meta={"source": "measured", "run": "x"})
    trace = read_trace(path)
    tracks = check_trace(trace)
    assert trace["otherData"]["source"] == "measured"
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"steps", "pool 0 (tp1 pp1)", "ranks"}  # rank 2 had no records: its own track, idle
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert [names[r] for r in range(3)] == ["rank 0", "rank 1", "rank 2"]
    mb = next(e for e in tracks[(1, 0)] if e["cat"] == "compute")
    assert mb["name"] == "mb0 d2" and mb["ts"] == pytest.approx(12000.0) and mb["dur"] == pytest.approx(38000.0)
    assert mb["args"]["docs"] == [{"doc_id": 4, "start": 0, "length": 100}, {"doc_id": 9, "start": 20, "length": 50}]
    assert mb["args"]["tokens"] == 150 and mb["args"]["predicted_ms"] == 35.0 and mb["args"]["degree"] == 2
    assert [e["cat"] for e in tracks[(1, 0)]] == ["pull", "compute", "wait", "push", "optimizer"]
    inst = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(inst) == 1 and inst[0]["name"] == "barrier" and inst[0]["tid"] == 0
    step = next(e for e in trace["traceEvents"] if e.get("cat") == "step")
    assert step["ts"] == 0 and step["dur"] == pytest.approx(75000.0) and step["args"]["measured_ms"] == 75.0
    # an explicit origin shifts every slice
    shifted = trace_events(recs, t0_s=t - 1.0)
    assert min(e["ts"] for e in shifted if e["ph"] == "X") == pytest.approx(1e6)


@pytest.mark.parametrize("kw", [dict(start_s=1.0, end_s=0.5), dict(start_s=float("nan"), end_s=1.0),
                                dict(rank=-2), dict(rank=-1), dict(kind="")])
def test_bad_records_are_one_value_error(kw):
    with pytest.raises(ValueError, match="trace record"):
        TraceRecord(**{"rank": 0, "step": 0, "start_s": 0.0, "end_s": 1.0, **kw})


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path):
    lengths = [30000, 9000, 6000, 6000, 3000, 12000, 500, 800, 7000, 16000]
    sp = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="mcore-dcp", world_size=8))
    path = tmp_path / "plan.json"
    write_text(str(path), Plan(policy="mcore-dcp", world_size=8, steps=(sp, sp.with_step(1))).dumps())
    return str(path)


def test_trace_command_writes_json_and_png(plan_file, tmp_path, capsys):
    out, png = str(tmp_path / "p.trace.json"), str(tmp_path / "p.png")
    assert cli.main(["trace", plan_file, "--cost", "hydra-gpt7b-a100", "--out", out, "--png", png,
                     "--steps", "1"]) == 0
    trace = read_trace(out)
    check_trace(trace)
    assert {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "compute"} == {1}
    assert trace["otherData"]["policy"] == "mcore-dcp" and trace["otherData"]["steps"] == [1]
    assert_png(png)
    again = str(tmp_path / "again.png")  # a trace file (e.g. a measured run's) drawn as it is
    assert cli.main(["trace", out, "--png", again]) == 0
    assert_png(again)
    assert "wrote" in capsys.readouterr().out


CASES = {
    "missing plan": (["trace", "{nofile}", "--cost", "hydra-gpt7b-a100", "--out", "{out}"], "cannot read plan file"),
    "bad cost file": (["trace", "{plan}", "--cost-file", "{badcost}", "--out", "{out}"], "missing key"),
    "unknown cost preset": (["trace", "{plan}", "--cost", "nope", "--out", "{out}"], "unknown cost preset"),
    "no cost": (["trace", "{plan}", "--out", "{out}"], "a cost model is needed"),
    "nothing to write": (["trace", "{plan}", "--cost", "hydra-gpt7b-a100"], "nothing to write"),
    "bad --steps": (["trace", "{plan}", "--cost", "hydra-gpt7b-a100", "--out", "{out}", "--steps", "a-b"],
                    "--steps"),
    "steps not in plan": (["trace", "{plan}", "--cost", "hydra-gpt7b-a100", "--out", "{out}", "--steps", "7-9"],
                          "has none of these steps"),
    "not a plan": (["trace", "{notplan}", "--cost", "hydra-gpt7b-a100", "--out", "{out}"], "not a plan"),
    "trace with --out": (["trace", "{trace}", "--out", "{out}", "--png", "{out}.png"], "is a trace file already"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trace_command_bad_input_one_line_exit_2(case, plan_file, tmp_path, capsys):
    files = {"nofile": str(tmp_path / "nope.json"), "plan": plan_file, "out": str(tmp_path / "o.json")}
    for key, text in (("badcost", "quadratic_ms: 1.0\n"), ("notplan", '{"hello": 1}'),
                      ("trace", '{"traceEvents": []}')):
        files[key] = str(tmp_path / f"{key}.txt")
        write_text(files[key], text)
    argv, needle = CASES[case]
    rc = cli.main([a.format(**files) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "o.json").exists()
