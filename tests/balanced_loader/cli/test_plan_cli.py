"""``balanced-loader plan`` (contract 3): length files in, validated plan JSON out; user mistakes are
one stderr line with exit code 2."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.plan import Plan
from balanced_loader.simulate import step_ms

COST_YAML = """quadratic_ms: 1.0e-4
linear_ms: 0.01
microbatch_ms: 1.0
comm_bytes_per_token: 20000
bandwidth_gbs: {2: 100.0, 16: 10.0}
max_tokens_per_lane: 64
strategies:
  - {tp: 2, pp: 1, max_tokens_per_lane: 128}
"""
LENGTHS = [30, 7, 200, 64, 1, 15, 99, 3, 40, 250, 12, 8]


@pytest.fixture
def files(tmp_path):
    cost = tmp_path / "cost.yaml"
    cost.write_text(COST_YAML)
    typo = tmp_path / "typo.yaml"
    typo.write_text(COST_YAML.replace("linear_ms", "linear_msec"))
    txt = tmp_path / "l.txt"
    txt.write_text("\n".join(map(str, LENGTHS)) + "\n")
    gz = tmp_path / "l.txt.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(map(str, LENGTHS)) + "\n")
    npy = tmp_path / "l.npy"
    np.save(npy, np.asarray(LENGTHS, dtype=np.int32))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    zero = tmp_path / "zero.txt"
    zero.write_text("5\n0\n7\n")
    long = tmp_path / "long.txt"
    long.write_text("5\n9000\n7\n")
    return {"cost": str(cost), "typo": str(typo), "txt": str(txt), "gz": str(gz), "npy": str(npy),
            "empty": str(empty), "zero": str(zero), "long": str(long), "out": str(tmp_path / "plan.json"),
            "nofile": str(tmp_path / "missing.txt")}


def _run(capsys, argv):
    rc = cli.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("policy", ["maxlen", "static-sp", "token-kk", "mcore-dcp", "hydra"])
@pytest.mark.parametrize("kind", ["txt", "gz", "npy"])
def test_plan_writes_a_valid_plan(files, capsys, policy, kind):
    rc, out, err = _run(capsys, ["plan", "--lengths", files[kind], "--world-size", "8", "--cost-file",
                                 files["cost"], "--policy", policy, "--out", files["out"]])
    assert rc == 0, err
    assert "predicted_ms" in out and f"wrote {files['out']}" in out
    plan = Plan.load(files["out"])
    cost = CostModel.from_file(files["cost"])
    assert plan.policy == policy and plan.world_size == 8 and len(plan.steps) == 1
    step = plan.steps[0]
    step.validate(LENGTHS, cost, doc_ids=range(len(LENGTHS)))
    assert step.predicted_ms == pytest.approx(step_ms(step, cost), abs=1e-3)  # JSON keeps 4 decimals
    assert step.plan_seconds > 0


def test_plan_steps_by_token_budget_and_seeded_shuffle(files, capsys):
    args = ["plan", "--lengths", files["txt"], "--world-size", "4", "--cost-file", files["cost"],
            "--policy", "hydra", "--global-batch-tokens", "300", "--shuffle", "--seed", "3"]
    rc, out, _ = _run(capsys, args)
    assert rc == 0
    first = json.loads(out)
    rc, out, _ = _run(capsys, args)
    assert json.loads(out)["steps"][0]["pools"] == first["steps"][0]["pools"]  # same seed, same plan
    steps = [s for s in Plan.from_json(first).steps]
    assert len(steps) >= 3
    seen = []
    for s in steps:
        ids = s.doc_ids().tolist()
        assert sum(LENGTHS[i] for i in ids) <= 300 or len(ids) == 1
        seen += ids
    assert sorted(seen) == list(range(len(LENGTHS)))
    assert [s.step for s in steps] == list(range(len(steps)))


def test_plan_static_shape_and_split_long_docs(files, capsys):
    rc, out, err = _run(capsys, ["plan", "--lengths", files["long"], "--world-size", "8", "--cost-file",
                                 files["cost"], "--policy", "maxlen", "--tp", "2", "--max-seq-len", "512"])
    assert rc == 0, err
    step = Plan.from_json(json.loads(out)).steps[0]
    assert (step.pools[0].tp, step.pools[0].pp) == (2, 1)
    assert "split 1" in err
    segs = sorted(s for mb in step.pools[0].microbatches for g in mb for s in g.segments if s[0] == 1)
    assert [s[1] for s in segs] == list(range(0, 9000, 512))


def test_empty_file_is_one_empty_step(files, capsys):
    rc, out, err = _run(capsys, ["plan", "--lengths", files["empty"], "--world-size", "4", "--cost-file",
                                 files["cost"], "--policy", "hydra", "--out", files["out"]])
    assert rc == 0, err
    (step,) = Plan.load(files["out"]).steps
    assert step.pools[0].microbatches == () and step.predicted_ms == 0.0


def test_plan_from_a_source(files, capsys):
    pytest.importorskip("balanced_loader.data.sources")
    rc, out, err = _run(capsys, ["plan", "--source", files["npy"], "--world-size", "8", "--cost-file",
                                 files["cost"], "--policy", "hydra"])
    assert rc == 0, err
    Plan.from_json(json.loads(out)).steps[0].validate(LENGTHS, doc_ids=range(len(LENGTHS)))


ERRORS = {
    "unknown policy": (["--policy", "megatron"], "unknown policy 'megatron'"),
    "mistyped cost key": (["--cost-file", "{typo}"], "unknown key(s) ['linear_msec']"),
    "missing cost": (["--cost-file", None], "a cost model is needed"),
    "non-positive length": (["--lengths", "{zero}"], "doc 1 (line 2) has length 0"),
    "world not divisible by tp*pp": (["--world-size", "6", "--tp", "4"], "world_size 6 is not divisible"),
    "shape not in the cost file": (["--policy", "maxlen", "--tp", "4"], "add it under 'strategies'"),
    "doc too long": (["--lengths", "{long}"], "doc 1 (9000 tokens) does not fit: max_tokens_per_lane 64"),
    "unreadable file": (["--lengths", "{nofile}"], "does not exist"),
    "bad batch budget": (["--global-batch-tokens", "0"], "argument --global-batch-tokens: 0 is outside 1.."),
}


@pytest.mark.parametrize("case", ERRORS)
def test_user_mistakes_are_one_line(files, capsys, case):
    changes, message = ERRORS[case]
    opts = {"--lengths": files["txt"], "--world-size": "8", "--cost-file": files["cost"], "--policy": "hydra"}
    for k, v in zip(changes[::2], changes[1::2]):
        opts[k] = None if v is None else v.format(**files)
    argv = ["plan"] + [x for k, v in opts.items() if v is not None for x in (k, v)]
    rc, out, err = _run(capsys, argv)
    assert rc == 2
    assert err.count("\n") == 1 and message in err, err


def test_console_entry_point(files):
    r = subprocess.run([sys.executable, "-m", "balanced_loader", "plan", "--lengths", files["long"],
                        "--world-size", "4", "--cost-file", files["cost"], "--policy", "mcore-dcp"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("balanced-loader plan: error: policy 'mcore-dcp': doc 1 (9000 tokens)")
    assert "Traceback" not in r.stderr


def test_native_prints_stay_out_of_the_plan_json(capfd):
    # HiGHS (C++) prints some diagnostics to the process's stdout, where the plan JSON goes without --out
    import ctypes
    import os

    from balanced_loader.cli.cmd_plan import native_stdout_to_stderr

    with native_stdout_to_stderr():
        os.write(1, b"raw fd line\n")
        ctypes.CDLL(None).printf(b"buffered printf line\n")
    print("after")
    out, err = capfd.readouterr()
    assert out == "after\n"
    assert "raw fd line" in err and "buffered printf line" in err
