"""One writer per output and a full disk, with real processes (issue 24).

* the lock: a ``build-shards`` on an ``--out`` another process holds exits 2 in one line naming that
  process; two builds started at once on one ``--out``: one succeeds, the other exits 2, and the folder
  holds exactly one build;
* a full disk: a real small filesystem (a 320 KiB ``tmpfs`` mounted in a private mount namespace with
  ``unshare -m``, so nothing outlives the test), not an injected error. ``build-shards`` that runs out of
  space leaves nothing that ``open_source`` opens and nothing that blocks a rerun; ``compare`` and
  ``analyze`` into a folder holding an earlier set keep that set whole. These need root (to mount);
  elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from balanced_loader.data.shards import ShardSource
from balanced_loader.outputs.locks import OutputLock, lock_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
COST = os.path.join(REPO, "recipes", "cost-cpu-tiny.yaml")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """60 text files of 2,000 bytes (their shards take about 180 KB of the 320 KiB filesystem)."""
    d = tmp_path_factory.mktemp("in")
    rng = np.random.default_rng(0)
    for i in range(60):
        (d / f"f{i:03d}.txt").write_bytes(bytes(rng.integers(97, 123, size=2000).astype(np.uint8)))
    return d


def _build(inputs, out, *extra) -> list[str]:
    return [sys.executable, "-m", "balanced_loader", "build-shards", str(inputs), "--out", str(out), "--no-progress",
            "--shard-mb", "0.01", *extra]


def test_a_build_on_a_locked_out_exits_2_naming_the_holder(inputs, tmp_path):
    out = tmp_path / "shards"
    with OutputLock(out, "--out"):  # this test process holds it, as a running build would
        p = subprocess.run(_build(inputs, out), capture_output=True, text=True, env=ENV, timeout=120)
        assert p.returncode == 2, p.stderr
        line = p.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line
        assert f"--out {out} is in use by pid {os.getpid()} on " in line and "choose another --out" in line
        assert not out.exists()
    assert not os.path.exists(lock_path(out))  # released: the lock file goes with it
    assert subprocess.run(_build(inputs, out), capture_output=True, env=ENV, timeout=120).returncode == 0
    assert ShardSource(str(out)).num_docs == 60 and sorted(os.listdir(tmp_path)) == ["shards"]


def test_two_builds_at_once_one_wins_and_the_folder_holds_one_build(inputs, tmp_path):
    out = tmp_path / "shards"
    procs = [subprocess.Popen(_build(inputs, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=ENV) for _ in range(2)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = next(e for rc, e in results if rc == 2).strip()
    # the loser met the lock (still building) or the finished folder (done already): one line either way
    assert len(err.splitlines()) == 1 and ("is in use by pid" in err or "already holds files" in err), err
    src = ShardSource(str(out))
    assert src.num_docs == 60 and sorted(os.listdir(tmp_path)) == ["shards"]  # no staging folder, no lock file
    assert src.tokens(59).tobytes() == (inputs / "f059.txt").read_bytes()


@functools.cache
def _tmpfs_reason() -> str | None:
    """Why a private tmpfs cannot be mounted here (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a small tmpfs in a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here ({probe.stderr.strip()[:100]})"


def _in_small_fs(tmp_path, script: str, size: str = "320k") -> dict:
    """Run ``script`` (Python; ``MNT`` is the mount point) on a fresh ``size`` tmpfs; returns its JSON line."""
    reason = _tmpfs_reason()
    if reason:
        pytest.skip(reason)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = tmp_path / "inner.py"
    code.write_text(textwrap.dedent(script))
    sh = f"mount -t tmpfs -o size={size} tmpfs {mnt} && exec {sys.executable} {code}"
    p = subprocess.run(["unshare", "-m", "sh", "-c", sh], capture_output=True, text=True, timeout=300,
                       env={**ENV, "MNT": str(mnt)})
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


FILL = '''
def fill(mnt, leave):
    """Fill the filesystem, then give back ``leave`` bytes."""
    path = os.path.join(mnt, "filler")
    f = open(path, "wb")
    try:
        while True:
            f.write(b"x" * 4096)
            f.flush()
    except OSError:
        pass
    try:
        f.close()
    except OSError:
        pass
    os.truncate(path, max(0, os.path.getsize(path) - leave))
    return path
'''


def test_a_build_that_fills_the_disk_leaves_nothing_that_opens(inputs, tmp_path):
    got = _in_small_fs(tmp_path, f'''
        import json, os, subprocess, sys
        {FILL.strip().replace(chr(10), chr(10) + "        ")}
        mnt = os.environ["MNT"]
        out = os.path.join(mnt, "shards")
        cmd = [out if a == "OUT" else a for a in {_build(inputs, "OUT")!r}]
        filler = fill(mnt, 60_000)  # room for about a third of the shards
        p = subprocess.run(cmd, capture_output=True, text=True)
        import balanced_loader as bl
        try:
            bl.open_source(out)
            opened = True
        except ValueError:
            opened = False
        left = sorted(f for f in os.listdir(mnt) if f != "filler")
        os.remove(filler)  # the disk has room again: the rerun must not be refused
        q = subprocess.run(cmd, capture_output=True, text=True)
        print(json.dumps({{"rc": p.returncode, "err": p.stderr, "opened": opened, "left": left,
                          "rerun": q.returncode, "rerun_err": q.stderr, "docs": bl.open_source(out).num_docs}}))
    ''')
    assert got["rc"] == 2 and len(got["err"].strip().splitlines()) == 1, got["err"]
    assert "No space left on device (the partial build was removed; nothing was written to" in got["err"]
    assert not got["opened"] and got["left"] == []  # no folder, no staging folder, no lock file
    assert got["rerun"] == 0 and got["docs"] == 60, got["rerun_err"]


@pytest.mark.parametrize("command", ["compare", "analyze"])
def test_compare_and_analyze_on_a_full_disk_keep_the_previous_set(command, tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(100, 4000, size=300)) + "\n")
    if command == "compare":
        args = ["compare", "--lengths", str(lengths), "--policies", "greedy", "--world-size", "4",
                "--cost-file", COST, "--global-batch-tokens", "20000", "--steps", "2"]
        again = ["--shuffle", "--seed", "3"]
    else:
        args, again = ["analyze", str(lengths), "--cost-file", COST], ["--max-seq-len", "1000"]
    got = _in_small_fs(tmp_path, f'''
        import hashlib, json, os, subprocess, sys
        {FILL.strip().replace(chr(10), chr(10) + "        ")}
        mnt = os.environ["MNT"]
        out = os.path.join(mnt, "out")
        cmd = [sys.executable, "-m", "balanced_loader", *{args!r}, "--out", out]
        first = subprocess.run(cmd, capture_output=True, text=True)
        def snap():
            return {{f: hashlib.sha256(open(os.path.join(out, f), "rb").read()).hexdigest()
                    for f in sorted(os.listdir(out))}}
        before = snap()
        fill(mnt, 24_000)  # less than the new set needs
        second = subprocess.run(cmd + {again!r}, capture_output=True, text=True)
        print(json.dumps({{"first": first.returncode, "rc": second.returncode, "err": second.stderr,
                          "before": before, "after": snap()}}))
    ''', size="400k")
    assert got["first"] == 0 and len(got["before"]) >= 2
    assert got["rc"] == 2 and len(got["err"].strip().splitlines()) == 1 and "No space left" in got["err"], got["err"]
    assert got["after"] == got["before"]  # the old set, whole; no new file beside old ones, no temporary file
