"""Reliability III (issue 38), outputs never clobbered: every command refuses an ``--out`` that is one of its
inputs or that is not a file (folder) it may replace (a device, a pipe, a link to one) in one line; a
command's outputs are published as one set (``trace --out --png`` with the disk full on the chart keeps
neither); an error found after a command made its ``--out`` folder removes that folder again."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_errors import GOOD_COST

from balanced_loader import cli
from balanced_loader.outputs.files import atomic_write, check_output

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A 16-rank plan of three steps (p16.json) made by the CLI from a real length file, and a cost file."""
    import gzip

    root = tmp_path_factory.mktemp("clobber")
    with gzip.open(REPO / "data" / "wikipedia_lengths.txt.gz", "rt") as f:
        (root / "l.txt").write_text("".join(line for _, line in zip(range(3000), f)))
    (root / "cost.yaml").write_text(GOOD_COST)
    assert cli.main(["plan", "--lengths", str(root / "l.txt"), "--global-batch-tokens", "20000", "--world-size",
                     "16", "--cost-file", str(root / "cost.yaml"), "--policy", "hydra", "--max-seq-len", "1000",
                     "--steps", "3", "--out", str(root / "p16.json")]) == 0
    return root


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _trace(work, *out):
    return cli.main(["trace", str(work / "p16.json"), "--cost-file", str(work / "cost.yaml"), *map(str, out)])


def test_trace_refuses_to_write_over_the_plan_it_reads(work, capsys):
    before = (work / "p16.json").read_bytes()
    assert _trace(work, "--out", work / "p16.json") == 2  # was: the plan overwritten by its own trace
    assert "--out" in (line := _one_line(capsys)) and "is also an input of this command" in line
    assert (work / "p16.json").read_bytes() == before
    assert _trace(work, "--out", work / "t.json", "--png", work / "t.json") == 2
    assert "is the same file as --out" in _one_line(capsys)
    (work / "p16_link.json").symlink_to(work / "p16.json")  # the input through a link is the input too
    assert _trace(work, "--png", work / "p16_link.json") == 2
    assert "is also an input" in _one_line(capsys)


@pytest.mark.parametrize("target", ["fifo", "link to /dev/null", "/dev/full", "/dev/stdout", "folder"])
def test_an_out_that_is_not_a_file_it_may_replace_is_refused(work, tmp_path, capsys, target):
    if target == "fifo":
        out = tmp_path / "pipe"
        os.mkfifo(out)
    elif target == "link to /dev/null":
        out = tmp_path / "null.json"
        out.symlink_to("/dev/null")
    elif target == "folder":
        out = tmp_path
    else:
        out = Path(target)
    mode = os.lstat(out).st_mode
    assert _trace(work, "--out", out) == 2  # was (as root): the device or the link renamed over by a file
    line = _one_line(capsys)
    assert f"--out {out}" in line and ("device or process file" in line or "not a regular file" in line), line
    assert os.lstat(out).st_mode == mode  # still what it was
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    # the writers' own guard
    with pytest.raises(ValueError, match="not a regular file|device or process file"), atomic_write(out) as f:
        f.write("x")


def test_a_link_to_a_file_is_written_through_and_stays_a_link(work, tmp_path, capsys):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert _trace(work, "--out", tmp_path / "link.json") == 0
    assert os.path.islink(tmp_path / "link.json")  # was: the link replaced by a regular file
    assert (tmp_path / "real.json").read_text().startswith("{")


def _limited(limit: int):
    def pre() -> None:  # a file may grow to `limit` bytes only: a disk that fills up while the chart is written
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_trace_json_and_png_are_published_together_on_a_full_disk(work, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    argv = [sys.executable, "-m", "balanced_loader", "trace", str(work / "p16.json"), "--cost-file",
            str(work / "cost.yaml"), "--steps", "0-1", "--out", str(out), "--png", str(png)]
    ok = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert ok.returncode == 0, ok.stderr
    size_json, size_png = out.stat().st_size, png.stat().st_size
    assert size_json < size_png
    out.unlink()
    png.unlink()
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300,
                       preexec_fn=_limited((size_json + size_png) // 2))  # the JSON fits, the chart does not
    assert r.returncode == 2 and "File too large" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == []  # was: t.json left behind without its chart


def test_an_error_after_out_was_made_removes_it(work, tmp_path, capsys):
    out = tmp_path / "new" / "cmp"
    assert cli.main(["compare", "--lengths", str(work / "l.txt"), "--global-batch-tokens", "20000", "--world-size",
                     "4", "--cost-file", str(work / "cost.yaml"), "--policies", "greedy", "--steps", "2",
                     "--chart-step", "5", "--out", str(out)]) == 2
    assert "--chart-step 5 is outside" in _one_line(capsys)
    assert not (tmp_path / "new").exists()  # was: an empty folder (and its parent) left behind
    keep = tmp_path / "kept"
    keep.mkdir()
    assert cli.main(["compare", "--lengths", str(work / "l.txt"), "--global-batch-tokens", "20000", "--world-size",
                     "4", "--cost-file", str(work / "cost.yaml"), "--policies", "greedy", "--steps", "2",
                     "--chart-step", "5", "--out", str(keep)]) == 2
    assert keep.is_dir()  # a folder the user made stays
    for argv in (["analyze", str(work / "l.txt")], ["analyze", "--mix", f"a={work / 'l.txt'}:1",
                                                     f"b={work / 'l.txt'}:2"]):  # a disk full on the chart
        r = subprocess.run([sys.executable, "-m", "balanced_loader", *argv, "--out", str(tmp_path / "an" / "x")],
                           capture_output=True, text=True, env=ENV, timeout=300, preexec_fn=_limited(2000))
        assert r.returncode == 2 and "File too large" in r.stderr, r.stderr
        assert not (tmp_path / "an").exists()  # was: the empty folders left behind


def test_a_folder_output_that_would_write_over_an_input_is_refused(work, tmp_path, capsys):
    assert cli.main(["analyze", str(work / "l.txt"), "--top", "3", "--out", str(tmp_path / "an")]) == 0
    capsys.readouterr()
    before = (tmp_path / "an" / "analyze.json").read_bytes()
    assert cli.main(["analyze", str(tmp_path / "an" / "analyze.json"), "--out", str(tmp_path / "an")]) == 2
    assert "(its analyze.json) is also an input" in _one_line(capsys)
    assert (tmp_path / "an" / "analyze.json").read_bytes() == before
    assert cli.main(["build-shards", str(work / "l.txt"), "--out", str(work / "l.txt")]) == 2
    assert "is a file, not a folder" in _one_line(capsys)


def test_check_output_names_each_case():
    with pytest.raises(ValueError, match="is also an input"):
        check_output(__file__, inputs=[__file__])
    check_output("/tmp/new-file-that-does-not-exist.json", inputs=[__file__])


def test_a_killed_runs_temporary_file_is_removed_by_the_next_run(work, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    p = subprocess.Popen([sys.executable, "-m", "balanced_loader", "trace", str(work / "p16.json"), "--cost-file",
                          str(work / "cost.yaml"), "--out", str(out), "--png", str(png)], env=ENV)
    for _ in range(600):  # until its first temporary file is there, then kill -9
        if [f for f in os.listdir(tmp_path) if f.startswith(".t.json.")]:
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    left = [f for f in os.listdir(tmp_path) if f.startswith(".")]
    assert left and not out.exists()  # the output untouched, a hidden temporary file left behind
    assert _trace(work, "--out", out, "--png", png) == 0
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.png"]  # the next run removed the dead run's files


def test_a_killed_charts_nested_temporary_file_is_removed_too(work, tmp_path):
    """Found by tools/probe_reliability3.py: the chart writer writes atomically into the OutputSet's temporary
    file, so a run killed then leaves '..t.png.pPID-HOST.X.tmp.png.pPID-HOST.Y.tmp', which the next run kept
    (2 of 20 killed runs)."""
    from balanced_loader.outputs.files import _HOST

    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = f"p{dead.pid}-{_HOST}"
    names = [f".t.png.{tag}.abcdefgh.tmp.png", f"..t.png.{tag}.abcdefgh.tmp.png.{tag}.ijklmnop.tmp",
             f".t.json.{tag}.qrstuvwx.tmp"]
    for n in names:
        (tmp_path / n).write_bytes(b"partial")
    (tmp_path / f".other.png.{tag}.abcdefgh.tmp").write_bytes(b"not ours")
    assert _trace(work, "--out", tmp_path / "t.json", "--png", tmp_path / "t.png") == 0
    assert sorted(os.listdir(tmp_path)) == [f".other.png.{tag}.abcdefgh.tmp", "t.json", "t.png"]
