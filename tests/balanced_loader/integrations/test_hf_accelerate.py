"""examples/hf_accelerate.py: 2 gloo ranks under ``accelerate launch`` train exactly like 1 process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from distributed import accelerate_launch, run_commands  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "hf_accelerate.py"
STEPS = 4


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.multirank
def test_two_gloo_ranks_match_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--cpu", "--steps", str(STEPS), "--hf-loss-check"]
    # both runs at once (they are independent): the test takes the longer of the two
    runs = run_commands([[sys.executable, str(EXAMPLE), *args, "--out", str(one), "--log-with", "tensorboard"],
                         [*accelerate_launch(2), str(EXAMPLE), *args, "--out", str(two)]], tmp_path)
    (ref,) = _records(one, 1)
    ranks = _records(two, 2)
    assert [r["world_size"] for r in ranks] == [2, 2] and sorted(r["rank"] for r in ranks) == [0, 1]
    # equal microbatch counts on both ranks in every step (padding microbatches where needed)
    assert ranks[0]["microbatches"] == ranks[1]["microbatches"] and len(ranks[0]["microbatches"]) == STEPS
    # the same global mean loss per step and the same parameters after STEPS optimizer steps
    for rec in ranks:
        assert rec["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    p1, p2 = torch.load(one / "params.pt"), torch.load(two / "params.pt")
    assert p1.keys() == p2.keys()
    assert max(float((p1[k] - p2[k]).abs().max()) for k in p1) < 1e-5
    # transformers' own labels= loss (a mean) agrees with the manual shifted token sum of to_hf()
    for rec in (ref, *ranks):
        assert rec["hf_loss"] == pytest.approx(rec["manual_loss"], rel=1e-5)
    # TensorBoard through accelerate's trackers
    assert list(one.rglob("events.out.tfevents.*")), sorted(str(p) for p in one.rglob("*"))
    # nothing printed at interpreter exit on any process
    for err in runs:
        assert "Exception ignored" not in err and "Traceback" not in err
