"""``balanced-loader trace PLAN.json --out PLAN.trace.json``: a plan's modeled run as a Chrome/Perfetto trace.

One track per rank (grouped by pool and stage), a slice per group per microbatch on each of its ranks
(args: docs, degree, lanes, ranks, microbatch), barrier waits and instants, pipeline stages with their
fill and drain, steps end to end with a step slice on a summary track. ``--png`` draws it as a Gantt
chart; given a trace file (a measured run's ``trace.json``) instead of a plan, ``--png`` draws that.
The layout is in ``balanced_loader/diagnostics/trace.py`` and ``docs/tool.md``.
"""

from __future__ import annotations

import argparse

DEFAULT_STEPS = 10  # steps traced when --steps is not given


def add_arguments(p: argparse.ArgumentParser) -> None:
    from balanced_loader.cli.cmd_simulate import add_cost_arguments

    p.add_argument("plan", metavar="PLAN.json",
                   help="plan file written by 'balanced-loader plan --out' (or a trace file, with --png only)")
    add_cost_arguments(p)
    p.add_argument("--out", metavar="PLAN.trace.json", help="trace-event JSON to write (open in ui.perfetto.dev)")
    p.add_argument("--png", metavar="OUT.png", help="also draw the trace as a Gantt chart (PNG)")
    p.add_argument("--steps", metavar="SPEC",
                   help=f"steps to trace by step number: '0-4', '3', '0,2,5-7' (default: the first {DEFAULT_STEPS})")
    p.add_argument("--no-flows", action="store_true", help="leave out the arrows between pipeline stages")


def parse_steps(spec: str) -> set[int]:
    """Step numbers from ``'0-4,7'``."""
    out: set[int] = set()
    for part in spec.split(","):
        a, sep, b = part.strip().partition("-")
        if not a.isdigit() or (sep and not b.isdigit()) or len(part) > 40:
            raise ValueError(f"--steps {spec!r}: expected step numbers and ranges like '0-4,7'")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo:
            raise ValueError(f"--steps {spec!r}: range {part.strip()} is empty")
        if hi - lo > 1 << 20:
            raise ValueError(f"--steps {spec!r}: range {part.strip()} is too long")
        out.update(range(lo, hi + 1))
    return out


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from balanced_loader.cli.cmd_simulate import validate_plan
    from balanced_loader.diagnostics.trace import plan_trace, read_trace, save_trace
    from balanced_loader.outputs.files import OutputSet
    from balanced_loader.plan import Plan, plan_lengths, read_plan_json
    from balanced_loader.presets import load_cost

    data = read_plan_json(args.plan)
    if isinstance(data, dict) and "traceEvents" in data:  # a trace already: draw it
        if args.out or not args.png:
            raise ValueError(f"{args.plan} is a trace file already: give --png OUT.png to draw it (and no --out)")
        trace = read_trace(args.plan)
        _draw(trace, args.png, os.path.basename(args.plan))
        print(f"wrote {args.png}")
        return 0
    if not (args.out or args.png):
        raise ValueError("nothing to write: give --out PLAN.trace.json and/or --png OUT.png")
    plan = Plan.from_json(data)
    cost = load_cost(args.cost_file, args.cost, world_size=plan.world_size)
    validate_plan(plan, plan_lengths(plan), cost, args.plan)
    if args.steps:
        wanted = parse_steps(args.steps)
        steps = [sp for sp in plan.steps if sp.step in wanted]
        if not steps:
            raise ValueError(f"--steps {args.steps}: the plan has none of these steps "
                             f"(it has {len(plan.steps)}: {_ranges([sp.step for sp in plan.steps])})")
    else:
        steps = list(plan.steps[:DEFAULT_STEPS])
        if len(plan.steps) > DEFAULT_STEPS:
            print(f"note: traced the first {DEFAULT_STEPS} of {len(plan.steps)} steps; "
                  f"--steps {_ranges([sp.step for sp in plan.steps])} traces all", file=sys.stderr)
    meta = {"policy": plan.policy, "plan": args.plan, "cost": cost.name or args.cost_file,
            "steps": [sp.step for sp in steps]}
    trace = plan_trace(steps, cost, flows=not args.no_flows, meta=meta)
    with OutputSet() as outs:  # the trace and its chart: both or neither (a full disk on the PNG keeps no JSON)
        if args.out:
            save_trace(outs.path(args.out), trace)
        if args.png:
            _draw(trace, outs.path(args.png), f"{os.path.basename(args.plan)}: {plan.policy}, {plan.world_size} "
                                              f"ranks, cost {cost.name or args.cost_file} (modeled)")
    n = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    total = sum(e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step") / 1e3
    print(f"plan {args.plan}: policy {plan.policy}, {plan.world_size} ranks, {len(steps)} step(s), "
          f"{total:,.1f} ms modeled; {n:,} slices" + (f"; wrote {args.out}" if args.out else ""))
    if args.png:
        print(f"wrote {args.png}")
    return 0


def _draw(trace: dict, path: str, title: str) -> None:
    from balanced_loader.cli.charts import trace_gantt

    trace_gantt(trace, path, title=title)


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    out: list[str] = []
    for x in sorted(set(xs)):
        if out and out[-1].split("-")[-1] == str(x - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ",".join(out)
