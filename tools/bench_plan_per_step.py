"""Planning time per step on fixed batches, for A/B runs of two checkouts (``tools/ab_compare.py``).

The batches (each step's sequence lengths) are cut once by this checkout's loader and saved (``--make``); each
checkout then plans the very same batches, so a difference is the planner's, not the batching's. The tool
imports only what every checkout since the loader's first release has (``BatchItems``, ``make_plan``,
``PlanConfig``, ``cost_preset``), so one copy measures any checkout: run it by absolute path.

    python tools/bench_plan_per_step.py --make /tmp/batches.npz
    python tools/ab_compare.py --base /tmp/base --rounds 3 --key ms_per_step.hydra --key ms_per_step.greedy -- \\
        $PWD/tools/bench_plan_per_step.py --batches /tmp/batches.npz --policies hydra,greedy --json {json}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_batches(path: str, shards: str, world: int, tokens: int, lane_cap: int) -> int:
    """Cut one epoch of ``shards`` into steps with this checkout's loader and save each step's lengths."""
    from balanced_loader.data.shards import ShardSource
    from balanced_loader.loader import BalancedLoader
    from balanced_loader.presets import cost_preset

    cost = cost_preset("analytic:tiny@cpu", world_size=world).with_base(max_tokens_per_lane=lane_cap)
    loader = BalancedLoader(ShardSource(shards), policy="greedy", cost=cost, world_size=world, rank=0,
                            global_batch_tokens=tokens, seed=0, epochs=1, prefetch_steps=0)
    steps = [np.array([s[2] for p in b.plan.pools for mb in p.microbatches for g in mb for s in g.segments],
                      dtype=np.int64) for b in loader]  # [steps] of [sequences]
    np.savez(path, *steps)
    return len(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", metavar="NPZ", help="cut the batches with this checkout's loader and save them here")
    ap.add_argument("--batches", metavar="NPZ", help="plan these batches (made by --make)")
    ap.add_argument("--shards", default=os.path.join(REPO, ".demo", "stdlib-shards"))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--global-batch-tokens", type=int, default=262144)
    ap.add_argument("--lane-cap", type=int, default=32768)
    ap.add_argument("--policies", default="hydra,greedy")
    ap.add_argument("--no-portfolio", action="store_true", help="hydra's placement alone (checkouts that have one)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    if a.make:
        print(f"{make_batches(a.make, a.shards, a.world, a.global_batch_tokens, a.lane_cap)} steps -> {a.make}")
        return 0
    if not a.batches or not a.json:
        ap.error("give --make NPZ, or --batches NPZ and --json PATH")
    from balanced_loader.plan import BatchItems
    from balanced_loader.planning import make_plan
    from balanced_loader.planning.config import PlanConfig
    from balanced_loader.presets import cost_preset

    with np.load(a.batches) as z:
        items = [BatchItems.from_lengths(z[k]) for k in z.files]
    cost = cost_preset("analytic:tiny@cpu", world_size=a.world).with_base(max_tokens_per_lane=a.lane_cap)
    out: dict[str, dict[str, float]] = {"ms_per_step": {}}
    for policy in a.policies.split(","):
        kw = {"extra": {"portfolio": False}} if a.no_portfolio and policy == "hydra" else {}
        cfg = PlanConfig(policy=policy, world_size=a.world, **kw)

        def once(cfg: PlanConfig = cfg) -> float:
            t = time.process_time()
            for it in items:
                make_plan(it, cost, cfg)
            return (time.process_time() - t) / len(items) * 1e3

        once()  # warm: numba caches
        out["ms_per_step"][policy] = statistics.median(once() for _ in range(a.repeats))
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
