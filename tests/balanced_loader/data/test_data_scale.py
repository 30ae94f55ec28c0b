"""One epoch order everywhere: the plan command cuts the loader's batches; mapped pages are released."""

from __future__ import annotations

import os

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.data.lengths import read_lengths, release_pages
from balanced_loader.loader import BalancedLoader
from balanced_loader.plan import Plan

COST = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 1e4,
        "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 512}


def test_plan_command_and_loader_cut_the_same_shuffled_batches(tmp_path):
    lengths = np.random.default_rng(9).integers(0, 1500, 3000)
    lengths[lengths == 0] = 1  # plan rejects empty docs in a lengths file
    np.save(tmp_path / "l.npy", lengths)
    (tmp_path / "cost.yaml").write_text("\n".join(f"{k}: {v}" for k, v in COST.items()) + "\n")
    out = tmp_path / "plan.json"
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--world-size", "8", "--cost-file",
            str(tmp_path / "cost.yaml"), "--policy", "greedy", "--global-batch-tokens", "20000", "--shuffle",
            "--seed", "3", "--shuffle-window", "256", "--max-seq-len", "1024", "--steps", "5", "--out", str(out)]
    assert cli.main(args) == 0
    planned = [s.doc_ids().tolist() for s in Plan.load(str(out)).steps]
    loader = BalancedLoader(lengths, policy="greedy", cost=CostModel.from_dict(COST), world_size=4,
                            global_batch_tokens=20000, seed=3, shuffle_window=256, max_seq_len=1024)
    loaded = [b.plan.doc_ids().tolist() for _, b in zip(range(5), loader)]
    assert planned == loaded and len(planned) == 5
    assert sorted(sum(planned, [])) != list(range(len(sum(planned, []))))  # shuffled, not the file's first docs


def rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from /proc (Linux)")
def test_release_pages_drops_mapped_pages_and_keeps_values(tmp_path):
    ln = np.arange(4_000_000, dtype=np.int64)  # 32 MB
    np.save(tmp_path / "big.npy", ln)
    mapped = read_lengths(tmp_path / "big.npy", check=False)
    before = rss_file_kb()
    assert int(mapped[::512].sum()) == int(ln[::512].sum())  # touches every page
    touched = rss_file_kb()
    release_pages(mapped)
    assert touched - before > 16_000 and rss_file_kb() - before < 4_000
    assert int(mapped[123_456]) == 123_456  # still readable: pages map back in
    view = np.asarray(mapped)[10:]  # views of the map (a shard index's lengths) are released through their base
    int(view[::512].sum())
    release_pages(view)
    assert rss_file_kb() - before < 4_000
    release_pages(ln)  # an array in memory: nothing to do
