"""Plans with contract-1 ``barriers`` run as planned: ``mcore-dcp`` (a barrier after each of its rounds,
as Megatron-Core's hybrid CP) trains on 4 gloo ranks and equals the one-process reference; the pipeline
drains at each barrier (a unit check of the 1F1B segmenting on one stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_distributed
from test_trainer import reference_losses, small_run, train_rank

from parallel_runtime.engines.pipeline import schedule_1f1b

DCP = str(Path(__file__).resolve().parents[3] / "recipes" / "cpu-dcp.yaml")


def _sets(tmp: Path) -> list[str]:
    return [*small_run(tmp), "cost.lane_caps={1x1: 128}", "policy.compare=[]", "policy.name=mcore-dcp"]


def _world(rank: int, world: int, sets: list[str], out: str) -> list[dict]:
    return train_rank(rank, world, DCP, sets, out, 3)


@pytest.mark.multirank
def test_mcore_dcp_barriers_run_and_equal_the_reference(tmp_path) -> None:
    sets = _sets(tmp_path)
    metrics = run_distributed(_world, 4, sets, str(tmp_path / "run"), timeout=300)[0]
    ref = reference_losses(DCP, sets, str(tmp_path / "ref"), 3)
    assert sum(m["cp_groups"] for m in metrics) > 0
    for m, r in zip(metrics, ref, strict=True):
        assert abs(m["loss"] - r) <= 1e-5 * abs(r), (m["loss"], r)


def test_schedule_segments_cover_every_microbatch_once() -> None:
    # the runtime runs each stretch between barriers as its own 1F1B: together they do every F and B once
    edges = [0, 2, 5, 6]
    for pp in (1, 2, 3):
        for stage in range(pp):
            ops = [(kind, lo + j) for lo, hi in zip(edges, edges[1:]) for kind, j in schedule_1f1b(hi - lo, pp, stage)]
            assert sorted(ops) == sorted(schedule_1f1b(6, pp, stage))
