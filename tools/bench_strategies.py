"""Benchmark of the FlexSP and Hydraulis policies against every registered policy (contract-2 model).

Two settings (docs/results/strategies.md):

* ``flexsp``: 64 lanes, preset ``flexsp-gpt7b-a100``, global batches of 512 Wikipedia docs
  (docs that no 64-lane group holds, over 64 x 5,950 tokens, are left out of the pool first),
  shuffled with seed 0.
* ``hydraulis``: 32 GPUs, preset ``hydraulis-llama7b-a800``, docs truncated at 32K, 200K-token
  global batches in the loader's epoch order (seed 0). Candidates come from the whole dataset's
  histogram scaled to one batch, as ``balanced-loader candidates --max-len 32768
  --global-batch-tokens 200000`` writes them. Policies that take one shape are run on every
  usable shape of the preset and the best shape (by mean step time) is reported.

Planning time is measured pinned to one CPU core (``os.sched_setaffinity``), numba threads 1,
after one warm-up plan per policy; the median over ``--repeats`` is reported per step.

    .venv/bin/python tools/bench_strategies.py [--setting both] [--batches 5] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from balanced_loader.batches.items import batch_bounds, to_items
from balanced_loader.batches.order import epoch_order
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.registry import POLICIES
from balanced_loader.presets import cost_preset

REPO = Path(__file__).resolve().parents[1]
WIKI = REPO / "data" / "wikipedia_lengths.txt.gz"


def load_wiki(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        return np.loadtxt(f, dtype=np.int64)


def run_policy(items_list, lengths_of, cost, policy: str, repeats: int, **cfg) -> dict:
    """Plan every batch; returns per-step predicted ms, median plan seconds and notes."""
    config = PlanConfig(policy=policy, world_size=cfg.pop("world_size"), **cfg)
    make_plan(items_list[0], cost, config)  # warm-up (numba compile, imports)
    ms, secs, notes = [], [], []
    for items in items_list:
        times = []
        for _ in range(repeats):
            plan = make_plan(items, cost, config)
            times.append(plan.plan_seconds)
        plan.validate(lengths_of, cost, doc_ids=items.doc_ids)
        ms.append(plan.predicted_ms)
        secs.append(statistics.median(times))
        notes.extend(plan.notes)
    return {"ms": ms, "mean_ms": float(np.mean(ms)), "plan_s": secs, "max_plan_s": max(secs),
            "notes": sorted(set(notes))}


def attempt(fn, *a, **k) -> dict:
    try:
        return fn(*a, **k)
    except ValueError as e:
        return {"error": str(e)}


def flexsp_setting(wiki: np.ndarray, batches: int, repeats: int) -> dict:
    cost = cost_preset("flexsp-gpt7b-a100")
    cap = 64 * cost.max_tokens_per_lane
    pool = wiki[wiki <= cap]
    order = np.random.default_rng(0).permutation(len(pool))
    items_list = [BatchItems.from_lengths(pool[order[b * 512:(b + 1) * 512]],
                                          doc_ids=order[b * 512:(b + 1) * 512]) for b in range(batches)]
    runs: dict[str, dict] = {}
    for name in POLICIES:
        kw: dict = {"world_size": 64}
        if name == "static-sp":
            kw["cp"] = 64
            label = "static-sp (cp 64)"
        else:
            label = name
        runs[label] = attempt(run_policy, items_list, pool, cost, name, repeats, **kw)
    runs["static-sp (auto degree)"] = attempt(run_policy, items_list, pool, cost, "static-sp", repeats, world_size=64)
    runs["flexsp (min_degree 2)"] = attempt(run_policy, items_list, pool, cost, "flexsp", repeats, world_size=64,
                                            extra={"min_degree": 2})
    runs["batch-ada (fill 1.0)"] = attempt(run_policy, items_list, pool, cost, "batch-ada", repeats, world_size=64,
                                           extra={"fill": 1.0})
    runs["flexsp (greedy only)"] = attempt(run_policy, items_list, pool, cost, "flexsp", repeats, world_size=64,
                                           extra={"max_solves": 0})
    flex = runs["flexsp"]["mean_ms"]
    return {"setting": "flexsp", "dropped_docs": int((wiki > cap).sum()), "tokens": [int(i.tokens) for i in items_list],
            "runs": runs,
            "targets": {"flexsp_vs_static_sp64": runs["static-sp (cp 64)"]["mean_ms"] / flex,
                        "flexsp_vs_batch_ada": runs["batch-ada"]["mean_ms"] / flex,
                        "flexsp_max_plan_s": runs["flexsp"]["max_plan_s"]}}


def hydraulis_setting(wiki: np.ndarray, batches: int, repeats: int, cand_path: Path) -> dict:
    from balanced_loader.cli.cmd_candidates import histogram
    from balanced_loader.planning.solvers import candidates as cands

    cost = cost_preset("hydraulis-llama7b-a800")
    order = epoch_order(len(wiki), seed=0, epoch=0)
    items, _ = to_items(wiki[order], order, max_len=32768, long_docs="truncate")
    bounds = batch_bounds(items.lengths, 200_000)
    items_list = []
    for b in range(batches):
        sl = slice(bounds[b], bounds[b + 1])
        items_list.append(BatchItems(doc_ids=items.doc_ids[sl], starts=items.starts[sl], lengths=items.lengths[sl]))
    lengths_of = np.minimum(wiki, 32768)
    values, weights = histogram(wiki, 32768, 200_000)

    def write(found, path: Path, fixed_cost: str) -> None:
        path.write_text(cands.dumps(found, world_size=32, max_len=32768, delta_s=128, delta_n=1,
                                    fixed_cost=fixed_cost, cost_name=cost.name))

    found = cands.generate(values, weights, cost, 32, delta_s=128, delta_n=1, fixed_cost="packed")
    write(found, cand_path, "packed")
    paper_path = cand_path.with_name(cand_path.stem + "_doc.yaml")
    write(cands.generate(values, weights, cost, 32, delta_s=128, delta_n=1, fixed_cost="doc"), paper_path, "doc")
    homo_path = cand_path.with_name(cand_path.stem + "_homogeneous.yaml")
    write([c for c in found if len(c.pipelines) == 1], homo_path, "packed")
    shapes = [(s.tp, s.pp) for s in cost.shapes() if s.gpus <= 32]
    runs: dict[str, dict] = {}

    def hyd(label: str, path: Path | None, **extra) -> None:
        kw = {"candidates": str(path)} if path else {}
        runs[label] = attempt(run_policy, items_list, lengths_of, cost, "hydraulis", repeats, world_size=32,
                              extra=extra, **kw)

    hyd("hydraulis", cand_path)
    hyd("hydraulis (per-batch candidates)", None)
    hyd("hydraulis (per-batch candidates, fixed_cost doc)", None, fixed_cost="doc")
    hyd("hydraulis (paper's costs: fixed_cost doc, stage1_fixed none)", paper_path)
    hyd("hydraulis (stage1_fixed packed)", cand_path, stage1_fixed="packed")
    hyd("hydraulis (ILP wherever it can help: ilp_min_gain 0)", cand_path, ilp_min_gain=0.0)
    hyd("hydraulis (homogeneous candidates only)", homo_path)
    per_shape: dict[str, dict[str, dict]] = {}
    for name in POLICIES:
        if name == "hydraulis":
            continue
        per_shape[name] = {}
        for tp, pp in shapes:
            per_shape[name][f"tp{tp}pp{pp}"] = attempt(run_policy, items_list, lengths_of, cost, name, repeats,
                                                       world_size=32, tp=tp, pp=pp)
        ok = {k: v for k, v in per_shape[name].items() if "mean_ms" in v}
        if ok:
            shape = min(ok, key=lambda k: ok[k]["mean_ms"])
            runs[f"{name} (best shape {shape})"] = dict(ok[shape], shape=shape)
        else:
            runs[name] = {"error": "; ".join(sorted({v['error'] for v in per_shape[name].values()}))[:200]}
    maxlen = {k: v for k, v in per_shape.get("maxlen", {}).items() if "mean_ms" in v}
    targets = {}
    if maxlen:
        best_shape = min(maxlen, key=lambda k: maxlen[k]["mean_ms"])
        per_batch_best = np.min([maxlen[k]["ms"] for k in maxlen], axis=0)
        targets = {"hydraulis_vs_best_maxlen_shape": maxlen[best_shape]["mean_ms"] / runs["hydraulis"]["mean_ms"],
                   "best_maxlen_shape": best_shape,
                   "hydraulis_vs_per_batch_best_maxlen": float(per_batch_best.mean()) / runs["hydraulis"]["mean_ms"]}
    return {"setting": "hydraulis", "tokens": [int(i.tokens) for i in items_list],
            "candidates": [c.label() for c in found], "runs": runs, "per_shape": per_shape, "targets": targets}


def milp_study(wiki: np.ndarray, batches: int) -> list[dict]:
    """FlexSP's per-slot MILP against the aggregated class MILP on the first microbatch (M = 2) of each batch."""
    from balanced_loader.cost import allowed_degrees
    from balanced_loader.planning.solvers.blaster import chunk_cuts
    from balanced_loader.planning.solvers.sp_groups import greedy_homogeneous, makespan_lower_bound
    from balanced_loader.planning.solvers.sp_milp import Buckets, slot_milp, solve_microbatch

    cost = cost_preset("flexsp-gpt7b-a100")
    sc = cost.base
    pool = wiki[wiki <= 64 * sc.max_tokens_per_lane]
    order = np.random.default_rng(0).permutation(len(pool))
    degrees = allowed_degrees(64)
    rows = []
    for b in range(batches):
        ln = np.sort(pool[order[b * 512:(b + 1) * 512]])[::-1]
        cuts = chunk_cuts(ln, 2)
        mb = ln[cuts[0]:cuts[1]]
        greedy = greedy_homogeneous(mb, sc, 64, degrees)
        lower = makespan_lower_bound(mb, sc, 64, degrees)
        row = {"batch": b, "docs": len(mb), "greedy_ms": greedy.makespan, "lower_bound_ms": lower}
        bk = Buckets.build(mb, sc, 64, degrees)
        for limit in (1.0, 5.0):
            t = time.perf_counter()
            out = slot_milp(bk, sc, 64, time_limit_s=limit, node_limit=None, rel_gap=1e-3)
            row[f"slot_milp_{limit:g}s_ms"] = out.choice.makespan if out.choice else None
            row[f"slot_milp_{limit:g}s_wall"] = time.perf_counter() - t
        t = time.perf_counter()
        got = solve_microbatch(mb, sc, 64, degrees, greedy, lower, time_limit_s=1.0, node_limit=50)
        row["class_milp_ms"] = got.choice.makespan
        row["class_milp_wall"] = time.perf_counter() - t
        row["class_milp_solves"] = got.solves
        rows.append(row)
    return rows


def table(result: dict, ref: str) -> str:
    runs = result["runs"]
    base = runs[ref]["mean_ms"]
    lines = [f"| policy | mean step ms | {ref} speedup | per-step ms | max plan s (median of repeats) | notes |",
             "|---|---:|---:|---|---:|---|"]
    for name, r in sorted(runs.items(), key=lambda kv: kv[1].get("mean_ms", np.inf)):
        if "error" in r:
            lines.append(f"| {name} | n/a | | {r['error'][:90]} | | |")
            continue
        steps = ", ".join(f"{x:.0f}" for x in r["ms"])
        lines.append(f"| {name} | {r['mean_ms']:.0f} | {r['mean_ms'] / base:.2f}x | {steps} | "
                     f"{r['max_plan_s']:.3f} | {len(r['notes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=("flexsp", "hydraulis", "both", "none"), default="both")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", type=Path, default=WIKI, help="Wikipedia lengths (default data/, bundled)")
    p.add_argument("--candidates-out", type=Path, default=Path("/tmp/bench_strategies_candidates.yaml"))
    p.add_argument("--json", type=Path, help="write all numbers here")
    p.add_argument("--all-cores", action="store_true", help="do not pin to one CPU core")
    p.add_argument("--milp-study", action="store_true",
                   help="also compare FlexSP's per-slot MILP with the aggregated one (slow: ~6 s per batch)")
    args = p.parse_args(argv)
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    if not args.lengths.exists():
        print(f"bench_strategies: {args.lengths} not found", file=sys.stderr)
        return 2
    wiki = load_wiki(args.lengths)
    out = {}
    t0 = time.perf_counter()
    if args.setting in ("flexsp", "both"):
        out["flexsp"] = flexsp_setting(wiki, args.batches, args.repeats)
        print("## FlexSP setting: 64 lanes, flexsp-gpt7b-a100, 512 Wikipedia docs per batch\n")
        print(table(out["flexsp"], "flexsp"))
        print("\ntargets:", json.dumps(out["flexsp"]["targets"], indent=None), "\n")
    if args.setting in ("hydraulis", "both"):
        out["hydraulis"] = hydraulis_setting(wiki, args.batches, args.repeats, args.candidates_out)
        print("## Hydraulis setting: 32 GPUs, hydraulis-llama7b-a800, 32K max length, 200K-token batches\n")
        print("candidates:", "; ".join(out["hydraulis"]["candidates"]), "\n")
        print(table(out["hydraulis"], "hydraulis"))
        print("\nmaxlen per shape:", {k: round(v.get("mean_ms", float("nan"))) for k, v in
                                      out["hydraulis"]["per_shape"].get("maxlen", {}).items()})
        print("targets:", json.dumps(out["hydraulis"]["targets"], indent=None))
    if args.milp_study:
        out["milp_study"] = milp_study(wiki, args.batches)
        print("\n## First microbatch (M = 2) of each FlexSP batch: slowest group, ms\n")
        print("| batch | docs | lower bound | greedy | per-slot MILP 1 s | per-slot MILP 5 s | class MILP (wall s) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in out["milp_study"]:
            def fmt(x):
                return "none" if x is None else f"{x:.0f}"

            print(f"| {r['batch']} | {r['docs']} | {r['lower_bound_ms']:.0f} | {r['greedy_ms']:.0f} | "
                  f"{fmt(r['slot_milp_1s_ms'])} | {fmt(r['slot_milp_5s_ms'])} | "
                  f"{r['class_milp_ms']:.0f} ({r['class_milp_wall']:.2f}) |")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
