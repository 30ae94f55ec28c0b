"""``make demo``: the loader on a real long-tailed corpus, balance report of a simulated cluster.

Builds byte-level webdataset shards of the CPython standard library's ``.py`` files into
``.demo/stdlib-shards`` once (reused later), then runs one BalancedLoader per simulated rank
for a few steps and prints, per step and rank: real tokens materialized, microbatches, and
the time the cost model predicts for that rank (its lane's finish time under contract-2
execution); the skew is max/mean of those times. For contrast, the same docs dealt
round-robin to the ranks (one packed sequence per rank, no cost model) give the skew a
cost-blind loader would have.

    python tools/demo.py                        # greedy policy, 8 ranks, cost analytic:tiny@cpu
    python tools/demo.py --policy hydra --steps 6 --world 16
    python tools/demo.py --lane-cap 4096        # long segments spread over CP groups
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from balanced_loader.corpus import stdlib_shards  # noqa: E402
from balanced_loader.loader import BalancedLoader, resolve_cost  # noqa: E402
from balanced_loader.materialize import needed_token_count, rank_place  # noqa: E402


def rank_times(plan, cost, world: int) -> np.ndarray:
    """Predicted busy time of every rank ([world] ms): its lane's finish in its pool (+ pipeline fill)."""
    out = np.zeros(world)
    for pool in plan.pools:
        if not pool.microbatches:
            continue
        finish, gmax = cost.lane_finish_ms(pool)
        extra = (pool.pp - 1) * gmax / pool.pp
        for stage in pool.ranks:
            for idx, r in enumerate(stage):
                out[r] = finish[idx // pool.tp] + extra
    return out


def round_robin_skew(plan, cost, world: int) -> float:
    """Skew if the step's segments (by doc_id) were dealt round-robin, one sequence per rank, tp = pp = d = 1."""
    segments = sorted(s for p in plan.pools for mb in p.microbatches for g in mb for s in g.segments)
    lengths = [s[2] for s in segments]
    sc = cost.shape(1, 1)
    per_rank = [lengths[r::world] for r in range(world)]
    t = np.array([sc.group_ms(x, 1) if x else 0.0 for x in per_rank])
    return float(t.max() / t.mean()) if t.mean() > 0 else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="greedy", help="planning policy (e.g. greedy, hydra once it exists)")
    p.add_argument("--world", type=int, default=8, help="simulated ranks")
    p.add_argument("--steps", type=int, default=4, help="steps to report")
    p.add_argument("--cost", default="analytic:tiny@cpu", help="cost preset or cost file")
    p.add_argument("--global-batch-tokens", type=int, default=524288)
    p.add_argument("--max-seq-len", type=int, default=16384, help="context limit (longer docs are split)")
    p.add_argument("--lane-cap", type=int, default=0,
                   help="override max_tokens_per_lane (e.g. 8192 to see CP groups; 0: the cost model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO, ".demo", "stdlib-shards"), help="shard folder")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")

    t0 = time.perf_counter()
    src = stdlib_shards(args.out, progress=sys.stderr.isatty())
    built = time.perf_counter() - t0
    print(f"corpus: CPython standard library .py files -> {args.out}: {src.num_docs} docs, "
          f"{src.num_tokens / 1e6:.1f}M byte-level tokens, {len(src.shard_names)} shards (ready in {built:.1f} s)")
    cost = resolve_cost(args.cost, args.world)
    if args.lane_cap:
        cost = cost.with_base(max_tokens_per_lane=args.lane_cap)
    print(f"cluster: {args.world} simulated ranks, policy {args.policy}, cost {args.cost}, "
          f"{args.global_batch_tokens} tokens/step, max_seq_len {args.max_seq_len}")
    loaders = [BalancedLoader(src, policy=args.policy, cost=cost, world_size=args.world, rank=r,
                              global_batch_tokens=args.global_batch_tokens, seed=args.seed,
                              max_seq_len=args.max_seq_len, epochs=None) for r in range(args.world)]
    skews = []
    for _ in range(args.steps):
        batches = [next(ld) for ld in loaders]
        plan = batches[0].plan
        assert all(b.plan.fingerprint() == plan.fingerprint() for b in batches), "ranks disagree on the plan"
        t = rank_times(plan, cost, args.world)
        skew = float(t.max() / t.mean()) if t.mean() > 0 else 1.0
        rr = round_robin_skew(plan, cost, args.world)
        skews.append((skew, rr))
        b0 = batches[0]
        print(f"\nstep {b0.step}: {len(plan.doc_ids())} docs, {plan.tokens} tokens, planned in "
              f"{plan.plan_seconds * 1e3:.1f} ms (rank 0 waited {b0.planner_wait_s * 1e3:.1f} ms), "
              f"predicted step {plan.predicted_ms / 1e3:.2f} s, {b0.num_valid_tokens} label tokens")
        print("  rank  stage lane  microbatches  tokens  CP groups  predicted s")
        for r, b in enumerate(batches):
            place = rank_place(plan, r)
            cp = sum(m.degree > 1 for m in b.microbatches)
            print(f"  {r:4d}  {place.stage:5d} {place.lane:4d}  {len(b.microbatches):12d}  "
                  f"{needed_token_count(list(b.microbatches)):6d}  {cp:9d}  {t[r] / 1e3:11.2f}")
        print(f"  skew max/mean {skew:.3f}   (same docs dealt round-robin: {rr:.3f})")
        if b0.microbatches:
            m = b0.microbatches[0]
            print(f"  rank 0 microbatch 0: input_ids {m.input_ids.shape}, cu_seqlens {m.cu_seqlens.tolist()[:6]}"
                  f"{' ...' if len(m.cu_seqlens) > 6 else ''}, lanes {m.lanes}")
    for ld in loaders:
        ld.close()
    mean = np.mean(skews, axis=0)
    print(f"\nmean skew over {args.steps} steps: {args.policy} {mean[0]:.3f}, round-robin {mean[1]:.3f}; "
          f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
