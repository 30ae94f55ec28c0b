"""Remote shard folders: byte-range reads over a real local HTTP server (and fsspec's memory://), the
4-rank epoch through the loader with the bytes served counted, the cache, and one-line errors."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from balanced_loader import cli
from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.data.open import open_source
from balanced_loader.data.shards import ShardSource
from balanced_loader.diagnostics.range_server import RangeServer
from balanced_loader.loader import BalancedLoader

WORLD = 4
LANE_CAP = 16384  # docs over this need a CP group; over WORLD * LANE_CAP they are split into segments


def make_docs(n: int = 240, seed: int = 0) -> list[np.ndarray]:
    """Mostly short docs and a long tail (the long ones are read in pieces by CP groups)."""
    rng = np.random.default_rng(seed)
    short = rng.integers(200, 4000, size=n)
    long = rng.integers(12_000, 100_000, size=n)
    lengths = np.where(rng.random(n) < 0.25, long, short)
    return [rng.integers(0, 65_000, size=int(k)).astype(np.uint16) for k in lengths]


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shards") / "data")
    src = write_shards(make_docs(), folder, max_shard_bytes=2_000_000)
    assert len(src.shard_names) >= 4
    return src


@pytest.fixture(scope="module")
def server(local):
    with RangeServer(local.folder) as s:
        yield s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_doc_equals_the_local_folder(local, server):
    server.reset()
    src = open_source(server.url + "/")
    assert src.remote and src.num_docs == local.num_docs and src.has_checksums
    assert np.array_equal(src.lengths, local.lengths) and src.fingerprint() == local.fingerprint()
    assert src.shard_path(0) == f"{server.url}/{local.shard_names[0]}"
    rng = np.random.default_rng(1)
    for d in range(local.num_docs):
        n = int(local.lengths[d])
        assert np.array_equal(src.tokens(d), local.tokens(d))
        a = int(rng.integers(0, n))
        k = int(rng.integers(0, n - a + 1))
        assert np.array_equal(src.read(d, a, k), local.read(d, a, k))
    # the bytes read are the bytes the server sent for the shards: no read-ahead, no block cache
    served = server.bytes_served
    assert sum(v for k, v in served.items() if k.endswith(".tar")) == src.bytes_read
    # pickling (DataLoader workers) reconnects and reads the same tokens
    again = pickle.loads(pickle.dumps(src))
    assert again.remote and np.array_equal(again.tokens(7), local.tokens(7))


def test_four_ranks_one_epoch_over_http(local, server):
    """The must-hold: 4 ranks, each with its own remote source, read one epoch through the loader; every
    doc is delivered exactly once with the local folder's tokens, and the server sends at most 1.2x the
    folder's size on disk (index files of all 4 ranks included)."""
    server.reset()
    cost = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0, 16: 1.0},
                                "max_tokens_per_lane": LANE_CAP})
    loaders = [BalancedLoader(open_source(server.url), policy="greedy", cost=cost, world_size=WORLD, rank=r,
                              global_batch_tokens=2 * WORLD * LANE_CAP, seed=3, epochs=1) for r in range(WORLD)]
    pieces: dict[int, list[tuple[int, int]]] = {}
    partial = 0
    for batches in zip(*loaders, strict=True):
        assert len({b.plan.fingerprint() for b in batches}) == 1
        for b in batches:
            for mb in b.microbatches:
                o = 0
                for doc, start, length in mb.segments:
                    if doc >= 0:
                        assert np.array_equal(mb.input_ids[o:o + length], local.read(doc, start, length))
                        pieces.setdefault(doc, []).append((start, length))
                        partial += length < int(local.lengths[doc])
                    o += length
    assert sorted(pieces) == list(range(local.num_docs))
    for doc, ps in pieces.items():  # the pieces of each doc tile it exactly once
        pos = 0
        for start, length in sorted(ps):
            assert start == pos
            pos += length
        assert pos == int(local.lengths[doc])
    assert partial > 100  # CP groups and split docs: most long docs were read in pieces
    ratio = server.total_bytes() / folder_bytes(local.folder)
    print(f"bytes served / folder bytes: {ratio:.3f} ({server.requests} requests)")
    assert ratio <= 1.2


def test_cache_dir_keeps_the_index_and_whole_shards(local, server, tmp_path):
    server.reset()
    src = open_source(server.url, cache_dir=str(tmp_path))
    first = server.total_bytes()
    src.close()
    server.reset()
    src = open_source(server.url, cache_dir=str(tmp_path))  # index.json (and the range probe) only
    assert set(server.bytes_served) == {"/index.json"} and server.total_bytes() < first
    assert np.array_equal(src.tokens(3), local.tokens(3))
    # whole shards on first read: each shard crosses the network once, then reads are local
    server.reset()
    src = open_source(server.url, cache_dir=str(tmp_path), cache_shards=True)
    for d in range(0, local.num_docs, 5):
        assert np.array_equal(src.read(d, 1, int(local.lengths[d]) - 1), local.read(d, 1, int(local.lengths[d]) - 1))
    tars = {k: v for k, v in server.bytes_served.items() if k.endswith(".tar")}
    sizes = {f"/{s['name']}": s["bytes"] for s in local.index["shards"]}
    assert tars == {k: sizes[k] for k in tars} and len(tars) == len(sizes)


def test_server_without_range_support(local, tmp_path):
    with RangeServer(local.folder, ranges=False) as s:
        src = open_source(s.url)  # planning reads only the index files: no Range needed
        assert np.array_equal(src.lengths, local.lengths) and src.fingerprint() == local.fingerprint()
        with pytest.raises(ValueError, match="ignores HTTP range requests .* got \\d+\\)"):
            src.tokens(0)  # a 16-byte probe before the first token read
        assert not any(k.endswith(".tar") for k in s.bytes_served)  # caught before any shard was touched
        # whole-shard caching needs no Range: each shard is downloaded once, then read locally
        src = open_source(s.url, cache_dir=str(tmp_path), cache_shards=True)
        d = int(np.argmax(local.lengths))
        assert np.array_equal(src.read(d, 7, 3000), local.read(d, 7, 3000))
        assert np.array_equal(src.tokens(d), local.tokens(d))


def test_no_fsspec_import_for_the_cli_and_local_folders(local):
    code = ("import sys\nfrom balanced_loader.cli import main\nfrom balanced_loader.data.open import open_source\n"
            f"open_source({local.folder!r}).tokens(0)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 'aiohttp')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == "[]", out.stderr


def test_errors_are_one_clear_line(local, tmp_path):
    port = free_port()  # closed: nothing listens there
    with pytest.raises(ValueError, match=f"cannot reach http://127.0.0.1:{port}/data/index.json: check the URL"):
        open_source(f"http://127.0.0.1:{port}/data")
    bare = tmp_path / "bare"
    shutil.copytree(local.folder, bare)
    for f in os.listdir(bare):
        if f.startswith("index."):
            os.remove(bare / f)
    with RangeServer(str(bare)) as s, pytest.raises(ValueError, match="index.json not found: a remote shard "
                                                                        "folder needs its length index"):
        open_source(s.url)
    shutil.copy(os.path.join(local.folder, "index.json"), bare / "index.json")
    with RangeServer(str(bare)) as s, pytest.raises(ValueError, match="index file .*/index.lengths.npy not found"):
        open_source(s.url)
    with pytest.raises(ValueError, match="Protocol not known: nosuch"):
        open_source("nosuch://bucket/data")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="s3:// URLs .* not installed .*: pip install s3fs$"):
            open_source("s3://bucket/data")


def test_missing_fsspec_names_the_extra():
    code = ("import sys; sys.modules['fsspec'] = None\n"
            "from balanced_loader.data.open import open_source\n"
            "try:\n    open_source('http://127.0.0.1:9/data')\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert "pip install 'balanced-loader[remote]'" in out.stdout, out.stderr


def test_corrupt_remote_shard_names_the_url(local, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(local.folder, bad)
    d = int(np.argmax(local.lengths))
    shard, off = local.location(d)
    with open(bad / os.path.basename(shard), "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with RangeServer(str(bad)) as s:
        src = open_source(s.url)
        with pytest.raises(ValueError, match=f"shard {s.url}/{os.path.basename(shard)} does not match the index "
                                             f"at doc {d}: the checksum"):
            src.read(d, 0, 200)


def test_cli_plan_over_http(local, server, tmp_path, capsys):
    cost = tmp_path / "cost.yaml"
    cost.write_text("quadratic_ms: 1.0e-4\nlinear_ms: 0.01\nmicrobatch_ms: 1.0\ncomm_bytes_per_token: 1.0e4\n"
                    "bandwidth_gbs: {2: 10.0}\nmax_tokens_per_lane: 40000\n")
    argv = ["plan", "--source", server.url, "--world-size", "4", "--cost-file", str(cost), "--policy", "greedy",
            "--global-batch-tokens", "100000", "--steps", "1", "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    argv[2] = f"http://127.0.0.1:{free_port()}/data"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("balanced-loader plan: error: cannot reach http://")


def test_memory_filesystem(local):
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in os.listdir(local.folder):
        with open(os.path.join(local.folder, f), "rb") as src:
            fs.pipe_file(f"/remote-test/{f}", src.read())
    src = open_source("memory://remote-test")
    try:
        assert src.remote and np.array_equal(src.lengths, local.lengths)
        for d in (0, 1, int(np.argmax(local.lengths))):
            assert np.array_equal(src.tokens(d), local.tokens(d))
            assert np.array_equal(src.read(d, 50, 30), local.read(d, 50, 30))
    finally:
        fs.rm("/remote-test", recursive=True)


def test_headers_ride_along_once_per_doc(local):
    """A doc's headers are read once per source: with its first read when that starts at the doc's start
    (one request), else on their own; later reads fetch token bytes only."""
    src = ShardSource(local.folder)
    d, e = np.argsort(local.lengths)[-2:].tolist()
    n = int(local.lengths[e])
    for doc, start in ((d, 5000), (e, 0)):
        before = src.bytes_read
        src.read(doc, start, 10)  # one checksum block of 1 KiB, plus the 640 header bytes on first touch
        assert src.bytes_read - before == 1024 + 640
        before = src.bytes_read
        src.read(doc, 0, 10)
        assert src.bytes_read - before == 1024
    before = src.bytes_read
    assert np.array_equal(src.tokens(e), local.tokens(e)) and src.bytes_read - before == 2 * n


def _read_in_child(src, doc, q):
    q.put(src.tokens(doc).tolist())


def test_fork_and_pickle_reconnect(local, server):
    """DataLoader workers: a forked child reads through the parent's remote source (fsspec's async
    filesystems are not fork-safe, so the store reconnects), and an unpickled one reconnects too."""
    import multiprocessing as mp

    src = open_source(server.url)
    d = int(np.argmax(local.lengths))
    assert np.array_equal(src.tokens(0), local.tokens(0))  # connected in the parent first
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(src, d, q))
    p.start()
    got = q.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0 and got == local.tokens(d).tolist()
    again = pickle.loads(pickle.dumps(src))
    assert again.remote and np.array_equal(again.tokens(d), local.tokens(d))


def test_prefetch_fetches_exactly_what_the_reads_take(local, server):
    """prefetch(reads) fetches the ranges of those reads concurrently; the reads then cost no request and
    return the same tokens, and the bytes are those of the same reads without prefetch."""
    rng = np.random.default_rng(5)
    reads = []
    for d in rng.choice(local.num_docs, size=40, replace=False).tolist():
        n = int(local.lengths[d])
        a = int(rng.integers(0, n))
        reads += [(d, a, int(rng.integers(1, n - a + 1))), (d, 0, n)]
    plain = open_source(server.url)
    server.reset()
    for r in reads:
        plain.read(*r)
    sequential = server.total_bytes()
    src = open_source(server.url)
    server.reset()
    src.prefetch(reads)
    fetched, requests = server.total_bytes(), server.requests
    for d, a, k in reads:
        assert np.array_equal(src.read(d, a, k), local.read(d, a, k))
    assert server.total_bytes() == fetched == sequential and server.requests == requests
