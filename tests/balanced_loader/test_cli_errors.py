"""User mistakes in analyze / simulate / compare: one stderr line, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from balanced_loader import cli
from balanced_loader.outputs.files import write_text
from balanced_loader.plan import Group, Plan, Pool, StepPlan

GOOD_COST = """quadratic_ms: 0.0
linear_ms: 1.0
microbatch_ms: 0.0
comm_bytes_per_token: 0.0
bandwidth_gbs: {2: 100.0}
max_tokens_per_lane: 1000
"""


@pytest.fixture
def files(tmp_path):
    good = tmp_path / "cost.yaml"
    good.write_text(GOOD_COST)
    missing = tmp_path / "missing_key.yaml"
    missing.write_text(GOOD_COST.replace("linear_ms: 1.0\n", ""))
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n30\n")
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(b"\x89\xff\x00\x01binary")
    words = tmp_path / "words.txt"
    words.write_text("10\ntwenty\n")
    ok = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((Group(lanes=(0,), segments=((0, 0, 10),)),),))
    bad = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((Group(lanes=(0,), segments=((0, 0, 10),)),
                                                            Group(lanes=(0,), segments=((1, 0, 5),))),))
    plans = {}
    for name, pool in (("ok", ok), ("bad", bad)):
        p = tmp_path / f"{name}.json"
        plan = Plan(policy="hand", world_size=2, steps=(StepPlan(step=0, world_size=2, pools=(pool,)),))
        write_text(str(p), plan.dumps())
        plans[name] = str(p)
    notplan = tmp_path / "notplan.json"
    notplan.write_text('{"hello": 1}')
    return {"cost": str(good), "missing": str(missing), "lengths": str(lengths), "garbage": str(garbage),
            "words": str(words), "nofile": str(tmp_path / "nope.txt"), "notplan": str(notplan),
            "out": str(tmp_path / "out"), **plans}


CASES = {
    "analyze: missing lengths file": (["analyze", "{nofile}", "--out", "{out}"], "does not exist"),
    "analyze: binary lengths file": (["analyze", "{garbage}", "--out", "{out}"], "is not text"),
    "analyze: non-integer line": (["analyze", "{words}", "--out", "{out}"], "line 2"),
    "analyze: cost file missing a key": (["analyze", "{lengths}", "--cost-file", "{missing}", "--out", "{out}"],
                                         "missing key 'linear_ms'"),
    "simulate: plan fails validate()": (["simulate", "{bad}", "--cost-file", "{cost}"],
                                        "lane 0 is in two groups"),
    "simulate: not a plan": (["simulate", "{notplan}", "--cost-file", "{cost}"], "not a plan file"),
    "simulate: missing plan": (["simulate", "{nofile}", "--cost-file", "{cost}"], "cannot read plan file"),
    "simulate: cost file missing a key": (["simulate", "{ok}", "--cost-file", "{missing}"],
                                          "missing key 'linear_ms'"),
    "simulate: no cost model": (["simulate", "{ok}"], "a cost model is needed"),
    "simulate: model without hardware": (["simulate", "{ok}", "--cost-file", "{cost}", "--model", "gpt-7b"],
                                         "needs both --model"),
    "compare: missing lengths file": (["compare", "--lengths", "{nofile}", "--policies", "greedy",
                                       "--world-size", "2", "--cost-file", "{cost}", "--out", "{out}"],
                                      "does not exist"),
    "compare: cost file missing a key": (["compare", "--lengths", "{lengths}", "--policies", "greedy",
                                          "--world-size", "2", "--cost-file", "{missing}", "--out", "{out}"],
                                         "missing key 'linear_ms'"),
    "compare: unknown policy": (["compare", "--lengths", "{lengths}", "--policies", "greedy,nope",
                                 "--world-size", "2", "--cost-file", "{cost}", "--out", "{out}"],
                                "unknown policy 'nope'"),
    "compare: --out is a file": (["compare", "--lengths", "{lengths}", "--policies", "greedy",
                                  "--world-size", "2", "--cost-file", "{cost}", "--out", "{lengths}"],
                                 "File exists"),
    "analyze: --out is a file": (["analyze", "{lengths}", "--out", "{lengths}"], "File exists"),
    "simulate: binary plan file": (["simulate", "{garbage}", "--cost-file", "{cost}"], "is not text"),
    "simulate: binary cost file": (["simulate", "{ok}", "--cost-file", "{garbage}"], "is not text"),
    "compare: unknown cost preset": (["compare", "--lengths", "{lengths}", "--policies", "greedy",
                                      "--world-size", "2", "--cost", "nope", "--out", "{out}"],
                                     "unknown cost preset 'nope'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_line_exit_2(case, files, capsys):
    argv, needle = CASES[case]
    rc = cli.main([a.format(**files) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


def test_console_entry_point_prints_no_traceback(files):
    for argv in (["simulate", files["bad"], "--cost-file", files["cost"]],
                 ["analyze", files["nofile"], "--out", files["out"]]):
        r = subprocess.run([sys.executable, "-m", "balanced_loader", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr
