"""``balanced-loader simulate PLAN.json``: modeled step time, bubbles, skew, tokens/s and MFU per step.

Definitions are in ``balanced_loader/simulate.py`` and ``docs/tool.md``.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.json", help="plan file written by 'balanced-loader plan --out'")
    add_cost_arguments(p)
    p.add_argument("--lengths", metavar="FILE",
                   help="length file to validate the plan against (default: lengths implied by the plan)")
    p.add_argument("--no-validate", action="store_true",
                   help="skip validate() (faster for very large plans)")
    p.add_argument("--model", metavar="NAME", help="model shape for MFU (see 'balanced-loader presets')")
    p.add_argument("--hardware", metavar="NAME", help="hardware for MFU (see 'balanced-loader presets')")
    p.add_argument("--pools", action="store_true",
                   help="list every pool of multi-pool steps (default: only when there are at most 10 steps)")
    p.add_argument("--json", action="store_true", help="print {\"steps\": [...], \"summary\": {...}} as JSON")


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost model (one of)")
    g.add_argument("--cost-file", metavar="COST.yaml", help="contract-2 cost file")
    g.add_argument("--cost", metavar="PRESET", help="cost preset name (see 'balanced-loader presets')")


def model_and_hardware(model: str | None, hardware: str | None):
    """``(ModelShape, Hardware)`` from names, both or neither."""
    from balanced_loader.presets import HARDWARE, MODELS

    if (model is None) != (hardware is None):
        raise ValueError("MFU needs both --model NAME and --hardware NAME")
    if model is None:
        return None, None
    if model not in MODELS:
        raise ValueError(f"unknown model '{model}'; known: {', '.join(sorted(MODELS))}")
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware '{hardware}'; known: {', '.join(sorted(HARDWARE))}")
    return MODELS[model], HARDWARE[hardware]


def run(args: argparse.Namespace) -> int:
    import json

    from balanced_loader import simulate as sim
    from balanced_loader.plan import Plan, plan_lengths, read_plan_json
    from balanced_loader.presets import load_cost

    model, hw = model_and_hardware(args.model, args.hardware)
    try:
        data = read_plan_json(args.plan)
    except RecursionError:
        raise ValueError(f"plan file {args.plan} is nested too deeply to be a plan") from None
    checked = Plan.from_json(data)  # types and ranges of every number (one ValueError line), even with --no-validate
    try:
        world = int(data["world_size"])
        policy = str(data.get("policy", "?"))
        raw_steps = list(data["steps"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed plan file {args.plan}: {type(e).__name__}: {e}") from None
    cost = load_cost(args.cost_file, args.cost, world_size=world)

    if args.no_validate:
        metrics = [sim.simulate_step_json(s, world, cost, model=model, hardware=hw) for s in raw_steps]
        predicted = [float(s.get("predicted_ms", 0.0)) for s in raw_steps]
    else:
        plan = checked
        if args.lengths:
            from balanced_loader.data.lengths import read_lengths

            lengths = read_lengths(args.lengths)
        else:
            lengths = plan_lengths(plan)
        validate_plan(plan, lengths, cost, args.plan)
        metrics = sim.simulate_plan(plan, cost, model=model, hardware=hw)
        predicted = [sp.predicted_ms for sp in plan.steps]

    summary = sim.summarize(metrics)
    mismatched = sum(1 for m, p in zip(metrics, predicted)
                     if p > 0 and abs(m.step_ms - p) > 1e-4 * max(abs(p), 1.0))
    if args.json:
        out = {"plan": args.plan, "policy": policy, "world_size": world, "cost": cost.name or args.cost_file,
               "steps": [m.to_json() for m in metrics], "summary": summary}
        print(json.dumps(out))
    else:
        header = (f"plan {args.plan}: policy {policy}, {world} ranks, {len(metrics)} step(s); "
                  f"cost {cost.name or args.cost_file}")
        print(format_table(metrics, summary, header=header, pools=args.pools or len(metrics) <= 10))
    if mismatched:
        import sys

        print(f"note: {mismatched} step(s) have a predicted_ms different from this cost model "
              f"(was the plan made with another cost file?)", file=sys.stderr)
    return 0


def validate_plan(plan, lengths, cost, path: str) -> None:
    """Every step of a plan file against contract 1 and the cost model's caps (one line naming the file),
    each against the sequences its segments show (:func:`step_sequences`)."""
    for sp in plan.steps:
        try:
            sp.validate(step_sequences(sp, lengths), cost)
        except ValueError as e:
            raise ValueError(f"plan {path} fails validation: {e}") from None


def step_sequences(sp, lengths):
    """The sequences of step ``sp`` of a plan file as its segments show them (``BatchItems``): each doc's
    segments in order, a run of adjacent ones one sequence. A plan file does not record where the loader
    cut a doc longer than ``max_seq_len`` into pieces, and the pieces of one doc may be in different steps,
    so a step is checked against these runs: no two segments overlap, and no run passes its doc's end in
    ``lengths`` (indexed by doc_id); a piece left out of every step goes unnoticed."""
    import numpy as np

    from balanced_loader.plan import BatchItems

    segs = sorted((d, a, k) for p in sp.pools for mb in p.microbatches for g in mb for d, a, k in g.segments)
    runs: list[list[int]] = []  # [doc, start, length] each
    for d, a, k in segs:
        if k <= 0 or a < 0:
            continue  # StepPlan.validate names the empty segment
        if runs and runs[-1][0] == d and a < runs[-1][1] + runs[-1][2]:
            raise ValueError(f"step {sp.step}: doc {d} segment at {a} overlaps token {runs[-1][1] + runs[-1][2]}")
        if runs and runs[-1][0] == d and a == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += k
        else:
            runs.append([d, a, k])
    for d, a, k in runs:
        if d < 0 or d >= len(lengths):
            raise ValueError(f"step {sp.step}: doc {d} is not in the length index")
        if a + k > int(lengths[d]):
            raise ValueError(f"step {sp.step}: doc {d} reaches token {a + k}, past its {int(lengths[d])} tokens")
    arr = np.asarray(runs, dtype=np.int64).reshape(-1, 3)  # [sequences, 3]: doc, start, length
    return BatchItems(doc_ids=arr[:, 0], starts=arr[:, 1], lengths=arr[:, 2])


def format_table(metrics, summary: dict, header: str = "", pools: bool = True) -> str:
    from balanced_loader.cli.options import si_units

    has_mfu = any(m.mfu is not None for m in metrics)
    has_barrier = any(p.barriers for m in metrics for p in m.pools)
    cols = f"{'step':>6} {'step_ms':>11} {'pp_bubble':>9} {'dp_bubble':>9} {'idle':>7} {'skew':>6} {'tokens/s':>9}"
    cols += f" {'barrier':>7}" if has_barrier else ""
    cols += f" {'MFU':>6}" if has_mfu else ""
    lines = [header] if header else []
    lines.append(cols)
    for m in metrics:
        row = (f"{m.step:>6} {m.step_ms:>11.1f} {m.pp_bubble:>9.1%} {m.dp_bubble:>9.1%} {m.idle:>7.1%} "
               f"{m.skew:>6.2f} {si_units(m.tokens_per_s):>9}")
        if has_barrier:
            row += f" {m.barrier_idle:>7.1%}"
        if has_mfu:
            row += f" {m.mfu:>6.1%}" if m.mfu is not None else f" {'-':>6}"
        lines.append(row)
        for name, c in m.classes.items():  # a cluster cost model: each device class's ranks
            lines.append(f"{'':>6}   class {name} ({c['ranks']} ranks): busy {c['busy_share']:.1%} of the step, "
                         f"skew {c['skew']:.2f}, slowest speed {c['min_speed']:.2f}")
        if pools and len(m.pools) > 1:
            for i, p in enumerate(m.pools):
                pj = p.to_json()
                lines.append(f"{'':>6}   pool {i} (tp{p.tp} pp{p.pp}, {p.num_ranks} ranks): makespan "
                             f"{p.makespan_ms:,.1f} ms, pp_bubble {p.pp_bubble:.1%}, lane skew {pj['skew']:.2f}")
    if len(metrics) > 1:
        row = (f"{'mean':>6} {summary['mean_step_ms']:>11.1f} {summary['pp_bubble']:>9.1%} "
               f"{summary['dp_bubble']:>9.1%} {summary['idle']:>7.1%} {summary['skew']:>6.2f} "
               f"{si_units(summary['tokens_per_s']):>9}")
        if has_barrier:
            row += f" {summary['barrier_idle']:>7.1%}"
        if has_mfu:
            row += f" {summary['mfu']:>6.1%}" if "mfu" in summary else f" {'-':>6}"
        lines.append(row)
    lines.append("step_ms: modeled step time (contract 2); pp_bubble/dp_bubble/idle: share of rank time idle "
                 "inside pools / between pools / in total; skew: max/mean rank busy time"
                 + ("; barrier: share of rank time waiting at the plan's barriers (part of pp_bubble)"
                    if has_barrier else ""))
    if not pools and any(len(m.pools) > 1 for m in metrics):
        lines.append("per-pool makespan, pp_bubble and skew: --pools (or --json)")
    return "\n".join(lines)
