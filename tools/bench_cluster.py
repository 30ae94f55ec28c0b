"""Mixed hardware and slow lanes, modeled: policies planning with device classes and lane speeds vs as if alike.

A world of ``--world`` GPUs, the first half of one device class and the second half of another (cost
presets, e.g. ``analytic:gpt-7b@a800`` and ``analytic:gpt-7b@h100``), long-tailed global batches from
the bundled Wikipedia lengths. Every policy plans each batch twice: with the cluster cost model
(``device_classes`` + ``rank_classes``, contract 2) and as if every rank were of one class (each class
tried; the faster of the two that fits the memory of every lane is the baseline). Both plans are timed
on the real cluster (contract 2: a group runs at its slowest lane) and checked against every lane's
memory cap. Then the same with one slow lane (``lane_speed`` 0.5 on one rank) in a uniform world.

    python tools/bench_cluster.py                                    # a800 + h100, gpt-7b, 64 GPUs
    python tools/bench_cluster.py --classes analytic:gpt-7b@a100-40g,analytic:gpt-7b@h100   # 40 GB vs 80 GB
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import time
from pathlib import Path

import numpy as np

from balanced_loader.plan import BatchItems
from balanced_loader.planning import PlanConfig, longest_segment, make_plan
from balanced_loader.presets import cost_preset
from balanced_loader.simulate import simulate_step, step_ms

REPO = Path(__file__).resolve().parents[1]


def batches(lengths: np.ndarray, tokens: int, longest: int, count: int, seed: int) -> list[BatchItems]:
    rng = np.random.default_rng(seed)
    ln = np.minimum(rng.permutation(lengths), longest)
    out, pos = [], 0
    for _ in range(count):
        cs = np.cumsum(ln[pos:])
        n = max(1, int(np.searchsorted(cs, tokens)))
        part = ln[pos:pos + n].astype(np.int64)
        out.append(BatchItems(doc_ids=np.arange(pos, pos + n), starts=np.zeros(n, np.int64), lengths=part))
        pos += n
    return out


def timed_plan(items, cost, cfg):
    t0 = time.perf_counter()
    p = make_plan(items, cost, cfg)
    return p, time.perf_counter() - t0


def valid_on(plan, cluster) -> bool:
    try:
        plan.validate(caps=cluster)
        return True
    except ValueError:
        return False


def compare(name: str, cluster, alike: dict, items_list, policies, world, limit_s) -> None:
    print(f"\n### {name}\n")
    print("| policy | aware step ms | as if alike (best that fits) | speedup | aware fits every lane | plan s |")
    print("|---|---|---|---|---|---|")
    for pol in policies:
        cfg = PlanConfig(policy=pol, world_size=world, time_limit_s=limit_s)
        aware, naive, ok, secs = [], [], True, []
        top = longest_segment(cluster, cfg)  # docs the policy cannot hold are cut (hydraulis: its largest shape)
        for items in items_list:
            items = BatchItems(doc_ids=items.doc_ids, starts=items.starts, lengths=np.minimum(items.lengths, top))
            p, dt = timed_plan(items, cluster, cfg)
            secs.append(dt)
            ok = ok and valid_on(p, cluster)
            aware.append(step_ms(p, cluster))
            best = np.inf
            for model in alike.values():
                try:
                    q = make_plan(items, model, cfg)
                except ValueError:
                    continue
                if valid_on(q, cluster):
                    best = min(best, step_ms(q, cluster))
            naive.append(best)
        a, n = statistics.fmean(aware), statistics.fmean(naive)
        sp = f"**{n / a:.2f}x**" if np.isfinite(n) else "baseline does not fit"
        print(f"| {pol} | {a:,.0f} | {n:,.0f} | {sp} | {'yes' if ok else 'NO'} | {statistics.median(secs):.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="analytic:gpt-7b@a800,analytic:gpt-7b@h100",
                    help="two cost presets: the first half of the ranks, then the second half")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="global batches (default 3)")
    ap.add_argument("--per-lane", type=int, default=4, help="global batch = world x this x the smaller lane cap")
    ap.add_argument("--policies", default="hydra,token-kk,flexsp,mcore-dcp,hydraulis")
    ap.add_argument("--time-limit", type=float, default=1.0, help="solver time limit (flexsp, hydraulis)")
    args = ap.parse_args(argv)
    names = args.classes.split(",")
    if len(names) != 2:
        raise SystemExit("bench_cluster: --classes takes two presets")
    w = args.world
    a, b = (cost_preset(n, world_size=w) for n in names)
    short = [n.split("@")[-1] for n in names]
    cluster = a.with_classes({short[0]: a, short[1]: b}, [(short[0], w // 2), (short[1], w - w // 2)])
    with gzip.open(REPO / "data" / "wikipedia_lengths.txt.gz") as f:
        lengths = np.loadtxt(f, dtype=np.int64)
    cap = min(a.base.max_tokens_per_lane, b.base.max_tokens_per_lane)
    longest = cap * (w // 4)  # every doc fits a group of a quarter of the world on the smaller cap
    items_list = batches(lengths, w * cap * args.per_lane, longest, args.steps, seed=0)
    policies = [p for p in args.policies.split(",") if p]
    print(f"{w} GPUs: ranks 0-{w // 2 - 1} {names[0]} (cap {a.base.max_tokens_per_lane}), ranks {w // 2}-{w - 1} "
          f"{names[1]} (cap {b.base.max_tokens_per_lane}); {args.steps} Wikipedia batches of "
          f"~{w * cap * args.per_lane:,} tokens, docs cut at {longest:,}")
    compare("mixed hardware: two device classes", cluster, {short[0]: a, short[1]: b}, items_list, policies, w,
            args.time_limit)
    slow = b.with_speeds({w // 2 + 1: 0.5})
    compare(f"one slow lane: {names[1]} everywhere, rank {w // 2 + 1} at speed 0.5", slow, {"alike": b}, items_list,
            policies, w, args.time_limit)
    m = simulate_step(make_plan(items_list[0], cluster, PlanConfig(policy="hydra", world_size=w)), cluster)
    print("\nhydra, first batch, per class: " + "; ".join(f"{k}: busy {v['busy_share']:.1%}, skew {v['skew']:.3f}"
                                                       for k, v in m.classes.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
