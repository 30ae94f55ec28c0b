"""``balanced-loader analyze SOURCE_OR_LENGTHS``: length statistics, a histogram PNG and advice.

SOURCE_OR_LENGTHS is a length file (.txt, .txt.gz, .npy), a shard folder, a Megatron dataset PREFIX, a
folder of datatrove .ds files or a .jsonl file; several
shard folders are analyzed as one source (the parts of a ``build-shards --part`` build).
Writes ``OUT/histogram.png``, ``OUT/steps.png`` and ``OUT/analyze.json``, published as a set (a failure
leaves the old set). The steps section cuts the first ``--steps`` global batches as the loader would
(``--global-batch-tokens``, ``--max-seq-len``, ``--shuffle``): tokens per step and the largest share of
one doc in a step.
``--mix NAME=PATH:WEIGHT ...`` analyzes a mixture instead, source by source (:mod:`balanced_loader.cli.mix_report`).
"""

from __future__ import annotations

import argparse
from typing import Any

from balanced_loader.cli import mix_report
from balanced_loader.cli.options import DEGREE, INDEX, RANKS, TOKENS

DEFAULT_COST = "hydra-gpt7b-a100"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE_OR_LENGTHS", nargs="*",
                   help="length file (.txt, .txt.gz, .npy), shard folder (local or a URL: http(s)://, s3://, ...) "
                        "or .jsonl file; or several shard folders (the parts of a build-shards --part build)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="remote shard folder: keep its fetched index files here, so the next run reads them locally")
    g = p.add_argument_group("cost model (one of; default: --cost " + DEFAULT_COST + ")")
    g.add_argument("--cost-file", metavar="COST.yaml", help="contract-2 cost file (its lane cap drives the advice)")
    g.add_argument("--cost", metavar="PRESET", help="cost preset name (see 'balanced-loader presets')")
    p.add_argument("--world-size", type=RANKS, metavar="R", help="ranks you plan to train on (checks CP fits)")
    p.add_argument("--tp", type=DEGREE, help="tensor-parallel size whose lane cap to use (default 1)")
    p.add_argument("--pp", type=DEGREE, help="pipeline-parallel size whose lane cap to use (default 1)")
    p.add_argument("--max-seq-len", "--max-len", dest="max_len", type=TOKENS, metavar="N",
                   help="context limit: analyze docs as training sees them, split into N-token segments")
    p.add_argument("--top", type=INDEX, default=10, help="how many of the longest docs to list (default 10)")
    p.add_argument("--out", default="analysis", metavar="DIR",
                   help="folder for histogram.png and analyze.json (default ./analysis)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the text report")
    mix_report.add_arguments(p)


def is_source(path: str) -> bool:
    """Whether ``path`` names a source (a shard folder, local or a URL, a Megatron prefix, datatrove files or a
    .jsonl file), not a length file."""
    import os

    from balanced_loader.data.megatron import resolve_prefix
    from balanced_loader.data.stores import is_url

    return (is_url(path) or os.path.isdir(path) or path.endswith((".jsonl", ".ds"))
            or resolve_prefix(path) is not None)


def read_source_lengths(path: str | list[str], cache_dir: str | None = None) -> tuple[Any, str]:
    """``[num_docs]`` lengths of a length file, a shard folder (local or remote), a .jsonl file or several
    shard folders, and a description."""
    if isinstance(path, list):
        path = path[0] if len(path) == 1 else path
    if isinstance(path, list) or is_source(path):
        from balanced_loader.data.open import open_source

        src = open_source(path, cache_dir=cache_dir)
        try:
            import numpy as np

            return np.asarray(src.lengths, dtype=np.int64), src.describe()
        finally:
            src.close()
    from balanced_loader.data.lengths import read_lengths

    return read_lengths(path), f"length file {path}"


def run(args: argparse.Namespace) -> int:
    import json
    import os

    import numpy as np

    from balanced_loader.cli import analysis as analyze
    from balanced_loader.cli import charts
    from balanced_loader.outputs.files import OutputSet, write_json
    from balanced_loader.presets import load_cost

    if bool(args.source) == bool(args.mix):
        raise ValueError("give SOURCE_OR_LENGTHS, or a mixture with --mix NAME=PATH:WEIGHT ..., not both")
    if args.mix:
        return mix_report.run(args)
    lengths, what = read_source_lengths(args.source, args.cache_dir)
    paths = list(args.source)
    args.first_source, args.source = args.source[0], " ".join(args.source)  # one label from here on
    preset = args.cost if (args.cost or args.cost_file) else DEFAULT_COST
    cost = load_cost(args.cost_file, preset, world_size=args.world_size or 64)
    cost_name = cost.name or args.cost_file
    if args.max_len is not None:
        from balanced_loader.batches.items import to_items

        items, _ = to_items(lengths, np.arange(len(lengths), dtype=np.int64), args.max_len, "split")
        analyzed = items.lengths
        what += f", docs split at {args.max_len:,} tokens"
    else:
        analyzed = lengths
    stats = analyze.length_stats(analyzed, top=args.top)
    if args.max_len is not None:
        stats["longest"] = []  # segment indices are not doc_ids
    sc = analyze.advice_shape(cost, args.tp, args.pp)
    degrees = analyze.degree_table(analyzed, sc)
    adv = analyze.advise(analyzed, cost, world_size=args.world_size, tp=args.tp, pp=args.pp)
    steps, sb, limit, note = _steps(args, paths, cost)

    os.makedirs(args.out, exist_ok=True)
    png, jpath = os.path.join(args.out, "histogram.png"), os.path.join(args.out, "analyze.json")
    marks = {k: float(v) for k, v in stats.get("percentiles", {}).items() if k in ("p50", "p99", "p99.9")}
    report = {"source": args.source, "description": what, "cost": cost_name, "stats": stats,
              "degrees": degrees, "advice": adv.to_json(), "histogram": png, "steps": steps,
              **({"note": note} if note else {})}
    with OutputSet(args.out) as outs:  # the charts and the JSON replace the folder's old set together
        charts.length_histogram(analyzed, outs.path("histogram.png"), lane_cap=sc.max_tokens_per_lane, marks=marks,
                                title=f"{os.path.basename(args.first_source.rstrip('/'))}: {stats['docs']:,} docs, "
                                      f"{stats['tokens']:,} tokens")
        if sb.cuts:
            order = "shuffled" if args.shuffle else "in file order"
            charts.step_sizes({"tokens": [c.tokens for c in sb.cuts]}, sb.budgets, sb.limits, outs.path("steps.png"),
                              title=f"Tokens per step ({order}, max_seq_len {limit:,})")
        write_json(outs.path("analyze.json"), report, indent=1)
    if args.json:
        print(json.dumps(report))
        return 0
    print(format_report(report, sc_label=f"tp={sc.tp} pp={sc.pp}", default_cost=not (args.cost or args.cost_file)))
    print(analyze.format_steps(steps))
    if note:
        print(f"note: {note}")
    print(f"wrote {png}, {os.path.join(args.out, 'steps.png')} and {jpath}")
    print("next, compare policies on your cluster size (adjust --world-size and --global-batch-tokens):")
    print("  " + next_command(args, adv, cost_arg=(f"--cost-file {args.cost_file}" if args.cost_file
                                                 else f"--cost {preset}")))
    return 0


def _steps(args: argparse.Namespace, paths: list[str], cost: Any) -> tuple[dict[str, Any], Any, int, str | None]:
    """The first ``--steps`` global batches of the input as the loader cuts them: their report, the
    :class:`~balanced_loader.cli.streams.StreamBatches`, the context limit used and a note (a budget below
    ``--max-seq-len`` is what the loader refuses)."""
    from balanced_loader.cli.analysis import step_report
    from balanced_loader.cli.streams import stream_batches
    from balanced_loader.loader import default_max_seq_len
    from balanced_loader.planning.config import PlanConfig

    budget = args.global_batch_tokens
    smallest = min(v for _, v in budget) if isinstance(budget, list) else budget
    limit = args.max_len if args.max_len is not None else min(
        default_max_seq_len(cost, PlanConfig(policy="hydra", world_size=args.world_size or 64)), smallest)
    note = None
    if limit > smallest:
        note = (f"global_batch_tokens {smallest:,} is smaller than max_seq_len {limit:,}: the loader refuses this "
                f"(a step must hold one sequence); the steps here are cut with max_seq_len {smallest:,}")
        limit = smallest
    files = [p for p in paths if not is_source(p)]
    ns = argparse.Namespace(mix=None, lengths=files[0] if files else None, source=None if files else paths,
                            cache_dir=args.cache_dir, global_batch_tokens=budget, seed=args.seed,
                            shuffle=args.shuffle, shuffle_window=args.shuffle_window, long_docs=args.long_docs)
    sb = stream_batches(ns, max_seq_len=limit, steps=args.steps)
    return (step_report(sb.batches, budgets=sb.budgets, limits=sb.limits, finite=len(sb.cuts) < args.steps),
            sb, limit, note)


def next_command(args: argparse.Namespace, adv, *, cost_arg: str) -> str:
    """A ``balanced-loader compare`` command line that checks the advice."""

    world = args.world_size or 64
    lanes = world // ((args.tp or 1) * (args.pp or 1)) or 1
    first = getattr(args, "first_source", args.source)
    src = "--source" if is_source(first) else "--lengths"
    cmd = (f"balanced-loader compare {src} {args.source} --policies {','.join(adv.compare)} --world-size {world} "
           f"{cost_arg} --global-batch-tokens {lanes * adv.lane_cap * 4} --steps 5")
    if args.max_len is not None or adv.max_seq_len is not None:
        cmd += f" --max-seq-len {args.max_len if args.max_len is not None else adv.max_seq_len}"
    return cmd + " --out compare"


def format_report(report: dict, *, sc_label: str, default_cost: bool) -> str:
    s = report["stats"]
    out = [f"{report['description']}"]
    if s["docs"] == 0:
        out.append(f"no docs ({s['empty_docs']} empty)")
        return "\n".join(out)
    out.append(f"docs {s['docs']:,}   tokens {s['tokens']:,}   mean {s['mean']:,.1f}   min {s['min']:,}   "
               f"max {s['max']:,}" + (f"   (+{s['empty_docs']:,} empty docs)" if s["empty_docs"] else ""))
    out.append("percentiles (tokens): " + "   ".join(f"{k} {v:,}" for k, v in s["percentiles"].items()))
    out.append("")
    out.append(f"{'longer than':>12} {'docs':>10} {'% of docs':>10} {'% of tokens':>12}")
    for r in s["above"]:
        out.append(f"{r['threshold']:>12,} {r['docs']:>10,} {r['docs_share']:>10.3%} {r['tokens_share']:>12.2%}")
    if s["longest"]:
        out.append("longest docs: " + ", ".join(f"{d['length']:,} (doc {d['doc_id']})" for d in s["longest"]))
    out.append("")
    cost_note = " (default; pass --cost PRESET or --cost-file)" if default_cost else ""
    adv = report["advice"]
    out.append(f"memory-fit CP degrees at lane cap {adv['lane_cap']:,} tokens ({sc_label}), cost "
               f"{report['cost']}{cost_note}:")
    out.append(f"{'degree':>8} {'docs':>10} {'% of docs':>10} {'% of tokens':>12} {'% of compute':>13} "
               f"{'longest':>10}")
    for r in report["degrees"]:
        out.append(f"{r['degree']:>8} {r['docs']:>10,} {r['docs_share']:>10.3%} {r['tokens_share']:>12.2%} "
                   f"{r['compute_share']:>13.2%} {r['longest']:>10,}")
    out.append("")
    out.append("advice:")
    out.extend(f"  - {line}" for line in adv["lines"])
    return "\n".join(out)
