"""Recompute and bf16 in the trainer on 4 gloo ranks (``cpu-hetero.yaml`` shrunk as in test_trainer):
with ``train.recompute`` the CP engines' collectives run again in backward and the losses still equal
the fp32 one-process reference (1e-5 relative, ring and Ulysses); a bf16 run equals a bf16 reference
within bf16 round-off; every step's record carries each rank's memory report."""

from __future__ import annotations

import os

import pytest
from distributed import run_distributed
from test_trainer import HETERO, reference_losses, small_run, train_rank

from parallel_runtime.training.metrics import read_metrics

RUNS = {"ulysses": ["train.recompute=true"],
        "ring": ["train.recompute=true", "world.cp_engine=ring"],
        "bf16": ["train.dtype=bfloat16"]}
MEMORY_KEYS = ("peak_bytes", "base_bytes", "params_bytes", "grads_bytes", "activations_bytes", "optimizer_bytes",
               "comm_bytes")


def _world(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    return {name: train_rank(rank, world, HETERO, [*sets, *extra], f"{tmp}/{name}", 2) for name, extra in RUNS.items()}


@pytest.mark.multirank
def test_recompute_with_cp_engines_and_bf16_equal_the_reference(tmp_path) -> None:
    sets = small_run(tmp_path)
    res = run_distributed(_world, 4, sets, str(tmp_path), timeout=300)[0]
    ref = reference_losses(HETERO, sets, str(tmp_path / "ref"), 2)
    ref16 = reference_losses(HETERO, [*sets, "train.dtype=bfloat16"], str(tmp_path / "ref16"), 2)
    for name in ("ulysses", "ring"):
        assert sum(m["cp_groups"] for m in res[name]) > 0  # CP groups ran under recompute
        for m, r in zip(res[name], ref):
            assert abs(m["loss"] - r) <= 1e-5 * abs(r), (name, m["step"], m["loss"], r)
    for m, r in zip(res["bf16"], ref16):
        assert abs(m["loss"] - r) <= 2e-2 * abs(r), (m["step"], m["loss"], r)
    rec = read_metrics(os.path.join(tmp_path, "ulysses", "metrics.jsonl"))[0]["memory"]
    for key in MEMORY_KEYS:
        assert len(rec[key]) == 4, key
    assert min(rec["peak_bytes"]) > 0 and min(rec["params_bytes"]) > 0 and min(rec["optimizer_bytes"]) > 0
    assert min(rec["activations_bytes"]) > 0 and min(rec["grads_bytes"]) > 0
    # pool 0 (ranks 0, 1) splits the model in two stages: each holds about half the working parameters
    assert rec["params_bytes"][0] < rec["params_bytes"][2] and rec["params_bytes"][1] < rec["params_bytes"][2]
    b16 = read_metrics(os.path.join(tmp_path, "bf16", "metrics.jsonl"))[0]["memory"]
    assert b16["params_bytes"] == [p // 2 for p in rec["params_bytes"]]  # bf16 working parameters
