"""Regime sweep of the planners (issue 35): every policy on the same batches over a grid of real corpora x cost
models x worlds x contexts; each cell's time against the best other policy and the lower bound; a heat map.

    python tools/sweep_planner.py --grid --out /tmp/sweep.jsonl                 # the acceptance grid
    python tools/sweep_planner.py --report /tmp/sweep.jsonl --heatmap docs/img/planner_sweep.png
    python tools/sweep_planner.py --corpora stdlib --costs flexsp-gpt7b-a100 --worlds 512 --contexts 32768

Corpora (``balanced_loader.build.zoo``): Wikipedia lengths and this machine's stdlib, /usr/include,
man pages, /usr/share/doc (byte-level tokens). Batches: sequences of at most ``max_seq_len`` (docs split),
shuffled, cut at ``lanes x max_tokens_per_lane x --passes`` tokens, the first ``--batches`` of them. Cost
models: presets, ``analytic:<model>@<hardware>`` or a cost file. Results are JSON lines (one cell each);
a run appends to ``--out`` and skips the cells it already holds, so it can be resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from balanced_loader.build import zoo
from balanced_loader.cost import CostModel
from balanced_loader.diagnostics import sweep
from balanced_loader.presets import cost_preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKI = os.path.join(REPO, "data", "wikipedia_lengths.txt.gz")
CPU_COST = os.path.join(REPO, "recipes", "cost-cpu-tiny.yaml")
GRID = {"corpora": "wikipedia,stdlib,headers,man,pkgdocs",
        "costs": f"hydra-gpt7b-a100,flexsp-gpt7b-a100,analytic:llama3-8b@h100,{CPU_COST}",
        "worlds": "2,8,64,512", "contexts": "8192,32768,131072"}


def load_cost(name: str, world: int) -> CostModel:
    if name.endswith((".yaml", ".yml")):
        return CostModel.from_file(name)
    return cost_preset(name, world_size=world)


def short(name: str) -> str:
    return "cpu-tiny" if name.endswith((".yaml", ".yml")) else name.replace("analytic:", "")


def run(args) -> None:
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {sweep.CellResult.from_json(json.loads(line)).cell.key for line in f if line.strip()}
    skip = {}
    for s in filter(None, args.skip.split(",")):
        pol, _, w = s.partition("@")
        skip.setdefault(int(w) if w else 0, []).append(pol)
    policies = args.policies.split(",")
    worlds = [int(x) for x in args.worlds.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    for corpus in args.corpora.split(","):
        lengths = zoo.lengths(corpus, wikipedia=args.wikipedia, cache_dir=args.cache_dir)
        for cname in args.costs.split(","):
            for w in worlds:
                cost = load_cost(cname, w)
                for cell in sweep.cells(corpus, lengths, short(cname), cost, [w], contexts):
                    if cell.key in done:
                        continue
                    t0 = time.perf_counter()
                    skipped = [*skip.get(0, []), *[p for k, v in skip.items() if k and w >= k for p in v]]
                    res = sweep.run_cell(cell, lengths, cost, policies, count=args.batches, passes=args.passes,
                                         seed=args.seed, skip=skipped)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(res.to_json()) + "\n")
                    other = res.best_other()
                    mine = res.ms.get(sweep.DEFAULT_POLICY)
                    vs = f"{mine / other[1]:.4f} vs {other[0]}" if mine and other else "-"
                    vb = f"{mine / res.bound_ms:.4f}" if mine and res.bound_ms else "-"
                    print(f"{cell.key:<44} seq {cell.max_seq_len:>7} n {sum(res.batches):>6} "
                          f"{sweep.DEFAULT_POLICY}/best other {vs:<24} /bound {vb}  ({time.perf_counter() - t0:.1f}s)",
                          flush=True)


def read(path: str, others: str | None = None) -> list[sweep.CellResult]:
    """The results of a file; with ``others``, each cell's policies missing there taken from that file's cell
    (a run of some policies only, beside a full earlier run whose other policies did not change)."""
    with open(path) as f:
        out = [sweep.CellResult.from_json(json.loads(line)) for line in f if line.strip()]
    if others:
        by_key = {r.cell.key: r for r in read(others)}
        for r in out:
            old = by_key.get(r.cell.key)
            if old is not None:
                for k, v in old.ms.items():
                    if k not in r.ms:
                        r.ms[k] = v
                        r.plan_s.setdefault(k, old.plan_s.get(k, 0.0))
    return out


def fill_bounds(path: str, args, *, every: bool = False) -> None:
    """Cells of an older run without the power-of-two bound get it (``every``: every cell's bounds are computed
    again, e.g. after a tighter bound; their batches are cut again, the plans' times kept); the file is
    rewritten."""
    results = read(path)
    todo = [r for r in results if every or not r.bound_pow2_ms]
    if not todo:
        return
    names = {short(c): c for c in GRID["costs"].split(",")}
    lengths = {}
    for r in todo:
        c = r.cell
        if c.corpus not in lengths:
            lengths[c.corpus] = zoo.lengths(c.corpus, wikipedia=args.wikipedia, cache_dir=args.cache_dir)
        name = names.get(c.cost, c.cost if c.cost.endswith((".yaml", ".yml")) else f"analytic:{c.cost}"
                         if "@" in c.cost else c.cost)
        cost = load_cost(name, c.world)
        batches = sweep.cell_batches(c, lengths[c.corpus], cost, count=len(r.batches), passes=args.passes,
                                     seed=args.seed)
        assert [len(b) for b in batches] == r.batches, c.key
        r.bound_ms, r.bound_pow2_ms = sweep.cell_bounds(batches, cost, c.world)
    with open(path + ".tmp", "w") as f:
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")
    os.replace(path + ".tmp", path)


def report(results: list[sweep.CellResult], policy: str) -> None:
    s = sweep.summary(results, policy)
    a = sweep.summary(results, policy, pow2=False)
    print(f"cells {s['cells']}; {policy} behind the best other policy by > 0.5%: {s['behind']}; worst "
          f"{s['worst_vs_best_other']}; within 1.03x the bound of power-of-two groups: {s['within_bound']} "
          f"({s['share_within_bound']:.1%}), worst {s['worst_vs_bound']}; within 1.03x the bound of any groups: "
          f"{a['within_bound']} ({a['share_within_bound']:.1%}), worst {a['worst_vs_bound']}")
    for ratio, key, other in s["losing"][:40]:
        print(f"  behind {ratio:.4f} x {other:<10} {key}")
    # per regime: cost model x world
    print("\n| cost | world | cells | behind > 0.5% | worst vs best other | within 1.03x bound | worst vs bound |")
    print("|---|---|---|---|---|---|---|")
    groups: dict = {}
    for r in results:
        groups.setdefault((r.cell.cost, r.cell.world), []).append(r)
    for (c, w), rs in sorted(groups.items()):
        g = sweep.summary(rs, policy)
        wo = g["worst_vs_best_other"]
        wb = g["worst_vs_bound"]
        print(f"| {c} | {w} | {g['cells']} | {g['behind']} | {wo[0]:.4f} ({wo[2]}) | {g['within_bound']} | "
              f"{wb[0]:.4f} |" if wo and wb else f"| {c} | {w} | {g['cells']} | - | - | - | - |")


def heatmap(results: list[sweep.CellResult], policy: str, path: str) -> None:
    """Two panels: the policy against the best other policy, and against the bound of power-of-two groups; rows
    corpus x context, columns cost x world (an empty cell: no such context for that corpus and world)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    rows = sorted({(r.cell.corpus, r.cell.context) for r in results})
    cols = sorted({(r.cell.cost, r.cell.world) for r in results})
    vs_other = np.full((len(rows), len(cols)), np.nan)
    vs_bound = np.full((len(rows), len(cols)), np.nan)
    for r in results:
        mine = r.ms.get(policy)
        if mine is None:
            continue
        i, j = rows.index((r.cell.corpus, r.cell.context)), cols.index((r.cell.cost, r.cell.world))
        other = r.best_other(policy)
        if other:
            vs_other[i, j] = mine / other[1]
        if r.bound_pow2_ms:
            vs_bound[i, j] = mine / r.bound_pow2_ms
    fig = Figure(figsize=(max(10, 0.55 * len(cols) * 2), 0.32 * len(rows) + 2.5))
    FigureCanvasAgg(fig)
    for k, (data, title, norm) in enumerate((
            (vs_other, f"{policy} / best other policy", TwoSlopeNorm(vmin=0.9, vcenter=1.0, vmax=1.1)),
            (vs_bound, f"{policy} / lower bound (plans of power-of-two groups)",
             TwoSlopeNorm(vmin=1.0, vcenter=1.03, vmax=1.3)))):
        ax = fig.add_subplot(1, 2, k + 1)
        im = ax.imshow(np.clip(data, norm.vmin, norm.vmax), cmap="RdYlGn_r", norm=norm, aspect="auto")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isfinite(data[i, j]):
                    ax.text(j, i, f"{data[i, j]:.3f}", ha="center", va="center", fontsize=4.5)
        ax.set_xticks(range(len(cols)), [f"{c} {w}" for c, w in cols], rotation=90, fontsize=6)
        ax.set_yticks(range(len(rows)), [f"{c} {x // 1024}K" for c, x in rows], fontsize=6)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="store_true", help="the acceptance grid (defaults of the four lists below)")
    ap.add_argument("--corpora", default="wikipedia,stdlib")
    ap.add_argument("--costs", default="hydra-gpt7b-a100")
    ap.add_argument("--worlds", default="8,64")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--policies", default=",".join(sweep.POLICIES))
    ap.add_argument("--skip", default="", help="policy@min_world to skip (e.g. flexsp@512), comma-separated")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--passes", type=int, default=4, help="batch tokens = lanes x max_tokens_per_lane x passes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wikipedia", default=WIKI)
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "balanced_loader"))
    ap.add_argument("--out", default="sweep.jsonl", help="JSON lines, appended (cells already there are skipped)")
    ap.add_argument("--report", metavar="JSONL", help="only summarize a results file")
    ap.add_argument("--others", metavar="JSONL", help="report: take policies a cell lacks from this earlier run")
    ap.add_argument("--rebound", action="store_true",
                    help="with --report: compute every cell's bounds again (the plans' times are kept)")
    ap.add_argument("--heatmap", metavar="PNG")
    ap.add_argument("--policy", default=sweep.DEFAULT_POLICY, help="the policy the report is about")
    args = ap.parse_args()
    if args.grid:
        for k, v in GRID.items():
            setattr(args, k, v)
    try:
        if not args.report:
            run(args)
        fill_bounds(args.report or args.out, args, every=args.rebound and bool(args.report))
        results = read(args.report or args.out, args.others)
    except ValueError as e:
        print(f"sweep_planner: {e}", file=sys.stderr)
        sys.exit(2)
    report(results, args.policy)
    if args.heatmap:
        heatmap(results, args.policy, args.heatmap)


if __name__ == "__main__":
    main()
