"""``python -m parallel_runtime estimate``: the NCCL replay (its rules on hand-made traces, then the runtime's
real order on pp = 2 plans with several microbatches, with and without ``train.overlap``: it completes, and
the two old orders the issue found deadlock: separate sends and receives, and a device synchronize around
every compute block), memory by kind on fake tensors against the presets formula, and every shipped cost
file held to its memory formula."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_pipeline import plan_json

from balanced_loader.cost import CostModel
from balanced_loader.materialize import materialize_rank
from balanced_loader.plan import StepPlan
from balanced_loader.presets import HARDWARE, RESERVE, ModelShape, lane_cap
from parallel_runtime.diagnostics.estimate import (
    Context,
    find_roles,
    in_flight_tokens,
    main,
    place_of,
    replay_traces,
    role_report,
    run_rank,
)
from parallel_runtime.diagnostics.fake_world import CommTrace
from parallel_runtime.diagnostics.replay import replay
from parallel_runtime.engines import pipeline

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"  # tests/parallel_runtime/fixtures
HETERO = str(RECIPES / "cpu-hetero.yaml")

# ---- the replay's rules ------------------------------------------------------------------------------


def _trace(rank: int, events: list[tuple]) -> CommTrace:
    """A two-rank trace: ("send"|"recv", peer, batch or None), ("ar", async?) on the world, ("sync",)."""
    t = CommTrace(rank)
    for e in events:
        if e[0] in ("send", "recv"):
            o = t.op(kind=e[0], comm="0,1", group=(0, 1), peer=e[1], nbytes=64, batch=-1 if e[2] is None else e[2])
            if e[0] == "recv":
                t.wait((o.index,))
        elif e[0] == "ar":
            o = t.op(kind="all_reduce", comm="world", group=(0, 1), nbytes=e[2] if len(e) > 2 else 4)
            if not e[1]:
                t.wait((o.index,))
        else:
            t.sync()
    return t


def test_replay_rules() -> None:
    # 1F1B, pp = 2, two microbatches, separate sends and receives: both stages send first on one stream
    old = [_trace(0, [("send", 1, None), ("send", 1, None), ("recv", 1, None), ("recv", 1, None)]),
           _trace(1, [("recv", 0, None), ("send", 0, None), ("recv", 0, None), ("send", 0, None)])]
    res = replay(old)
    assert not res.ok and res.completed == 2 and any("rank 0: send" in x for x in res.deadlock), res.summary()
    # the same transfers paired in batches (Megatron's send_forward_recv_backward)
    paired = [_trace(0, [("send", 1, 0), ("send", 1, 1), ("recv", 1, 1), ("recv", 1, 2)]),
              _trace(1, [("recv", 0, 0), ("send", 0, 1), ("recv", 0, 1), ("send", 0, 2)])]
    assert replay(paired).ok
    # a world collective in flight, then a device synchronize before the send its peer waits for
    hang = [_trace(0, [("send", 1, 0), ("recv", 1, 1), ("ar", False)]),
            _trace(1, [("recv", 0, 0), ("ar", True), ("sync",), ("send", 0, 1)])]
    assert not replay(hang).ok
    hang[1] = _trace(1, [("recv", 0, 0), ("ar", True), ("send", 0, 1)])  # no synchronize: it completes
    assert replay(hang).ok
    # collectives of different sizes at the same place, and a send nobody receives
    bad = replay([_trace(0, [("ar", False, 4)]), _trace(1, [("ar", False, 8)])])
    assert not bad.ok and bad.mismatched and "mismatched" in bad.summary()
    lone = replay([_trace(0, [("send", 1, None)]), _trace(1, [])])
    assert not lone.ok and "no matching receive" in lone.deadlock[0]


def test_in_flight_tokens_follow_1f1b() -> None:
    tokens = {0: 100, 1: 200, 2: 300, 3: 400}
    assert in_flight_tokens(tokens, 4, 1, 0) == 400  # no pipeline: one microbatch at a time
    assert in_flight_tokens(tokens, 4, 2, 0) == 700  # stage 0 of 2 holds two
    assert in_flight_tokens(tokens, 4, 2, 1) == 400
    assert in_flight_tokens({0: 100, 3: 50}, 4, 2, 0) == 100  # skipped microbatches hold nothing
    assert in_flight_tokens(tokens, 4, 2, 0, barriers=(2,)) == 700  # a barrier drains each stretch


# ---- the runtime's order on real plans --------------------------------------------------------------


def _context(plans: list[StepPlan], sets: list[str]):
    from parallel_runtime.config import load_recipe
    from parallel_runtime.diagnostics.estimate import cut_recipe

    recipe = cut_recipe(load_recipe(HETERO, sets), 1)
    lengths = np.zeros(max(int(d) for p in plans for d in p.doc_ids()) + 1, dtype=np.int64)
    for p in plans:
        for pool in p.pools:
            for mb in pool.microbatches:
                for g in mb:
                    for d, _, n in g.segments:
                        lengths[d] = n
    mbs = {(s, r): materialize_rank(p, r, None, cp_inner=recipe.loader_cp_inner())
           for s, p in enumerate(plans) for r in range(p.world_size)}
    return recipe, Context(recipe, plans, mbs, [lengths] * len(plans))


# 4 ranks: a 2-stage pipeline of 2 lanes; a CP group over both lanes, lanes alone, a lane that skips
PLAN = plan_json(4, [(1, 2, 0, [[((0, 1), [40, 24])], [((0,), [30]), ((1,), [12, 8])], [((1,), [20])],
                                [((0, 1), [64])], [((0,), [16])]])])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_replay_of_pipeline_plans(overlap: bool) -> None:
    plans = [StepPlan.from_json(PLAN, 4)]
    recipe, ctx = _context(plans, [f"train.overlap={str(overlap).lower()}"])
    assert replay(replay_traces(ctx, recipe)).ok
    saved = pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK
    try:
        pipeline.UNPAIRED = True  # the order before this issue: every send and receive on its own
        res = replay(replay_traces(ctx, recipe))
        assert not res.ok and res.deadlock, res.summary()
        pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK = False, True  # paired, but the old clock's synchronizes
        res = replay(replay_traces(ctx, recipe))
        assert res.ok is (not overlap), res.summary()  # only a bucket in flight across a stage's sync hangs
    finally:
        pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK = saved


def test_role_memory_by_kind_matches_the_formula() -> None:
    plans = [StepPlan.from_json(PLAN, 4)]
    recipe, ctx = _context(plans, ["train.dtype=bfloat16", "train.attention=auto"])  # flash on the GPU
    ctx.recipe = recipe
    places = [[place_of(p, t, r) for r in range(4)] for p, t in zip(plans, ctx.topos)]
    roles = find_roles(places)
    assert [ro.ranks for ro in roles] == [(0, 1), (2, 3)]  # stage 0 and stage 1 (both lanes meet CP 1 and 2)
    ro = roles[0]
    run = run_rank(ctx, ro.rep, [ro.step, ro.step])
    rep = role_report(ctx, ro, run, places)
    assert abs(rep["activations"]["ratio"] - 1) <= 0.1, rep["activations"]
    fig = run.steps[-1]
    assert sum(fig.parts.values()) == fig.peak and fig.parts.get("parameters") and fig.parts.get("gradients")
    assert fig.kind_peaks.get("optimizer") and fig.kind_peaks.get("buckets") and fig.kind_peaks.get("attention")
    assert fig.host_reads["forward_backward"] == 0  # nothing read from the device inside the step
    assert fig.syncs == 1  # the clock's events are read once, after the step
    assert rep["comm_checks"]["cp_engines"]["ratio"] == 1.0  # Ulysses bytes = presets.cp_bytes_per_token


@pytest.mark.parametrize("engine", [["world.cp_engine=ring"], ["world.cp_engine=nested", "world.cp_inner=2"]],
                         ids=["ring", "nested"])
def test_cp_bytes_follow_the_engine_formula(engine: list[str]) -> None:
    plan = plan_json(4, [(1, 1, 0, [[((0, 1, 2, 3), [400, 240])], [((0, 1), [300]), ((2, 3), [120, 80])]])])
    recipe, ctx = _context([StepPlan.from_json(plan, 4)], ["train.dtype=bfloat16", "train.attention=auto", *engine])
    places = [[place_of(p, t, r) for r in range(4)] for p, t in zip(ctx.plans, ctx.topos)]
    ro = find_roles(places)[0]
    rep = role_report(ctx, ro, run_rank(ctx, ro.rep, [ro.step]), places)
    assert rep["comm_checks"]["cp_engines"]["ratio"] == 1.0, rep["comm_checks"]


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path) -> None:
    assert main(["--recipe", HETERO, "--steps", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps" in err


# ---- cost files and the memory formula --------------------------------------------------------------


def _formula_caps(cost: CostModel, recipe) -> dict[tuple[int, int], int]:
    m = recipe.model
    shape = ModelShape(hidden=m.hidden, layers=m.num_layers, heads=m.num_heads, kv_heads=m.num_kv_heads,
                       ffn=m.ffn_hidden, vocab=m.vocab_size, tied=m.tie_embeddings)
    hw = HARDWARE["h100" if recipe.world.device == "cuda" else "cpu"]
    usable = hw.memory_gib * 2**30 - RESERVE.bytes(hw.memory_gib)
    itemsize = 2 if recipe.train.dtype != "float32" else 4
    return {(s.tp, s.pp): lane_cap(shape, usable_bytes=usable, world_size=recipe.world.size, tp=s.tp, pp=s.pp,
                                   itemsize=itemsize) for s in cost.shapes()}


def _users() -> dict[str, list]:
    from parallel_runtime.config import load_recipe

    users: dict[str, list] = {}
    for p in sorted(RECIPES.glob("*.yaml")):
        raw = yaml.safe_load(p.read_text())
        f = (raw.get("cost") or {}).get("file") if isinstance(raw, dict) else None
        if f:
            users.setdefault(f, []).append(load_recipe(str(p)))
    return users


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("cost-*.yaml")))
def test_every_shipped_cost_file_keeps_to_its_memory_formula(name: str) -> None:
    """No lane cap exceeds what the memory formula allows on the device of any recipe using the file (with
    the microbatches 1F1B keeps in flight at every stage); the H100 file's caps are the formula's."""
    users = _users().get(name, [])
    assert users, f"{name} is used by no recipe"
    cost = CostModel.from_file(str(RECIPES / name))
    for recipe in users:
        for (tp, pp), cap in _formula_caps(cost, recipe).items():
            assert cost.shape(tp, pp).max_tokens_per_lane <= cap, (name, recipe.world.size, tp, pp, cap)
    if name == "cost-h100-1b.yaml":
        smallest = min(users, key=lambda r: r.world.size)  # the larger optimizer shard
        for (tp, pp), cap in _formula_caps(cost, smallest).items():
            assert cost.shape(tp, pp).max_tokens_per_lane == cap


def test_the_old_h100_caps_break_the_formula() -> None:
    """The cost file before this issue let tp >= 4 lanes hold 84K-170K tokens where the formula allows 59K-73K."""
    from parallel_runtime.config import load_recipe

    old = CostModel.from_file(str(FIXTURES / "cost-h100-1b-old.yaml"))
    recipe = load_recipe(str(RECIPES / "gpu-h100x64-hetero.yaml"))
    caps = _formula_caps(old, recipe)
    over = sorted((tp, pp) for (tp, pp), cap in caps.items() if old.shape(tp, pp).max_tokens_per_lane > cap)
    assert over == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert caps[(4, 1)] > 59_000 and caps[(8, 2)] < 76_000



def test_fake_tensors_count_what_real_tensors_allocate() -> None:
    """memcheck on CPU: the estimate's peak of a one-microbatch step equals the bytes the same step's real
    tensors hold at their peak (counted by the same tracker), kind by kind summed."""
    from parallel_runtime.config import load_recipe
    from parallel_runtime.diagnostics.memcheck import ONE_RANK, measured, predicted

    recipe = load_recipe(HETERO, [*ONE_RANK, "train.dtype=bfloat16", "train.attention=auto"])
    pred = predicted(recipe, 512, flash=False)
    meas = measured(recipe, 512, torch.device("cpu"))
    assert pred["peak_bytes"] == meas["peak_bytes"] > 0


def test_tp_ranks_wait_for_the_same_pull_buckets(monkeypatch) -> None:
    """Found by the replay on the 64-GPU recipe: with train.overlap a module's pre-hook waited only for its own
    slice's buckets, and the vocab rows of tp index 1 sit in a later bucket than those of tp index 0, so rank 0
    entered the embedding's TP all-reduce while rank 1 waited for a bucket rank 0 posts only after it. Small
    buckets make the embedding span several here."""
    from parallel_runtime.training import overlap, transport

    monkeypatch.setattr(overlap, "BUCKET_ELEMS", 2048)
    monkeypatch.setattr(transport, "PEER_BYTES", 4)
    plan = plan_json(4, [(2, 1, 0, [[((0, 1), [40, 24])], [((0,), [30]), ((1,), [12, 8])]])])  # tp 2 x 2 lanes
    recipe, ctx = _context([StepPlan.from_json(plan, 4)], ["train.overlap=true", "world.cp_engine=ring"])
    res = replay(replay_traces(ctx, recipe))
    assert res.ok, res.summary()


@pytest.mark.parametrize("extra, says", [
    (["--device-gib", "nan"], "--device-gib a finite number > 0"),
    (["--out", "RECIPE"], "is a file, not a folder"),
    (["--out", "/dev/full"], "names a device or process file"),
])
def test_estimate_refuses_bad_options_in_one_line(extra, says, capsys, tmp_path):
    """A NaN device size, an --out that is its own recipe or a device: one line, exit 2, nothing written
    (they were tracebacks on every fake rank, after the whole estimate)."""
    from parallel_runtime.diagnostics.estimate import main

    recipe = str(REPO / "recipes" / "gpu-h100x8-dcp.yaml")
    before = Path(recipe).read_bytes()
    args = ["--recipe", recipe, "--steps", "1", "--no-replay", "--out", str(tmp_path / "e")]
    args += [recipe if x == "RECIPE" else x for x in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert Path(recipe).read_bytes() == before and not (tmp_path / "e").exists()
