"""Closed-loop planning in the runtime (``train.calibrate``, ``train.trace``) on gloo ranks.

The mechanism is tested with injected timings (:data:`parallel_runtime.training.closed_loop.MEASURED`):
every rank's compute is replaced by the contract-2 prediction of a known "true" model and rank 1's
wall time by twice that (a rank at half speed), so the fits and the plans they lead to are
deterministic; timing a shared CI machine would not be. Also here: ``policy.cp=1`` with hydra, whose
padding microbatches the runtime once refused (``AssertionError: microbatches do not match the plan``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from distributed import run_distributed

from parallel_runtime.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DCP = str(REPO / "recipes" / "cpu-dcp.yaml")
TRUE_SCALE = 3.0  # the "true" device is 3x slower than the cost file says


def small_dcp(tmp: Path) -> list[str]:
    """cpu-dcp.yaml on 2 ranks, 300 stdlib files, 1,024-token docs, 4,096-token steps, plain DP (cp=1)."""
    from balanced_loader.build.corpus import stdlib_shards

    shards = tmp / "shards"
    if not shards.exists():
        stdlib_shards(str(shards), limit=300)
    return [f"data.source={shards}", "data.max_seq_len=1024", "data.global_batch_tokens=4096",
            "world.size=2", "policy.cp=1", "policy.compare=[]", "cost.lane_caps={1x1: 1024}",
            "world.timeout_s=60", "train.checkpoint_every=0", "model.num_layers=2"]


def inject(rank: int, samples):
    """Compute = the true model's prediction; rank 1 runs at half speed (its wall time twice that)."""
    from balanced_loader.calibration import Samples
    from balanced_loader.calibration.fit import predict
    from balanced_loader.cost import CostModel

    cost = CostModel.from_file(str(REPO / "recipes" / "cost-cpu-tiny.yaml"))
    true = cost.with_base(**{k: getattr(cost, k) * TRUE_SCALE for k in ("quadratic_ms", "linear_ms", "microbatch_ms")})
    comp = predict(true, samples)
    wall = comp * (2.0 if rank == 1 else 1.0)
    return Samples(**{**{f: getattr(samples, f) for f in ("step", "rank", "tp", "pp", "degree", "engine", "tokens",
                                                          "sumsq")}, "compute_ms": comp, "wall_ms": wall})


def _train(rank: int, world: int, sets: list[str], out: str, steps: int, injected: bool) -> list[dict]:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training import closed_loop
    from parallel_runtime.training.trainer import Trainer

    if injected:
        closed_loop.MEASURED = inject
    return Trainer(load_recipe(DCP, sets), out).train(steps)


def _runs(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    cal = [*sets, "train.calibrate=true", "calibration={every: 2, first: 2}", "train.trace=true"]
    out = {"cp1": _train(rank, world, [*sets, "train.trace=true"], f"{tmp}/cp1", 4, False)}
    out["calibrated"] = _train(rank, world, cal, f"{tmp}/cal", 8, True)
    _train(rank, world, cal, f"{tmp}/resumed", 4, True)  # stopped after step 4 (checkpoint at the end) ...
    out["resumed"] = _train(rank, world, cal, f"{tmp}/resumed", 8, True)  # ... and resumed to step 8
    return out


def reference(sets: list[str], out: str, steps: int) -> list[float]:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    Trainer(load_recipe(DCP, sets), out, reference=True).train(steps)
    return [m["loss"] for m in read_metrics(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.multirank
def test_calibration_finds_the_slow_rank_and_plans_around_it(tmp_path) -> None:
    sets = small_dcp(tmp_path)
    res = run_distributed(_runs, 2, sets, str(tmp_path), timeout=400)[0]
    ref = reference(sets, str(tmp_path / "ref"), 8)

    # hydra with cp=1 runs its padding microbatches (the runtime used to stop at step 2) and is exact
    cp1 = res["cp1"]
    assert [m["step"] for m in cp1] == [0, 1, 2, 3]
    assert max(abs(m["loss"] - r) / r for m, r in zip(cp1, ref)) <= 1e-5

    cal = read_metrics(str(tmp_path / "cal" / "metrics.jsonl"))
    assert max(abs(m["loss"] - r) / r for m, r in zip(cal, ref)) <= 1e-5  # calibration changes plans, not math
    fits = [m for m in cal if "calibration" in m]
    assert [m["step"] for m in fits] == [1, 3, 5, 7]  # first after 2 steps, then every 2
    first = fits[0]["calibration"]
    assert first["from_step"] == 4  # the first step no rank had planned: after step 1, 2 prefetched
    assert first["error_before"] > 0.5 and first["error_after"] < 0.05  # the 3x-off model is refitted
    assert first["speeds"] == [1.0, 0.5]
    # plans made ahead keep their cost: steps before from_step are planned as without calibration
    assert [m["fingerprint"] for m in cal[:4]] == [m["fingerprint"] for m in cp1]
    for m in cal[:4]:
        assert "speeds" not in m
    for m in cal[4:]:  # the slow rank gets about half the work, and the model predicts the compute
        assert m["speeds"] == [1.0, 0.5]
        busy = np.asarray(m["predicted_ms"])
        assert busy[1] < busy[0] * 1.15  # predicted wall time balanced with rank 1 at half speed
    # the calibrator's state resumes exactly: the resumed run plans what the uninterrupted run planned
    resumed = read_metrics(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert [m["fingerprint"] for m in resumed] == [m["fingerprint"] for m in cal]
    assert [m.get("calibration", {}).get("speeds") for m in resumed] == [m.get("calibration", {}).get("speeds")
                                                                        for m in cal]
    # the measured trace: valid trace-event JSON, a track per rank, a step slice per step
    trace = json.loads((tmp_path / "cal" / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["otherData"]["source"] == "measured"
    steps = [e for e in slices if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(8))
    work = [e for e in slices if e["cat"] == "compute"]
    assert {e["tid"] for e in work} == {0, 1} and all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    for r in (0, 1):  # a rank's slices never overlap, and each is one microbatch's forward or backward
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in work if e["tid"] == r)
        assert all(b <= c + 1e-3 for (_, b), (c, _) in zip(mine, mine[1:]))
    assert all(("fwd" in e["name"]) != ("bwd" in e["name"]) for e in work)
    # measured (not injected) times: a rank's compute slices of a step add up to its measured busy wall time
    trace = json.loads((tmp_path / "cp1" / "trace.json").read_text())
    work = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    for m in read_metrics(str(tmp_path / "cp1" / "metrics.jsonl")):
        for r in (0, 1):
            ms = sum(e["dur"] for e in work if e["tid"] == r and e["args"]["step"] == m["step"]) / 1e3
            assert ms == pytest.approx(m["busy_wall_ms"][r], rel=1e-3, abs=0.05), (m["step"], r)


@pytest.mark.parametrize("bad, needle", [
    ("calibration.window=0", "'window' must be an integer in 1.."),
    ("calibration.speed_smoothing=0", "'speed_smoothing'"),
    ("calibration.every=nan", "calibration.every must be an integer"),
])
def test_runtime_bad_calibration_option_exits_2_with_one_line(bad, needle, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "parallel_runtime", "--recipe", DCP, "--reference", "--steps", "1",
                        "--out", str(tmp_path / "run"), "--set", "train.calibrate=true", "--set", bad],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
