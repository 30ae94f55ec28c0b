"""The loader's CPU cost per token, for A/B runs of two checkouts under load (``tools/ab_compare.py``).

Wall-clock ratios on a shared machine swing by 2x between rounds; the CPU time of a single-threaded loop
(``prefetch_steps=0``: cut, plan and materialize in this thread) does not depend on what else runs. This
tool imports only what every checkout since the loader's first release has (``BalancedLoader``,
``ShardSource``, ``cost_preset``, ``needed_token_count``), so one copy measures any checkout: run it by
absolute path with ``PYTHONPATH`` set to the checkout under test.

    python tools/ab_compare.py --base /tmp/base --rounds 5 --key cpu_us_per_mtoken_rank \\
        --key cpu_us_per_mtoken_cluster -- $PWD/tools/bench_loader_cpu.py --json {json}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

from balanced_loader.data.shards import ShardSource
from balanced_loader.loader import BalancedLoader
from balanced_loader.materialize import needed_token_count
from balanced_loader.presets import cost_preset


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     ".demo", "stdlib-shards"))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--policy", default="greedy")
    ap.add_argument("--global-batch-tokens", type=int, default=262144)
    ap.add_argument("--lane-cap", type=int, default=32768)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    src = ShardSource(a.shards)
    cost = cost_preset("analytic:tiny@cpu", world_size=a.world).with_base(max_tokens_per_lane=a.lane_cap)

    def loader() -> BalancedLoader:
        return BalancedLoader(src, policy=a.policy, cost=cost, world_size=a.world, rank=0,
                              global_batch_tokens=a.global_batch_tokens, seed=0, epochs=a.epochs, prefetch_steps=0)

    def rank() -> tuple[float, int, int]:  # what one rank does: plan every step, materialize its own share
        t, tokens, steps = time.process_time(), 0, 0
        for b in loader():
            tokens += b.num_valid_tokens
            steps += 1
        return time.process_time() - t, tokens, steps

    def cluster() -> tuple[float, int]:  # every rank's microbatches materialized in this process
        t, n = time.process_time(), 0
        ld = loader()
        for b in ld:
            n += needed_token_count(list(b.microbatches))
            for r in range(1, a.world):
                n += needed_token_count(ld.microbatches(b.plan, r))
        return time.process_time() - t, n

    rank(), cluster()  # warm: numba caches, page cache
    r_s, c_s = [], []
    for _ in range(a.repeats):
        s, tokens, steps = rank()
        r_s.append(s)
        s, ctok = cluster()
        c_s.append(s)
    out = {"cpu_rank_s": r_s, "cpu_cluster_s": c_s, "tokens": tokens, "cluster_tokens": ctok, "steps": steps,
           "cpu_us_per_mtoken_rank": statistics.median(r_s) / tokens * 1e12,
           "cpu_us_per_mtoken_cluster": statistics.median(c_s) / ctok * 1e12}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
