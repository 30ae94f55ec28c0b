"""``balanced-loader waves``: Spindle wavefront schedule of a multi-task graph.

    balanced-loader waves --graph G.yaml [--gpus N] [--out W.json] [--handover] [--workload TASK=LENGTHS]

Prints the plan (waves per frontier, the continuous lower bound and the gap, the baselines)
and writes the wave-plan JSON with ``--out``.
"""

from __future__ import annotations

import argparse

from balanced_loader.cli.options import RANKS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", required=True, metavar="G.yaml", help="multi-task graph file (MetaOps, YAML)")
    p.add_argument("--gpus", type=RANKS, metavar="N", help="plan for N devices instead of the graph's gpus")
    p.add_argument("--out", metavar="W.json", help="write the wave plan here")
    p.add_argument("--handover", action="store_true",
                   help="placement also keeps predecessors' data in place at frontier boundaries")
    p.add_argument("--workload", action="append", default=[], metavar="TASK=LENGTHS",
                   help="this step's doc lengths of TASK (.txt/.npy); repeatable")


def _ranks(r: tuple[int, ...]) -> str:
    return f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}"


def run(args: argparse.Namespace) -> int:
    from balanced_loader.spindle import load_graph, plan_waves

    graph = load_graph(args.graph)
    if args.workload:
        from balanced_loader.data.lengths import read_lengths

        loads = {}
        for item in args.workload:
            task, sep, path = item.partition("=")
            if not sep or not task or not path:
                raise ValueError(f"--workload {item!r}: expected TASK=LENGTHS_FILE")
            loads[task] = read_lengths(path)
        graph = graph.with_workloads(loads)
    plan = plan_waves(graph, args.gpus, handover=args.handover)
    print(f"waves for {args.graph} on {plan.gpus} devices ({len(graph.tasks)} tasks, {len(graph.metaops)} MetaOps, "
          f"{len(plan.frontier_bounds_ms)} frontiers): {plan.method} plan")
    for f, bound in enumerate(plan.frontier_bounds_ms):
        mine = [w for w in plan.waves if w.frontier == f]
        got = sum(w.ms for w in mine)
        print(f"frontier {f}: {got:.3f} ms in {len(mine)} wave(s), lower bound C* {bound:.3f} ms")
        for w in mine:
            ops = "  ".join(f"{o.op}[{_ranks(o.ranks)}]x{o.layers}" for o in w.ops)
            print(f"  {w.ms:10.3f} ms  {ops}")
    fixed = " ".join(f"{t}:{n}" for t, n in plan.fixed_split)
    print(f"total {plan.total_ms:.3f} ms, lower bound {plan.lower_bound_ms:.3f} ms, gap {100 * plan.gap:.2f}%")
    print(f"wavefront {plan.spindle_ms:.3f} ms; baselines: all {plan.all_ms:.3f} ms, "
          f"fixed split {plan.fixed_split_ms:.3f} ms ({fixed or 'more tasks than devices'})")
    print(f"docs moved between waves {plan.moved_samples:.0f}; planned in {plan.plan_seconds:.3f} s")
    if args.out:
        from balanced_loader.outputs.files import write_text

        write_text(args.out, plan.dumps() + "\n")  # complete or absent (WavePlan.save writes in place)
        print(f"wrote {args.out}")
    return 0
