"""Reliability III (issue 38), the runtime's ``--out``: never one of the run's inputs (its data source, the
recipe, the cost file) nor a device, in one line; a run refused after rank 0 made ``--out`` leaves no folder
behind (was: an empty ``--out``, and its parents)."""

from __future__ import annotations

import os

from test_run_outputs import HETERO, REPO, _args, _one_line, sets  # noqa: F401  (sets: the fixture)

from parallel_runtime.__main__ import main


def test_a_refused_run_removes_the_out_it_made(sets, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "new" / "run"
    assert main(_args(out, [*sets, "model.vocab_size=100"], 1)) == 2
    assert "model.vocab_size is 100" in _one_line(capsys)
    assert not (tmp_path / "new").exists()  # was: new/run left, empty
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".lock")]
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(_args(kept, [*sets, "model.vocab_size=100"], 1)) == 2
    capsys.readouterr()
    assert kept.is_dir()  # a folder that was there stays


def test_an_out_that_is_an_input_or_a_device_is_refused(sets, tmp_path, capsys):  # noqa: F811
    source = next(s.split("=", 1)[1] for s in sets if s.startswith("data.source="))
    before = sorted(os.listdir(source))
    assert main(_args(source, sets, 1)) == 2  # was: metrics and checkpoints written into the shard folder
    assert f"--out {source} is also an input of this command" in _one_line(capsys)
    assert sorted(os.listdir(source)) == before
    cost = str(REPO / "recipes" / "cost-cpu-tiny.yaml")
    assert main(_args(cost, sets, 1)) == 2
    assert "is a file, not a folder" in _one_line(capsys)
    assert main(_args("/dev/null", sets, 1)) == 2
    assert "names a device or process file" in _one_line(capsys)
    assert main(_args(HETERO, sets, 1)) == 2
    capsys.readouterr()
