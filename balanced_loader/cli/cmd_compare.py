"""``balanced-loader compare``: plan the same global batches with several policies and compare them.

Prints a table (modeled step time, speedup over the first policy, skew, bubbles, planning
time, time over the step-time lower bound, barrier waits when a plan has barriers), writes
``OUT/compare.json``, ``OUT/rank_load.png`` (per-rank busy time of one step for each policy, barrier
waits hatched on top) and ``OUT/step_times.png`` (step time per policy over steps), published as a set:
a failure on any of them (a full disk) leaves the folder's previous three as they were.
"""

from __future__ import annotations

import argparse

from balanced_loader.cli.cmd_plan import native_stdout_to_stderr
from balanced_loader.cli.cmd_simulate import add_cost_arguments, model_and_hardware
from balanced_loader.cli.options import COUNT, DEGREE, INDEX, RANKS, SECONDS, add_batch_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_batch_arguments(p, max_seq_len_default="the largest segment every compared policy can hold, as the loader")
    p.add_argument("--policies", required=True, metavar="A,B,C",
                   help="comma-separated policy names; the first is the baseline of the speedup column")
    p.add_argument("--world-size", type=RANKS, required=True, metavar="R", help="number of ranks")
    add_cost_arguments(p)
    p.add_argument("--steps", type=COUNT, default=10, metavar="K", help="compare the first K steps (default 10)")
    p.add_argument("--tp", type=DEGREE, help="static tensor-parallel size for maxlen / static-sp")
    p.add_argument("--pp", type=DEGREE, help="static pipeline-parallel size for maxlen / static-sp")
    p.add_argument("--cp", type=DEGREE, help="static context-parallel degree for maxlen / static-sp")
    p.add_argument("--time-limit", type=SECONDS, default=1.0, metavar="S",
                   help="solver time limit per call for flexsp / hydraulis (default 1 s)")
    p.add_argument("--model", metavar="NAME", help="model shape for MFU (see 'balanced-loader presets')")
    p.add_argument("--hardware", metavar="NAME", help="hardware for MFU (see 'balanced-loader presets')")
    p.add_argument("--chart-step", type=INDEX, default=0, metavar="K",
                   help="step whose per-rank load is drawn (default 0)")
    p.add_argument("--out", default="compare", metavar="DIR",
                   help="folder for compare.json and the PNG charts (default ./compare)")


def _read(args: argparse.Namespace):
    from balanced_loader.data.open import read_batch_source

    return read_batch_source(args.lengths, args.source, positive=False, cache_dir=args.cache_dir)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from tqdm import tqdm

    from balanced_loader.batches.stream import global_batches
    from balanced_loader.cli import charts
    from balanced_loader.cli import comparison as cmp
    from balanced_loader.cli.analysis import format_steps, step_report
    from balanced_loader.cli.streams import stream_batches, wants_stream
    from balanced_loader.loader import default_max_seq_len
    from balanced_loader.loader_args import check_cli_budget
    from balanced_loader.outputs.files import OutputSet, write_json
    from balanced_loader.planning.config import PlanConfig
    from balanced_loader.presets import load_cost

    names = cmp.check_policies(args.policies.split(","))
    model, hw = model_and_hardware(args.model, args.hardware)
    cost = load_cost(args.cost_file, args.cost, world_size=args.world_size)
    os.makedirs(args.out, exist_ok=True)  # before the planning work: a bad --out fails at once
    configs = [PlanConfig(policy=n, world_size=args.world_size, tp=args.tp, pp=args.pp, cp=args.cp,
                          seed=args.seed, time_limit_s=args.time_limit) for n in names]
    # every policy plans the same batches: the context limit is the one all of them can hold
    # (the default also fits the smallest budget, as the loader's does)
    budget = args.global_batch_tokens
    max_len = (args.max_seq_len if args.max_seq_len is not None
               else min([default_max_seq_len(cost, c) for c in configs]
                        + ([min(v for _, v in budget) if isinstance(budget, list) else budget] if budget else [])))
    if isinstance(max_len, int) and max_len < 1:
        raise ValueError(f"--max-seq-len must be >= 1, got {max_len}")
    check_cli_budget(budget, max_len)
    mixture: list = []
    if wants_stream(args):  # a mixture or a schedule: cut as the loader cuts it
        sb = stream_batches(args, max_seq_len=max_len, steps=args.steps)
        batches, stats, what = sb.batches, sb.stats, sb.label
        mixture = [c.mixture_tokens for c in sb.cuts]
        budgets, limits = sb.budgets, sb.limits
    else:
        lengths, shard_bounds, what = _read(args)
        batches, stats = global_batches(lengths, max_seq_len=max_len, long_docs=args.long_docs,
                                        global_batch_tokens=args.global_batch_tokens, shuffle=args.shuffle,
                                        seed=args.seed, shard_bounds=shard_bounds, max_steps=args.steps,
                                        window=args.shuffle_window)
        budgets, limits = [args.global_batch_tokens or stats.tokens] * len(batches), [max_len] * len(batches)
    if not batches:
        raise ValueError(f"{what} has no tokens to plan ({stats.empty} empty docs)")
    if not 0 <= args.chart_step < len(batches):
        raise ValueError(f"--chart-step {args.chart_step} is outside the {len(batches)} compared step(s)")
    if args.global_batch_tokens is None:
        print(f"note: no --global-batch-tokens, so the whole input is one global batch of {stats.tokens:,} "
              f"tokens (contract 3); pass --global-batch-tokens N to compare per-step batches", file=sys.stderr)
    sizes = step_report(batches, budgets=budgets, limits=limits, mixture=mixture or None,
                        finite=args.steps is None or len(batches) < args.steps)
    unusual = {k: v for k, v in stats.to_json().items() if k not in ("docs", "tokens") and v}
    print(f"{what}: {len(batches)} step(s) of {sum(len(b) for b in batches):,} sequences, "
          f"{args.world_size} ranks, cost {cost.name or args.cost_file}, max_seq_len {max_len:,}"
          + (f" (epoch: {', '.join(f'{k} {v}' for k, v in unusual.items())})" if unusual else ""))
    bar = tqdm(total=len(batches), desc="planning", unit="step", file=sys.stderr,
               disable=not sys.stderr.isatty())
    try:
        with native_stdout_to_stderr():  # solver diagnostics (HiGHS prints some) stay out of the table
            runs, _ = cmp.compare_policies(batches, cost, configs, model=model, hardware=hw,
                                           progress=bar.update)
    finally:
        bar.close()
    print(format_steps(sizes))
    print(cmp.format_table(runs))

    k = args.chart_step
    report = {
        "format": cmp.COMPARE_FORMAT,
        "settings": {"input": what, "world_size": args.world_size, "cost": cost.name or args.cost_file,
                     "policies": names, "steps": len(batches), "global_batch_tokens": args.global_batch_tokens,
                     "max_seq_len": max_len, "long_docs": args.long_docs, "shuffle": args.shuffle,
                     "shuffle_window": args.shuffle_window,
                     "seed": args.seed, "tp": args.tp, "pp": args.pp, "cp": args.cp,
                     "model": args.model, "hardware": args.hardware, "doc_stats": stats.to_json(),
                     "step_sizes": sizes,
                     **({"mixture_tokens": mixture} if mixture else {})},
        "policies": [r.to_json(per_rank_step=k) for r in runs],
    }
    with OutputSet(args.out) as outs:  # the JSON and both charts replace the folder's old set together
        write_json(outs.path("compare.json"), report)
        charts.rank_load({r.policy: r.metrics[k].rank_busy_ms for r in runs},
                         {r.policy: r.metrics[k].step_ms for r in runs}, outs.path("rank_load.png"),
                         title=f"Per-rank busy time, step {k} ({args.world_size} ranks, "
                               f"{len(batches[k]):,} sequences, {int(batches[k].lengths.sum()):,} tokens)",
                         barrier_ms={r.policy: r.metrics[k].rank_barrier_ms for r in runs})
        charts.step_times({r.policy: [m.step_ms for m in r.metrics] for r in runs}, outs.path("step_times.png"),
                          title=f"Modeled step time per policy ({args.world_size} ranks, "
                                f"cost {cost.name or os.path.basename(args.cost_file or '')})")
    jpath, load_png, steps_png = (outs.final(n) for n in ("compare.json", "rank_load.png", "step_times.png"))
    print(f"wrote {jpath}, {load_png} and {steps_png}")
    return 0
