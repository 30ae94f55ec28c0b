"""``balanced-loader analyze --mix NAME=PATH:WEIGHT ...``: a mixture, source by source.

Each source's length distribution (the statistics of ``analyze``), and each source's share of the
first ``--steps`` global batches as the loader cuts them (tokens, or docs with ``--mix-by docs``)
next to its scheduled weight: a table, ``OUT/analyze.json`` and the chart ``OUT/mixture.png``.
"""

from __future__ import annotations

import argparse
from typing import Any

from balanced_loader.cli.options import COUNT, SEED, MixAction, mix_entry, tokens_or_schedule

DEFAULT_BUDGET = 65536


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The mixture options of ``analyze`` (``--max-seq-len`` and ``--cache-dir`` are its own)."""
    g = p.add_argument_group("mixture (instead of SOURCE_OR_LENGTHS)")
    g.add_argument("--mix", nargs="+", type=mix_entry, action=MixAction, metavar="NAME=PATH:WEIGHT",
                   help="analyze a mixture: each source's lengths and its share of every step; WEIGHT is a number "
                        "or a schedule W@STEP,W@STEP; or Megatron's data path W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--mix-by", default="tokens", choices=("tokens", "docs"),
                   help="weights are shares of each step's tokens (default) or docs")
    g.add_argument("--global-batch-tokens", type=tokens_or_schedule, default=DEFAULT_BUDGET, metavar="N",
                   help=f"tokens per global batch, or a schedule N@STEP,... (default {DEFAULT_BUDGET})")
    g.add_argument("--steps", type=COUNT, default=100, metavar="K",
                   help="steps whose sizes and shares to report (default 100)")
    g.add_argument("--seed", type=SEED, default=0, help="shuffle seed (default 0)")
    g.add_argument("--shuffle", action="store_true", help="shuffle each source's docs by --seed")
    g.add_argument("--shuffle-window", type=COUNT, default=1 << 16, metavar="N", help="docs shuffled together")
    g.add_argument("--long-docs", default="split", choices=("split", "truncate", "drop", "error"),
                   help="docs over --max-seq-len: split (default), truncate, drop or error")


def run(args: argparse.Namespace) -> int:
    import json
    import os

    import numpy as np

    from balanced_loader.cli import charts
    from balanced_loader.cli.analysis import format_steps, length_stats, step_report
    from balanced_loader.cli.streams import stream_batches
    from balanced_loader.outputs.files import write_json

    ns = argparse.Namespace(mix=args.mix, mix_by=args.mix_by, cache_dir=args.cache_dir, lengths=None, source=None,
                            global_batch_tokens=args.global_batch_tokens, seed=args.seed, shuffle=args.shuffle,
                            shuffle_window=args.shuffle_window, long_docs=args.long_docs)
    sb = stream_batches(ns, max_seq_len=args.max_len, steps=args.steps)
    src = sb.source
    names = src.names
    steps = []
    for c in sb.cuts:
        part = np.searchsorted(src.offsets, np.unique(c.items.doc_ids), side="right") - 1  # [docs] source of each
        docs = np.bincount(part, minlength=len(names))
        units = docs if src.by == "docs" else np.asarray([c.mixture_tokens[n] for n in names])
        steps.append({"step": c.start.step, "tokens": c.mixture_tokens,
                      "docs": dict(zip(names, (int(d) for d in docs))),
                      "shares": dict(zip(names, (float(u) / max(1, int(units.sum())) for u in units))),
                      "weights": dict(zip(names, src.weights.at(c.start.step)))})
    lengths = {n: np.asarray(s.lengths, dtype=np.int64) for n, s in zip(names, src.sources)}
    unit = src.by
    totals = {n: sum(s[unit][n] for s in steps) for n in names}
    grand = max(1, sum(totals.values()))
    sources = []
    for n, s in zip(names, src.sources):
        st = length_stats(lengths[n], top=0)
        sources.append({"name": n, "description": s.describe(), "stats": st,
                        "weight": steps[0]["weights"][n], "share": totals[n] / grand})
    os.makedirs(args.out, exist_ok=True)
    png = charts.mixture_shares(lengths, {n: [s["shares"][n] for s in steps] for n in names},
                                {n: [s["weights"][n] for s in steps] for n in names},
                                os.path.join(args.out, "mixture.png"), unit=unit,
                                title=f"Mixture of {len(names)} sources by {unit}: {len(steps)} steps")
    sizes = step_report(sb.batches, budgets=sb.budgets, limits=sb.limits, mixture=[c.mixture_tokens for c in sb.cuts],
                        finite=False)
    charts.step_sizes({n: [c.mixture_tokens[n] for c in sb.cuts] for n in names}, sb.budgets, sb.limits,
                      os.path.join(args.out, "steps.png"), title=f"Tokens per step by source ({len(sb.cuts)} steps)")
    report = {"mixture": {"by": unit, "weights": src.weights.to_json(), "sources": sources, "steps": steps},
              "description": src.describe(), "chart": png, "step_sizes": sizes}
    jpath = os.path.join(args.out, "analyze.json")
    write_json(jpath, report, indent=1)
    if args.json:
        print(json.dumps(report))
        return 0
    print(format_mixture(report))
    print(format_steps(sizes))
    print(f"wrote {png} and {jpath}")
    return 0


def format_mixture(report: dict[str, Any]) -> str:
    m = report["mixture"]
    unit = m["by"]
    w = max([len(s["name"]) for s in m["sources"]] + [6])
    out = [report["description"], "",
           f"{'source':<{w}} {'docs':>12} {'tokens':>14} {'mean':>9} {'p50':>8} {'p99':>9} {'max':>10} "
           f"{'weight':>7} {'share':>7} {'worst step':>11}"]
    for s in m["sources"]:
        st, n = s["stats"], s["name"]
        worst = max(abs(x["shares"][n] - x["weights"][n]) for x in m["steps"])
        pct = st.get("percentiles", {})
        out.append(f"{n:<{w}} {st['docs']:>12,} {st['tokens']:>14,} {st['mean']:>9,.1f} {pct.get('p50', 0):>8,} "
                   f"{pct.get('p99', 0):>9,} {st['max']:>10,} {s['weight']:>7.1%} {s['share']:>7.2%} {worst:>11.2%}")
    out.append(f"weight: at step 0; share: of the {len(m['steps'])} steps' {unit}; worst step: the largest "
               f"|share - weight| of one step")
    return "\n".join(out)
