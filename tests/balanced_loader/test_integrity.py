"""Shard integrity and complete-or-absent outputs.

A corrupted shard folder (index edited, token bytes flipped, a shard swapped for another of the
same size) never yields different tokens: every read returns the written tokens or raises one
``ValueError`` naming the shard file and the doc. ``balanced-loader verify`` lists the problems.
Failed writes (disk full, an exception mid-write) leave no partial file and keep an existing one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.build.writer import write_shards
from balanced_loader.data.index import CRC_FILE, INDEX_FILE, META_FILE
from balanced_loader.data.integrity import CHECK_BLOCK_BYTES, lengths_fingerprint
from balanced_loader.data.shards import ShardSource
from balanced_loader.outputs import files as files_mod
from balanced_loader.outputs.files import atomic_write, write_text
from balanced_loader.plan import Group, Plan, Pool, StepPlan

DOCS_PER_SHARD = 4
DOC_LEN = 700  # 1,400 bytes a doc: two checksum blocks, all shards the same size


def make_docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65_000, size=DOC_LEN).astype(np.uint16) for _ in range(4 * DOCS_PER_SHARD)]


@pytest.fixture
def folder(tmp_path):
    docs = make_docs(0)
    write_shards(docs, str(tmp_path / "a"), max_docs_per_shard=DOCS_PER_SHARD)
    return tmp_path / "a", docs


def _edit_index(path, name, doc, fn):
    arr = np.load(path / f"index.{name}.npy")
    arr[doc] = fn(arr[doc])
    np.save(path / f"index.{name}.npy", arr)


def _flip_token_byte(path, doc):
    src = ShardSource(str(path))
    shard, off = src.location(doc)
    src.close()
    with open(shard, "r+b") as f:
        f.seek(off + 2 * DOC_LEN - 3)  # in the doc's last checksum block
        b = f.read(1)
        f.seek(off + 2 * DOC_LEN - 3)
        f.write(bytes([b[0] ^ 0x10]))


def _replace_shard(path, tmp_path, other_build):
    if other_build:  # the same shard of another build: same name, same member names, other tokens
        write_shards(make_docs(1), str(tmp_path / "b"), max_docs_per_shard=DOCS_PER_SHARD)
        shutil.copyfile(tmp_path / "b" / "shard-000001.tar", path / "shard-000001.tar")
    else:  # another shard of this build, of the same size
        shutil.copyfile(path / "shard-000002.tar", path / "shard-000001.tar")


DOC = 5  # a doc of shard 1
CORRUPTIONS = {
    "index length +7": lambda p, t: _edit_index(p, "lengths", DOC, lambda v: v + 7),
    "index length -7": lambda p, t: _edit_index(p, "lengths", DOC, lambda v: v - 7),
    "index offset +1 token": lambda p, t: _edit_index(p, "offset", DOC, lambda v: v + 2),
    "index shard number swapped": lambda p, t: _edit_index(p, "shard", DOC, lambda v: v + 1),
    "flipped token bytes": lambda p, t: _flip_token_byte(p, DOC),
    "shard replaced by another of equal size": lambda p, t: _replace_shard(p, t, other_build=False),
    "shard replaced by the same shard of another build": lambda p, t: _replace_shard(p, t, other_build=True),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupted_shards_never_yield_different_tokens(folder, tmp_path, case, capsys):
    path, docs = folder
    sizes = {f: os.path.getsize(path / f) for f in os.listdir(path) if f.endswith(".tar")}
    assert len(set(sizes.values())) == 1  # every shard has the same size (the swap keeps sizes)
    CORRUPTIONS[case](path, tmp_path)
    assert {f: os.path.getsize(path / f) for f in sizes} == sizes  # the size check at open cannot see it
    src = ShardSource(str(path))  # opens: index sizes still match
    failed = set()
    for d in range(src.num_docs):
        n = int(src.lengths[d])
        for start, length in ((0, n), (1, max(n - 2, 0)), (n // 2, min(5, n - n // 2))):
            fresh = ShardSource(str(path))  # a fresh source: the first read of a doc checks its headers
            try:
                got = fresh.read(d, start, length)
            except ValueError as e:
                assert f"doc {d}" in str(e) and ".tar" in str(e), e
                failed.add(d)
                continue
            np.testing.assert_array_equal(got, docs[d][start:start + length])  # never different tokens
    assert DOC in failed
    capsys.readouterr()
    assert cli.main(["verify", str(path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("problem:") for line in out) and "problem(s)" in out[-1]


def test_verify_clean_folder_and_checks_on_by_default(folder, capsys):
    path, docs = folder
    assert cli.main(["verify", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [out[-1]] and "no problems" in out[-1] and f"{len(docs)} docs" in out[-1]
    src = ShardSource(str(path))
    assert src.verify == "full" and src.has_checksums
    index = json.loads((path / INDEX_FILE).read_text())
    assert index["lengths_fingerprint"] == lengths_fingerprint(np.array([len(d) for d in docs]))
    assert index["member_names"] == "doc_id" and index["check_block_bytes"] == CHECK_BLOCK_BYTES
    assert all("crc32" in s for s in index["shards"])


def test_flipped_bytes_pass_the_header_only_mode(folder):
    """Why checksums are on by default: headers alone cannot see changed token bytes."""
    path, docs = folder
    _flip_token_byte(path, DOC)
    assert not np.array_equal(ShardSource(str(path), verify="header").tokens(DOC), docs[DOC])
    with pytest.raises(ValueError, match=rf"shard-000001.tar does not match the index at doc {DOC}: the checksum"):
        ShardSource(str(path)).tokens(DOC)


def _make_legacy(path):
    """A folder as written before checksums: no shards.crc.npy, no crc32 fields, no index."""
    os.remove(path / CRC_FILE)
    meta = json.loads((path / META_FILE).read_text())
    meta.pop("check_block_bytes")
    for s in meta["shards"]:
        s.pop("crc32")
    (path / META_FILE).write_text(json.dumps(meta))
    for f in os.listdir(path):
        if f.startswith("index."):
            os.remove(path / f)


def test_folder_without_checksums_is_readable_with_the_header_check(folder, capsys):
    path, docs = folder
    _make_legacy(path)
    with pytest.raises(ValueError, match="has no length index"):  # never indexed on open
        ShardSource(str(path))
    assert cli.main(["index", str(path), "--no-progress"]) == 0
    assert "reads check headers only" in capsys.readouterr().out
    src = ShardSource(str(path))
    assert not src.has_checksums
    for d in range(len(docs)):
        np.testing.assert_array_equal(src.tokens(d), docs[d])
    assert cli.main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "checksums missing" in out and "no problems" in out
    _edit_index(path, "offset", DOC, lambda v: v + 2)
    with pytest.raises(ValueError, match=rf"shard-000001.tar does not match the index at doc {DOC}"):
        ShardSource(str(path)).tokens(DOC)


def test_verify_reports_a_changed_length_index(folder, capsys):
    path, _ = folder
    lengths = np.load(path / "index.lengths.npy")
    lengths[3] += 7
    lengths[DOC] -= 7  # same doc count and total tokens
    np.save(path / "index.lengths.npy", lengths)
    assert cli.main(["verify", str(path)]) == 2
    out = capsys.readouterr().out
    assert "lengths fingerprint" in out and "index.lengths.npy differs from the shards" in out


# ---------------------------------------------------------------------------------------------
# Complete-or-absent writes
# ---------------------------------------------------------------------------------------------


def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _leftovers(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".tmp"))


def test_atomic_write_keeps_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old\n")
    monkeypatch.setattr(files_mod.os, "fsync", _no_space)
    with pytest.raises(OSError) as ei, atomic_write(target) as f:
        f.write("new, partly written")
    assert str(target) in str(ei.value) and "No space left on device" in str(ei.value)
    assert "None" not in str(ei.value)
    assert target.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_atomic_write_discards_on_an_exception_mid_write(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(target, "wb") as f:
        f.write(b"half")
        raise RuntimeError("boom")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    with atomic_write(target, "wb") as f:
        f.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
    assert (target.stat().st_mode & 0o777) == 0o666 & ~files_mod._umask()  # not mkstemp's 0600


def test_plan_write_failure_keeps_the_previous_plan(tmp_path, monkeypatch):
    pool = Pool(tp=1, pp=1, ranks=((0,),), microbatches=((Group(lanes=(0,), segments=((0, 0, 10),)),),))
    plan = Plan(policy="hand", world_size=1, steps=(StepPlan(step=0, world_size=1, pools=(pool,)),))
    path = tmp_path / "plan.json"
    write_text(str(path), plan.dumps())
    before = path.read_text()
    monkeypatch.setattr(files_mod.os, "fsync", _no_space)
    with pytest.raises(OSError, match="No space left on device"):
        write_text(str(path), Plan(policy="other", world_size=1, steps=plan.steps).dumps())
    assert path.read_text() == before and _leftovers(tmp_path) == []


def test_compare_with_a_full_disk_is_one_line_and_keeps_old_outputs(tmp_path, monkeypatch, capsys):
    (tmp_path / "l.txt").write_text("10\n20\n30\n")
    out = tmp_path / "cmp"
    argv = ["compare", "--lengths", str(tmp_path / "l.txt"), "--policies", "greedy", "--world-size", "2",
            "--cost", "analytic:tiny@cpu", "--global-batch-tokens", "30", "--out", str(out)]
    assert cli.main(argv) == 0
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert set(before) == {"compare.json", "rank_load.png", "step_times.png"}
    capsys.readouterr()
    monkeypatch.setattr(files_mod.os, "fsync", _no_space)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write {out / 'compare.json'}: No space left on device" in err[0], err
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


def test_chart_failure_mid_savefig_leaves_no_partial_png(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from balanced_loader.cli import charts

    png = tmp_path / "t.png"
    charts.step_times({"a": [1.0, 2.0]}, str(png), title="t")
    before = png.read_bytes()

    def half_then_full(self, f, **kw):
        f.write(b"\x89PNG half")
        _no_space()

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    with pytest.raises(OSError, match="No space left on device"):
        charts.step_times({"a": [3.0]}, str(png), title="t")
    assert png.read_bytes() == before and _leftovers(tmp_path) == []


def test_shard_writer_failures_leave_no_files(tmp_path, monkeypatch):
    from balanced_loader.data.integrity import CrcFile

    docs = make_docs(0)

    def gen():
        yield from docs[:9]
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError):
        write_shards(gen(), str(tmp_path / "x"), max_docs_per_shard=DOCS_PER_SHARD)
    assert os.listdir(tmp_path) == []  # neither x nor its staging folder: no partial dataset to index

    write = CrcFile.write

    def full_at(limit):
        """A disk that fills up once a shard holds ``limit`` bytes."""
        def full(self, b):
            if self.size + len(b) > limit:
                _no_space()
            return write(self, b)
        return full

    first = write_shards(docs, str(tmp_path / "ok"), max_docs_per_shard=DOCS_PER_SHARD)
    # full while the first member is written, then while the end of the archive (>= 1024 bytes, the last write) is
    for i, limit in enumerate([1, first.index["shards"][0]["bytes"] - 1]):
        monkeypatch.setattr(CrcFile, "write", full_at(limit))
        with pytest.raises(OSError, match=r"cannot write .*shard-000000.tar: No space left on device"):
            write_shards(docs, str(tmp_path / f"y{i}"), max_docs_per_shard=DOCS_PER_SHARD)
        assert not os.path.exists(tmp_path / f"y{i}")
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no staging folder left
