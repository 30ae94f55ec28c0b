"""``bl.balance`` against verl's rollout balancing, on long-tailed rollout lengths.

verl's logic, re-implemented from its documented behaviour (``verl/utils/seqlen_balancing.py`` and
``RayPPOTrainer._balance_batch``; none of its code is used; the Karmarkar-Karp part is
:func:`balanced_loader.planning.kernels.karmarkar_karp.verl_kk_reference`, pure Python like verl's):

1. **Ranks** (``_balance_batch``): each rollout's workload ``24576 s + s^2`` (``calculate_workload``)
   is partitioned into ``world_size`` parts by ``get_seqlen_balanced_partitions(..., equal_size=True)``:
   Karmarkar-Karp largest differencing in pure Python (``heapq`` of states of k sets, sets kept
   sorted by (sum, size, items) descending), starting from groups of k consecutive items of the
   ascending sort, so every rank gets the same number of rollouts.
2. **Microbatches** (``rearrange_micro_batches``): on each rank ``min(n_r, ceil(tokens / max_token_len))``
   microbatches, the count all-reduced to the largest over ranks, then Karmarkar-Karp on the
   workloads into that many parts with ``equal_size=False``. Nothing holds the token cap there:
   a part may exceed it (counted below).

Lengths: seeded lognormal(log 2048, 1.2) tokens, rounded, clipped to [1, cap] (cap 16K or 32K:
rollouts of up to 32K tokens, a long tail of responses that hit the limit). Per case and seed:
the slowest rank's work (verl's formula, summed per rank) of both against the mean (total / ranks),
microbatches per rank, cap violations, and planning time of both (CPU time of this process, which
the other jobs of a shared machine do not inflate; ours also as wall time), interleaved (ours,
verl's, ours, ...), medians of ``--repeats`` after a warm-up. ``heaviest/mean`` is one rollout's work over
the mean: above 1 no balancer can reach the mean.

    python tools/bench_rl_balance.py                       # 8 cases x 3 seeds, markdown table
    python tools/bench_rl_balance.py --seeds 5 --repeats 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import balanced_loader as bl
from balanced_loader.planning.kernels.karmarkar_karp import verl_kk_reference
from balanced_loader.planning.rl import rollout_work

# ------------------------------------------------------------------------------------------
# verl's behaviour, in plain Python (what its users run)
# ------------------------------------------------------------------------------------------


def verl_partitions(values: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions`` (its asserts included): Karmarkar-Karp into k parts."""
    if len(values) < k or (equal_size and len(values) % k):
        raise ValueError(f"verl would assert: {len(values)} items into {k} partitions (equal_size={equal_size})")
    out = verl_kk_reference(values, k, equal_size)
    if any(not p for p in out):
        raise ValueError("verl would assert: an empty partition")
    return out


def verl_balance(lengths: list[int], world: int, cap: int) -> list[list[list[int]]]:
    """verl's two steps: rollouts to ranks (equal counts), then each rank's microbatches (count = max over ranks)."""
    work = [24576 * s + s * s for s in lengths]
    ranks = verl_partitions(work, world, equal_size=True)
    counts = [min(len(r), -(-sum(lengths[i] for i in r) // cap)) for r in ranks]
    m = max(counts)  # verl all-reduces the count with MAX
    out = []
    for r in ranks:
        parts = verl_partitions([work[i] for i in r], m, equal_size=False)
        out.append([[r[j] for j in p] for p in parts])
    return out


# ------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------


def rollout_lengths(n: int, cap: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(2048), 1.2, n)), 1, cap).astype(np.int64)  # [n]


def figures(plan: list[list[list[int]]], lengths: np.ndarray, cap: int) -> dict:
    work = rollout_work(lengths)  # verl's formula
    loads = np.array([sum(float(work[i]) for mb in rank for i in mb) for rank in plan])  # [world]
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(len(lengths))), "an index is missing or repeated"
    tokens = [int(lengths[mb].sum()) if mb else 0 for rank in plan for mb in rank]
    return {"max_over_mean": float(loads.max() / loads.mean()), "max_work": float(loads.max()),
            "microbatches": max(len(r) for r in plan), "equal_counts": len({len(r) for r in plan}) == 1,
            "over_cap": sum(t > cap for t in tokens), "largest_microbatch": max(tokens),
            "heaviest_over_mean": float(work.max() / loads.mean())}


def run_case(n: int, world: int, cap: int, seed: int, repeats: int) -> dict:
    lengths = rollout_lengths(n, cap, seed)
    as_list = lengths.tolist()
    ours_t, verl_t, ours_wall = [], [], []
    ours = verl = None
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        t0, w0 = time.process_time(), time.perf_counter()
        ours = bl.balance(lengths, world_size=world, max_tokens_per_microbatch=cap)
        ours_t.append(time.process_time() - t0)
        ours_wall.append(time.perf_counter() - w0)
        t0 = time.process_time()
        verl = verl_balance(as_list, world, cap)
        verl_t.append(time.process_time() - t0)
    return {"rollouts": n, "world_size": world, "cap": cap, "seed": seed,
            "ours": figures(ours, lengths, cap), "verl": figures(verl, lengths, cap),
            "ours_ms": 1e3 * statistics.median(ours_t), "verl_ms": 1e3 * statistics.median(verl_t),
            "ours_wall_ms": 1e3 * statistics.median(ours_wall)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write every row to this JSON file")
    args = p.parse_args(argv)
    bl.balance([1, 2, 3], world_size=2, max_tokens_per_microbatch=4)  # load the numba kernels (cached)
    rows = []
    print("| rollouts | ranks | cap | seed | max/mean ours | max/mean verl | heaviest/mean | microbatches ours / verl "
          "| over cap ours / verl | ours ms (wall) | verl ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in (1024, 4096):
        for world in (8, 64):
            for cap in (16384, 32768):
                for seed in range(args.seeds):
                    r = run_case(n, world, cap, seed, args.repeats)
                    rows.append(r)
                    o, v = r["ours"], r["verl"]
                    print(f"| {n} | {world} | {cap} | {seed} | {o['max_over_mean']:.5f} | {v['max_over_mean']:.5f} | "
                          f"{o['heaviest_over_mean']:.3f} | {o['microbatches']} / {v['microbatches']} | "
                          f"{o['over_cap']} / {v['over_cap']} | {r['ours_ms']:.2f} ({r['ours_wall_ms']:.2f}) | "
                          f"{r['verl_ms']:.1f} | "
                          f"{r['verl_ms'] / r['ours_ms']:.0f}x |", flush=True)
    ok_work = all(r["ours"]["max_work"] <= r["verl"]["max_work"] for r in rows)
    ok_mean = all(r["ours"]["max_over_mean"] <= 1.01 for r in rows)
    ok_mb = all(r["ours"]["microbatches"] <= r["verl"]["microbatches"] and r["ours"]["equal_counts"] for r in rows)
    ok_cap = all(r["ours"]["over_cap"] == 0 for r in rows)
    slowest = max(r["ours_ms"] for r in rows if r["rollouts"] == 4096 and r["world_size"] == 64)
    speed = min(r["verl_ms"] / r["ours_ms"] for r in rows)
    print(f"\nmax work <= verl's: {ok_work}; within 1% of the mean: {ok_mean}; microbatches <= verl's, equal: {ok_mb}; "
          f"cap held: {ok_cap}; 4096 x 64 planning (median CPU time, slowest case): {slowest:.2f} ms; "
          f"smallest speedup: {speed:.0f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if (ok_work and ok_mean and ok_mb and ok_cap and slowest < 20 and speed >= 5) else 1


if __name__ == "__main__":
    raise SystemExit(main())
