"""``cpu-dcp.yaml`` trains with the ring engine (tiled blocks on CPU) and equals ``--reference``.

The recipe is shrunk like test_trainer.py's :func:`small_run` (300 stdlib files, 2048-token steps),
with a 128-token lane cap so long docs run as CP groups of 2-4 lanes through the ring; every
step's loss equals the one-process reference within 1e-5 relative (fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_distributed
from test_trainer import reference_losses, small_run, train_rank

from parallel_runtime.config import load_recipe

DCP = str(Path(__file__).resolve().parents[3] / "recipes" / "cpu-dcp.yaml")


def _sets(tmp: Path) -> list[str]:
    return [*small_run(tmp), "cost.lane_caps={1x1: 128}", "policy.compare=[]"]


def _world(rank: int, world: int, sets: list[str], out: str) -> list[dict]:
    return train_rank(rank, world, DCP, sets, out, 3)


@pytest.mark.multirank
def test_cpu_dcp_recipe_runs_ring_and_equals_the_reference(tmp_path) -> None:
    sets = _sets(tmp_path)
    assert load_recipe(DCP, sets).world.cp_engine == "ring"
    metrics = run_distributed(_world, 4, sets, str(tmp_path / "run"), timeout=300)[0]
    ref = reference_losses(DCP, sets, str(tmp_path / "ref"), 3)
    assert sum(m["cp_groups"] for m in metrics) > 0  # the ring ran
    for m, r in zip(metrics, ref, strict=True):
        assert abs(m["loss"] - r) <= 1e-5 * abs(r), (m["loss"], r)
