"""Checkpoints (:mod:`parallel_runtime.training.checkpoint`): sharded DCP saves that resume on another
number of processes, complete-or-absent saves, and resumes refused in one line (exit 2, nothing
overwritten) for another model, a damaged or old checkpoint, a world the plan cannot use, or a recipe
change that alters what the run computes.

The elastic run is ``cpu-dcp.yaml`` (one pool of 4 lanes, hydra's per-microbatch CP groups over
Ulysses, maxlen executed beside it) on the small corpus of :func:`test_trainer.small_run`: 3 steps on
4 ranks checkpointing every step, then resumed with the same out folder to step 6 on 2 ranks; every
loss equals the one-process reference within 1e-5 relative.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_distributed
from test_trainer import REPO, reference_losses, small_run, train_rank

from parallel_runtime.config import dump_recipe, load_recipe
from parallel_runtime.training.checkpoint import compare_recipes
from parallel_runtime.training.metrics import MetricsLog, read_metrics

DCP = str(REPO / "recipes" / "cpu-dcp.yaml")


def _sets(tmp: Path) -> list[str]:
    return [*small_run(tmp), "train.checkpoint_every=1", "world.timeout_s=90"]


def _train(rank: int, world: int, sets: list[str], out: str, steps: int) -> list[dict]:
    return train_rank(rank, world, DCP, sets, out, steps)


@pytest.mark.multirank
def test_four_ranks_resume_on_two_and_equal_the_reference(tmp_path) -> None:
    sets = _sets(tmp_path)
    out = str(tmp_path / "run")
    first = run_distributed(_train, 4, sets, out, 3, timeout=300)[0]
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000003"]  # every step saved, older ones removed
    assert sorted(os.listdir(ckpt / "step-00000003")) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)] \
        + ["meta.json"]
    second = run_distributed(_train, 2, [*sets, "world.size=2"], out, 6, timeout=300)[0]
    assert [m["step"] for m in first] == [0, 1, 2] and [m["step"] for m in second] == [3, 4, 5]
    assert all(len(m["wall_ms"]) == 2 for m in second)  # really on 2 ranks
    ref = reference_losses(DCP, sets, str(tmp_path / "ref"), 6)
    got = [m["loss"] for m in first + second]
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert abs(g - r) <= 1e-5 * abs(r), (step, g, r)
    assert sum(m["cp_groups"] for m in first + second) > 0  # the DCP policy really ran CP groups
    assert [m["step"] for m in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))] == list(range(6))
    meta = json.loads((ckpt / "step-00000006" / "meta.json").read_text())
    assert meta["processes"] == 2 and meta["step"] == 6 and meta["optimizer_steps"] == 6


# ---- one process through the command line: exit codes, one line, nothing overwritten --------------------


def _cli(sets: list[str], out: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parallel_runtime", "--recipe", DCP, "--out", str(out), "--steps", str(steps),
           *extra]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(r: subprocess.CompletedProcess, message: str) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip()
    assert "\n" not in err and message in err, err


@pytest.mark.multirank
def test_bad_resumes_are_refused_in_one_line_and_a_killed_save_is_ignored(tmp_path) -> None:
    sets = [*_sets(tmp_path), "world.size=1", "policy.compare=[]", "cost.lane_caps={1x1: 256}"]
    out = tmp_path / "run"
    r = _cli(sets, out, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "checkpoint"
    before = _snapshot(out)

    # a change that keeps the parameter count but reinterprets the weights
    _refused(_cli([*sets, "model.num_heads=8", "model.num_kv_heads=8"], out, 3),
             "model.num_heads is 8 in the recipe but 4 in checkpoint")
    _refused(_cli([*sets, "model.rope_theta=500000.0"], out, 3), "model.rope_theta is 500000.0 in the recipe")
    _refused(_cli([*sets, "model.hidden=32"], out, 3), "model.hidden is 32 in the recipe but 64")
    _refused(_cli([*sets, "data.global_batch_tokens=4096"], out, 3), "data.global_batch_tokens is 4096")
    _refused(_cli([*sets, "optimizer.lr=1.0e-3"], out, 3), "optimizer.lr is 0.001 in the recipe but 0.003 in "
             "checkpoint")
    # a world this launch cannot run (one process for world.size 8): refused before anything is opened
    _refused(_cli([*sets, "world.size=8"], out, 3), "world.size is 8: start the run with accelerate launch")
    assert _snapshot(out) == before  # nothing overwritten

    # a killed save: a half-written step-3.tmp next to the complete step-2, then damage and an old format
    shutil.copytree(ckpt / "step-00000002", ckpt / "step-00000003.tmp")
    os.remove(ckpt / "step-00000003.tmp" / "meta.json")
    dcp_file = ckpt / "step-00000002" / "__0_0.distcp"
    good = dcp_file.read_bytes()
    dcp_file.write_bytes(good[: len(good) // 2])
    _refused(_cli(sets, out, 3), "__0_0.distcp has")
    dcp_file.write_bytes(good)
    meta_file = ckpt / "step-00000002" / "meta.json"
    meta = meta_file.read_text()
    meta_file.write_text(json.dumps({"version": 1, "step": 2}))
    _refused(_cli(sets, out, 3), "checkpoint format 1 from an older version; start a new --out")
    meta_file.write_text(meta)

    # a partial last metrics line (killed while writing it) is dropped with a note; lr changes with the flag
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss"')
    r = _cli([*sets, "optimizer.lr=1.0e-3"], out, 3, "--allow-changed")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"dropped a partial last line of {out / 'metrics.jsonl'}" in r.stdout
    assert "resume: optimizer.lr changed from 0.003 to 0.001 (--allow-changed)" in r.stdout
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000003"]  # the leftover .tmp was cleared
    assert [m["step"] for m in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2]


# ---- the shards alone: uneven cuts, padding, an empty shard ----------------------------------------------------


def _optimizer(rank: int, world: int, numel: int):
    import torch

    from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, ParamSpec, ShardedOptimizer

    specs = [ParamSpec(name="w", shape=(numel - 1,)), ParamSpec(name="b", shape=(1,), decay=False)]
    full = torch.arange(numel, dtype=torch.float32) + 1  # [numel] 1..numel: every element tells its place
    return ShardedOptimizer(FlatLayout(specs, world), {"w": full[:-1], "b": full[-1:]}, AdamWConfig(), rank=rank)


def _save_shards(rank: int, world: int, root: str, numel: int) -> None:
    from parallel_runtime.training import checkpoint as ck

    opt = _optimizer(rank, world, numel)
    opt.exp_avg.copy_(-opt.master)
    opt.exp_avg_sq.copy_(opt.master * 2)
    opt.steps = 7
    ck.save(root, 7, opt, {"reference": False}, rank=rank, distributed=world > 1)


def _load_shards(rank: int, world: int, root: str, numel: int) -> list:
    from parallel_runtime.training import checkpoint as ck

    opt = _optimizer(rank, world, numel)
    opt.master.zero_()
    ck.load_optimizer(ck.find(root), opt, distributed=world > 1)
    return [opt.steps, opt.master.tolist(), opt.exp_avg.tolist(), opt.exp_avg_sq.tolist()]


@pytest.mark.multirank
@pytest.mark.parametrize(("numel", "saved_on", "loaded_on"), [(5, 4, 3), (5, 3, 4)])  # an empty shard on each side
def test_shards_are_recut_for_another_world(tmp_path, numel: int, saved_on: int, loaded_on: int) -> None:
    """``ceil(numel / world)`` shards, the last short or empty, re-cut for another world and for one process."""
    run_distributed(_save_shards, saved_on, str(tmp_path), numel)
    for world, got in ((loaded_on, run_distributed(_load_shards, loaded_on, str(tmp_path), numel)),
                       (1, [_load_shards(0, 1, str(tmp_path), numel)])):
        ss = -(-numel // world)
        for rank, (steps, master, avg, sq) in enumerate(got):
            want = [float(i + 1) if i < numel else 0.0 for i in range(rank * ss, (rank + 1) * ss)]  # padding 0
            assert steps == 7 and master == want and avg == [-x for x in want] and sq == [2 * x for x in want]


# ---- pure pieces ----------------------------------------------------------------------------------------------


def test_recipe_comparison_classifies_keys() -> None:
    base = dump_recipe(load_recipe(DCP))
    free = dump_recipe(load_recipe(DCP, ["world.size=2", "train.checkpoint_every=5", "steps=100",
                                         "cost.lane_caps={1x1: 1024}", "data.prefetch_steps=4"]))
    assert compare_recipes(base, free, allow_changed=False, where="C") == []
    for sets, key in ((["model.rope_theta=1000.0"], "model.rope_theta"), (["seed=1"], "seed"),
                      (["optimizer.betas=[0.8, 0.9]"], "optimizer.betas"), (["train.dtype=bfloat16"], "train.dtype"),
                      (["data.shuffle=false"], "data.shuffle")):
        with pytest.raises(ValueError, match=f"^{key} is .* it changes what the run computes"):
            compare_recipes(base, dump_recipe(load_recipe(DCP, sets)), allow_changed=True, where="C")
    lr = dump_recipe(load_recipe(DCP, ["optimizer.lr=0.01", "optimizer.max_grad_norm=0.5"]))
    with pytest.raises(ValueError, match="^optimizer.lr is 0.01 .* pass --allow-changed"):
        compare_recipes(base, lr, allow_changed=False, where="C")
    notes = compare_recipes(base, lr, allow_changed=True, where="C")
    assert notes == ["resume: optimizer.lr changed from 0.003 to 0.01 (--allow-changed)",
                     "resume: optimizer.max_grad_norm changed from 1.0 to 0.5 (--allow-changed)"]
    # a key the checkpoint does not know (a newer recipe field) is refused, not ignored
    newer = {**base, "model": {**base["model"], "qk_norm": True}}
    with pytest.raises(ValueError, match="^model.qk_norm is True in the recipe but '<absent>'"):
        compare_recipes(base, newer, allow_changed=True, where="C")


def test_metrics_partial_last_line(tmp_path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(str(path)) == [{"step": 0}, {"step": 1}]
    MetricsLog(str(path)).truncate_from(1)
    assert f"dropped a partial last line of {path}" in capsys.readouterr().out
    assert path.read_text() == '{"step": 0}\n'
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')  # damage in the middle is not a partial write
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        read_metrics(str(path))
