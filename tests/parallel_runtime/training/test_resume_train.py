"""Equivalence with the one-process reference across a checkpoint: ``cpu-hetero.yaml`` (two pools of
different shape, one pipelined, CP groups in the other) on 4 gloo ranks trains 3 steps, checkpoints,
and a new trainer resumes from the checkpoint to step 6; every step's loss equals ``--reference``
within 1e-5 relative (fp32) -- the reference itself resumed from its own checkpoint -- and the
metrics hold each step once.
"""

from __future__ import annotations

import json
import os

import pytest
from distributed import run_distributed
from test_trainer import HETERO, reference_losses, small_run, train_rank

from parallel_runtime.training.metrics import read_metrics


def _world(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    first = train_rank(rank, world, HETERO, sets, f"{tmp}/resumed", 3)
    second = train_rank(rank, world, HETERO, sets, f"{tmp}/resumed", 6)  # resumes at step 3
    return {"first": first, "second": second}


@pytest.mark.multirank
def test_resume_is_exact_and_equals_the_reference(tmp_path) -> None:
    sets = small_run(tmp_path)
    res = run_distributed(_world, 4, sets, str(tmp_path), timeout=300)[0]
    assert [m["step"] for m in res["first"]] == [0, 1, 2]
    assert [m["step"] for m in res["second"]] == [3, 4, 5]
    resumed = res["first"] + res["second"]
    ref_dir = tmp_path / "ref"
    reference_losses(HETERO, sets, str(ref_dir), 2)
    ref = reference_losses(HETERO, sets, str(ref_dir), 6)  # the reference resumes too (from step 2)
    assert len(ref) == 6
    for m, r in zip(resumed, ref):
        assert abs(m["loss"] - r) <= 1e-5 * abs(r), (m["step"], m["loss"], r)
    assert sum(m["cp_groups"] for m in resumed) > 0 and all(m["pools"][0][1] == 2 for m in resumed)
    on_disk = read_metrics(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert [m["step"] for m in on_disk] == list(range(6))
    ckpt = tmp_path / "resumed" / "checkpoint"
    assert (ckpt / "latest").read_text().strip() == "step-00000006"
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000006"]  # older checkpoints are removed
    meta = json.loads((ckpt / "step-00000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["loader"]["step"] == 6
    # DCP's index, one file per rank, and the meta file (written last) listing every file's size
    files = sorted(os.listdir(ckpt / "step-00000006"))
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)] + ["meta.json"]
    assert sorted(meta["files"]) == [f for f in files if f != "meta.json"] and meta["format"] == 2
