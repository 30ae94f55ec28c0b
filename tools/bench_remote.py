"""Remote shard folders: bytes served and docs/s of one epoch over HTTP, against the local folder.

A shard folder (built here with a long-tailed length mix, or ``--shards DIR``) is served by a local
HTTP server that honours ``Range`` and counts the bytes it sends
(:class:`balanced_loader.diagnostics.range_server.RangeServer`). ``--world`` ranks (one process, one loader
and one source each, as real ranks: each fetches the index itself) read one epoch through
:class:`BalancedLoader`; then the same with each rank opening the local folder. Repeated
``--repeats`` times, alternating; medians are reported.

* **bytes served / folder bytes**: everything the server sent (index files of every rank
  included) against the folder's size on disk; also split into index and shard bytes, and
  shard bytes against the token bytes the ranks' microbatches hold (needed).
* **docs/s**: docs delivered per second of the whole epoch (all ranks), remote against local.
  Localhost has no network latency (``--latency-ms`` adds some per request); ``--sequential``
  also times remote reads without the loader's prefetch (each read one request, in turn).

    python tools/bench_remote.py                      # 1000 synthetic docs, 4 ranks, lane cap 16384
    python tools/bench_remote.py --lane-cap 4096      # smaller CP chunks: more read widening per byte
    python tools/bench_remote.py --latency-ms 5 --sequential --repeats 1
    python tools/bench_remote.py --shards DIR --world 8
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import numpy as np

from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.data.open import open_source
from balanced_loader.data.shards import ShardSource
from balanced_loader.diagnostics.range_server import RangeServer
from balanced_loader.loader import BalancedLoader


def synthetic_docs(n: int, seed: int) -> list[np.ndarray]:
    """Mostly short docs (200-4k tokens) and a 25% long tail (12k-100k tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.25, rng.integers(12_000, 100_000, size=n), rng.integers(200, 4000, size=n))
    return [rng.integers(0, 65_000, size=int(k)).astype(np.uint16) for k in lengths]


def epoch(spec: str, args: argparse.Namespace, prefetch: bool = True) -> dict:
    """One epoch of ``args.world`` ranks, each with its own source opened from ``spec``."""
    cost = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0, 16: 1.0},
                                "max_tokens_per_lane": args.lane_cap})
    t0 = time.perf_counter()
    sources = [open_source(spec) for _ in range(args.world)]
    if not prefetch:
        for src in sources:
            src.prefetch = lambda reads: None  # each read fetched when it is made, one request after another
    loaders = [BalancedLoader(src, policy="greedy", cost=cost, world_size=args.world, rank=r,
                              global_batch_tokens=2 * args.world * args.lane_cap, seed=args.seed, epochs=1)
               for r, src in enumerate(sources)]
    docs: set[int] = set()
    needed = runs = 0
    for batches in zip(*loaders, strict=True):
        for b in batches:
            for mb in b.microbatches:
                for doc, _, length in mb.segments:
                    if doc >= 0:
                        docs.add(doc)
                        needed += length * sources[0].dtype.itemsize
                        runs += 1
    seconds = time.perf_counter() - t0
    for s in sources:
        s.close()
    return {"seconds": seconds, "docs": len(docs), "needed": needed, "runs": runs,
            "bytes_read": sum(s.bytes_read for s in sources)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", help="a shard folder (default: build --docs synthetic docs in a temporary folder)")
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--lane-cap", type=int, default=16384, help="max_tokens_per_lane: longer docs use CP groups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=0.0, help="the server waits this long per request")
    p.add_argument("--sequential", action="store_true",
                   help="also time remote reads without the loader's prefetch (one request after another)")
    args = p.parse_args(argv)
    logging.getLogger("balanced_loader").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.shards or os.path.join(tmp, "shards")
        if args.shards is None:
            write_shards(synthetic_docs(args.docs, args.seed), folder, max_shard_bytes=8 << 20).close()
        local = ShardSource(folder)
        folder_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                           if os.path.isfile(os.path.join(folder, f)))
        print(f"{folder}: {local.num_docs} docs, {local.num_tokens} tokens, {len(local.shard_names)} shards, "
              f"{folder_bytes} bytes on disk; world {args.world}, lane cap {args.lane_cap}, {args.repeats} repeats")
        paths = ("local", "remote", "remote-sequential") if args.sequential else ("local", "remote")
        times: dict[str, list[float]] = {k: [] for k in paths}
        with RangeServer(folder, latency_ms=args.latency_ms) as server:
            for i in range(args.repeats):
                for what in paths[i % len(paths):] + paths[:i % len(paths)]:
                    server.reset()
                    r = epoch(folder if what == "local" else server.url, args, prefetch=what == "remote")
                    assert r["docs"] == int((local.lengths > 0).sum()), "an epoch must deliver every doc"
                    times[what].append(r["seconds"])
                    if what == "remote":
                        served, requests, remote = server.bytes_served, server.requests, r
        shards = sum(v for k, v in served.items() if k.endswith(".tar"))
        index = sum(served.values()) - shards
        total = shards + index
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"bytes served / folder bytes: {total / folder_bytes:.3f} ({total} bytes: index files "
              f"{index} = {index / folder_bytes:.3f} for {args.world} ranks, shards {shards} = "
              f"{shards / folder_bytes:.3f}); {requests} requests, {remote['runs']} token runs")
        print(f"shard bytes served / token bytes needed: {shards / remote['needed']:.3f}")
        rates = ", ".join(f"{k} {local.num_docs / v:.0f}" for k, v in med.items())
        print(f"docs/s (all ranks, median of {args.repeats}, server latency {args.latency_ms:g} ms): {rates} "
              f"(remote/local {med['local'] / med['remote']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
