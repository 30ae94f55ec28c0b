"""Numbers in range, length files streamed with the right line numbers, loader state identity.

Every bad number (command line, length file, plan JSON) is one stderr line, exit code 2, no
traceback and no output file; a loader state of a permuted dataset with the same totals is refused.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from test_cli_errors import GOOD_COST

from balanced_loader import cli
from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.data import lengths as lengths_mod
from balanced_loader.data.integrity import lengths_fingerprint
from balanced_loader.data.lengths import MAX_DOC_TOKENS, read_lengths
from balanced_loader.loader import BalancedLoader
from balanced_loader.plan import Group, Plan, Pool, StepPlan

COST_YAML = GOOD_COST  # the one small cost file of the CLI tests


@pytest.fixture
def files(tmp_path):
    (tmp_path / "cost.yaml").write_text(COST_YAML)
    (tmp_path / "l.txt").write_text("10\n20\n30\n")
    (tmp_path / "huge.txt").write_text("# lengths\n5\n\n9223372036854775808\n")
    (tmp_path / "badline.txt").write_text("# header\n10\n\n20  # a comment\nx\n")
    (tmp_path / "zero.txt").write_text("# header\n\n5\n0\n")
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((Group(lanes=(0,), segments=((0, 0, 10),)),),))
    good = json.loads(Plan(policy="hand", world_size=2,
                           steps=(StepPlan(step=0, world_size=2, pools=(pool,)),)).dumps())
    plans = {"ws": ("world_size", 10**8), "seg": ("segment", [0, 0, 2**63]), "nan": ("predicted_ms", "NaN")}
    for name, (key, value) in plans.items():
        d = json.loads(json.dumps(good))
        if key == "segment":
            d["steps"][0]["pools"][0]["microbatches"][0][0]["segments"][0] = value
        elif key == "predicted_ms":
            d["steps"][0]["predicted_ms"] = float("nan")
        else:
            d[key] = value
        (tmp_path / f"plan_{name}.json").write_text(json.dumps(d))
    (tmp_path / "plan_deep.json").write_text('{"format": "balanced-loader/plan", "version": 1, "steps": '
                                             + "[" * 200_000 + "]" * 200_000 + "}")
    return tmp_path


CLI_CASES = {
    "waves: --gpus 10**10": (["waves", "--graph", "{d}/none.yaml", "--gpus", "10000000000", "--out", "{out}"],
                             "--gpus: 10,000,000,000 is outside 1..1,048,576"),
    "compare: --time-limit nan": (["compare", "--lengths", "{d}/l.txt", "--policies", "greedy", "--world-size", "2",
                                   "--cost-file", "{d}/cost.yaml", "--time-limit", "nan", "--out", "{out}"],
                                  "--time-limit: expected a finite number"),
    "plan: --time-limit -1": (["plan", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file", "{d}/cost.yaml",
                               "--policy", "greedy", "--time-limit", "-1", "--out", "{out}"],
                              "--time-limit: -1 is outside"),
    "plan: --world-size 10**8": (["plan", "--lengths", "{d}/l.txt", "--world-size", "100000000", "--cost-file",
                                  "{d}/cost.yaml", "--policy", "greedy", "--out", "{out}"],
                                 "--world-size: 100,000,000"),
    "plan: --seed 1.5": (["plan", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file", "{d}/cost.yaml",
                          "--policy", "greedy", "--seed", "1.5", "--out", "{out}"], "--seed: expected an integer"),
    "plan: length 2**63": (["plan", "--lengths", "{d}/huge.txt", "--world-size", "2", "--cost-file",
                            "{d}/cost.yaml", "--policy", "greedy", "--out", "{out}"],
                           "huge.txt, line 4: length 9223372036854775808 is over the limit"),
    "plan: zero length after comments": (["plan", "--lengths", "{d}/zero.txt", "--world-size", "2", "--cost-file",
                                          "{d}/cost.yaml", "--policy", "greedy", "--out", "{out}"],
                                         "doc 1 (line 4) has length 0"),
    "analyze: bad line after comments": (["analyze", "{d}/badline.txt", "--out", "{out}"],
                                         "badline.txt, line 5: 'x' is not an integer length"),
    "analyze: --top -1": (["analyze", "{d}/l.txt", "--top", "-1", "--out", "{out}"], "--top: -1 is outside 0.."),
    "simulate: world_size 10**8": (["simulate", "{d}/plan_ws.json", "--cost-file", "{d}/cost.yaml"],
                                   "world_size must be an integer in 1..1,048,576, got 100000000"),
    "simulate: deeply nested plan": (["simulate", "{d}/plan_deep.json", "--cost-file", "{d}/cost.yaml"],
                                     "nested too deeply"),
    "simulate: segment 2**63": (["simulate", "{d}/plan_seg.json", "--cost-file", "{d}/cost.yaml", "--no-validate"],
                                "segment (0, 0, 9223372036854775808) is out of range"),
    "simulate: predicted_ms nan": (["simulate", "{d}/plan_nan.json", "--cost-file", "{d}/cost.yaml",
                                    "--no-validate"], "predicted_ms must be finite"),
    "build-shards: --shard-mb inf": (["build-shards", "{d}/l.txt", "--out", "{out}", "--shard-mb", "inf"],
                                     "--shard-mb: expected a finite number"),
    "build-shards: --docs-per-shard 0": (["build-shards", "{d}/l.txt", "--out", "{out}", "--docs-per-shard", "0"],
                                         "--docs-per-shard: 0 is outside 1.."),
    "candidates: --delta-n 0": (["candidates", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file",
                                 "{d}/cost.yaml", "--delta-n", "0", "--out", "{out}"], "--delta-n: 0 is outside"),
    "compare: --steps 1e3": (["compare", "--lengths", "{d}/l.txt", "--policies", "greedy", "--world-size", "2",
                              "--cost-file", "{d}/cost.yaml", "--steps", "1e3", "--out", "{out}"],
                             "--steps: expected an integer, got '1e3'"),
    "plan: unknown option": (["plan", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file", "{d}/cost.yaml",
                              "--policy", "greedy", "--ot", "{out}"], "unrecognized arguments: --ot"),
    "verify: no such folder": (["verify", "{d}/nothing"], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_cli_input_is_one_line_exit_2_and_writes_nothing(case, files, capsys):
    argv, needle = CLI_CASES[case]
    out = files / "out"
    before = sorted(os.listdir(files))
    t0 = time.perf_counter()
    rc = cli.main([a.format(d=files, out=out) for a in argv])
    seconds = time.perf_counter() - t0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured.err
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert needle in lines[0], lines[0]
    assert sorted(os.listdir(files)) == before  # nothing written: no --out file or folder, no temporary file
    assert seconds < 30  # rejected before any work (generous: a loaded CI box)


def test_console_entry_point_has_no_traceback(files):
    for argv in (["waves", "--graph", "g.yaml", "--gpus", "10000000000"],
                 ["simulate", str(files / "plan_deep.json"), "--cost-file", str(files / "cost.yaml")]):
        r = subprocess.run([sys.executable, "-m", "balanced_loader", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Length files
# ---------------------------------------------------------------------------------------------


def _reference(text: str) -> list[int]:
    return [int(s) for line in text.split("\n") if (s := line.split("#", 1)[0].strip())]


@pytest.mark.parametrize("block", [16, 64, 1 << 22])
def test_length_files_parse_the_same_in_any_block_size(tmp_path, monkeypatch, block):
    monkeypatch.setattr(lengths_mod, "_BLOCK", block)
    rng = np.random.default_rng(block)
    lines = []
    for v in rng.integers(0, 100_000, size=500):
        r = rng.random()
        lines.append(f"{v}" if r < 0.7 else f"  {v} # note" if r < 0.8 else "" if r < 0.9 else f"# c {v}\r")
    text = "\n".join(lines) + "\n"
    (tmp_path / "a.txt").write_text(text)
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write(text)
    want = _reference(text)
    assert read_lengths(tmp_path / "a.txt").tolist() == want
    assert read_lengths(tmp_path / "a.txt.gz").tolist() == want
    plain = "\n".join(str(v) for v in want)  # no final newline: the fast path
    (tmp_path / "b.txt").write_text(plain)
    assert read_lengths(tmp_path / "b.txt").tolist() == want


@pytest.mark.parametrize("block", [16, 1 << 22])
def test_length_file_errors_name_the_right_line(tmp_path, monkeypatch, block):
    monkeypatch.setattr(lengths_mod, "_BLOCK", block)
    head = "# generated\n\n" + "".join(f"{i}\n" if i % 7 else "# every 7th a comment\n" for i in range(1, 200))
    line = head.count("\n") + 1
    for bad, msg in (("12x", "'12x' is not an integer length"), ("-5", "negative length -5"),
                     (str(MAX_DOC_TOKENS + 1), r"length \d+ is over the limit"),
                     ("3 4", "'3 4' is not an integer length")):
        (tmp_path / "bad.txt").write_text(head + bad + "\n7\n")
        with pytest.raises(ValueError, match=rf"bad.txt, line {line}: {msg}"):
            read_lengths(tmp_path / "bad.txt")


def test_npy_lengths_out_of_range(tmp_path):
    np.save(tmp_path / "u.npy", np.array([5, 2**63], dtype=np.uint64))
    with pytest.raises(ValueError, match="doc 1 has length 9223372036854775808, over the limit"):
        read_lengths(tmp_path / "u.npy")
    np.save(tmp_path / "f.npy", np.array([5.0, np.inf]))
    with pytest.raises(ValueError, match="doc 1 has a non-integer or out-of-range length"):
        read_lengths(tmp_path / "f.npy")


def test_length_file_peak_memory_is_a_small_multiple_of_the_array(tmp_path):
    n = 1_000_000
    (tmp_path / "big.txt").write_text("\n".join(map(str, np.random.default_rng(0).integers(1, 9000, size=n))))
    code = ("import resource, sys\nfrom balanced_loader.data.lengths import read_lengths\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "a = read_lengths(sys.argv[1])\n"
            "print(len(a), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.txt")], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    docs, grown_kib = map(int, r.stdout.split())
    assert docs == n
    assert grown_kib * 1024 < 4 * 8 * n, f"peak grew {grown_kib} KiB for a {8 * n // 1024} KiB array"


# ---------------------------------------------------------------------------------------------
# Loader state identity
# ---------------------------------------------------------------------------------------------

COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 300})


def _loader(source, **kw):
    args = {"policy": "greedy", "cost": COST, "world_size": 2, "global_batch_tokens": 600, "max_seq_len": 300,
            "seed": 1, "epochs": 2}
    return BalancedLoader(source, **{**args, **kw})


def test_permuted_lengths_with_the_same_totals_are_refused():
    lengths = list(np.random.default_rng(0).integers(1, 300, size=40))
    ld = _loader(lengths)
    next(ld)
    state = ld.state_dict()
    assert state["lengths_fingerprint"] == lengths_fingerprint(np.asarray(lengths))
    _loader(list(lengths)).load_state_dict(state)  # the same lengths: accepted
    permuted = lengths[::-1]
    assert sum(permuted) == sum(lengths) and permuted != lengths
    with pytest.raises(ValueError, match="lengths_fingerprint=.*the source changed"):
        _loader(permuted).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "lengths_fingerprint"}  # a state from before fingerprints
    _loader(list(lengths)).load_state_dict(old)


def test_shard_folder_fingerprint_comes_from_the_index(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 60_000, size=int(k)) for k in rng.integers(1, 300, size=30)]
    src = write_shards(docs, str(tmp_path), max_shard_bytes=4000)
    index = json.loads((tmp_path / "index.json").read_text())
    assert src.fingerprint() == index["lengths_fingerprint"] == lengths_fingerprint(np.array([len(d) for d in docs]))
    state = _loader(src).state_dict()
    _loader(str(tmp_path)).load_state_dict(state)


@pytest.mark.parametrize("change, message", [
    ({"step_in_epoch": None}, "cursor's 'step_in_epoch' must be an integer"),
    ({"epoch": 99}, r"epoch 99, step \d+\) is past the last of this loader's 2 epoch"),
    ({"epoch": True}, "cursor's 'epoch' must be an integer"),
    ({"step": -1}, "cursor's 'step' must be an integer >= 0"),
    ({"step": 0, "step_in_epoch": 1}, "global step 0 cannot be step 1 of epoch 0"),
    ({"position": 10**9}, "its position must be a mapping with 'cursor' and 'epoch_start'"),
])
def test_malformed_loader_states_are_one_value_error(change, message):
    lengths = list(range(1, 41))
    ld = _loader(lengths)
    next(ld)
    state = ld.state_dict()
    for k, v in change.items():
        if v is None:
            state.pop(k)
        else:
            state[k] = v
    with pytest.raises(ValueError, match=message):
        _loader(lengths).load_state_dict(state)
