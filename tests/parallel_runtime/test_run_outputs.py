"""A run's ``--out`` has one writer and one history, and a mistake in a recipe is one line (issue 24).

* a run on an ``--out`` that is held exits 2 in one line naming the holder; two runs started at once
  (two processes) on one ``--out``: one trains, the other exits 2, and ``metrics.jsonl`` holds each
  step once;
* a rerun on an ``--out`` with ``metrics.jsonl`` but no checkpoint is refused, ``--fresh`` starts over
  (one history, never steps 0..2 then 0..1);
* ``model.vocab_size`` (native or ``model.hf``) below the data's largest token id, a recipe with a
  duplicate key, a recipe that is a list: one line, exit 2, no traceback, before any step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from balanced_loader.outputs.locks import OutputLock
from parallel_runtime.__main__ import main
from parallel_runtime.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
HETERO = str(REPO / "recipes" / "cpu-hetero.yaml")
HF = str(REPO / "recipes" / "cpu-hf-llama.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    """``--set`` overrides of a small, quick run (60 stdlib files, a checkpoint every 2 steps and at the end)."""
    from balanced_loader.build.corpus import stdlib_shards

    tmp = tmp_path_factory.mktemp("runs")
    stdlib_shards(str(tmp / "shards"), limit=60)
    return [f"data.source={tmp / 'shards'}", "data.max_seq_len=256", "data.global_batch_tokens=2048",
            "data.long_docs=truncate", f"cost.file={REPO / 'recipes' / 'cost-cpu-tiny.yaml'}",
            "cost.lane_caps={1x1: 128, 1x2: 256}", "train.checkpoint_every=2"]


def _args(out, sets, steps, *extra, recipe=HETERO) -> list[str]:
    return ["--recipe", recipe, "--reference", "--out", str(out), "--steps", str(steps), *extra,
            *(x for s in sets for x in ("--set", s))]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_run_on_a_held_out_exits_2_naming_the_holder(sets, tmp_path, capsys):
    out = tmp_path / "run"
    with OutputLock(out, "--out"):  # held here, as by a run in progress (locks are per open file: this conflicts)
        assert main(_args(out, sets, 1)) == 2
    line = _one_line(capsys)
    assert f"--out {out} is in use by pid {os.getpid()} on " in line and "choose another --out" in line
    assert not out.exists()  # it wrote nothing


def test_two_runs_at_once_one_trains_and_each_step_is_logged_once(sets, tmp_path):
    out = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-m", "parallel_runtime", *_args(out, sets, 4)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    rcs = [p.returncode for p in procs]
    assert sorted(rcs) == [0, 2], errs
    loser = errs[rcs.index(2)].strip().splitlines()
    assert len(loser) == 1 and "is in use by pid" in loser[0], loser
    assert [m["step"] for m in read_metrics(str(out / "metrics.jsonl"))] == list(range(4))  # was 0,0,1,1,2,..


def test_metrics_without_a_checkpoint_are_refused_and_fresh_starts_over(sets, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(out, sets, 3)) == 0
    import shutil

    shutil.rmtree(out / "checkpoint")  # metrics of steps 0..2, nothing to resume from
    capsys.readouterr()
    assert main(_args(out, sets, 2)) == 2
    assert "holds metrics.jsonl (3 step record(s)) but no checkpoint to resume from" in _one_line(capsys)
    assert [m["step"] for m in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2]  # untouched
    assert main(_args(out, sets, 2, "--fresh")) == 0
    assert [m["step"] for m in read_metrics(str(out / "metrics.jsonl"))] == [0, 1]  # one history, not 0..2 then 0..1
    capsys.readouterr()
    assert main(_args(out, sets, 3, "--fresh")) == 2  # --fresh never discards a checkpoint
    assert "--fresh: --out" in _one_line(capsys) and (out / "checkpoint").exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".lock")]  # every run released its lock


@pytest.mark.parametrize("recipe, key", [(HETERO, "model.vocab_size"), (HF, "model.hf.vocab_size")])
def test_a_vocabulary_below_the_data_is_one_line(sets, tmp_path, capsys, recipe, key):
    pytest.importorskip("transformers") if recipe == HF else None
    extra = ["policy.name=hydra", "policy.extra={}"] if recipe == HF else []
    assert main(_args(tmp_path / "run", [*sets, *extra, f"{key}=100"], 1, recipe=recipe)) == 2
    line = _one_line(capsys)
    assert f"{key} is 100 but shard folder" in line and "holds token id" in line and f"--set {key}=" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("text, needle", [
    ("seed: 0\nsteps: 2\nseed: 1\n", "duplicate key 'seed' on line 3 (first given on line 1)"),
    ("- seed: 0\n- steps: 2\n", "must be a YAML mapping (key: value lines), but its document is a list"),
])
def test_recipe_mistakes_are_one_line(tmp_path, capsys, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    assert main(["--recipe", str(recipe), "--reference", "--out", str(tmp_path / "out")]) == 2
    assert needle in _one_line(capsys)
    assert not (tmp_path / "out").exists()
