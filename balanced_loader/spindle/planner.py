"""Spindle's wavefront planner: :func:`plan_waves` turns a multi-task graph into a :class:`WavePlan`.

Per frontier (MetaOps whose predecessors have all finished): the allocator's bisection gives
the common finish time ``C*`` (the frontier's continuous lower bound) and at most two slices
per MetaOp; Spindle's greedy packer turns them into waves. The frontier keeps the shortest of
several candidates (:func:`frontier_candidates`; Spindle's greedy wins ties; on small frontiers
an exact MILP over every configuration, which proves the frontier optimal among whole-layer plans), its waves are
ordered so consecutive ones share (MetaOp, count) pairs; MetaOps of later frontiers that are ready
earlier take idle devices of earlier waves (:mod:`.overlap`, kept when the total drops), and placement
assigns ranks wave by wave. The baselines (``all``, ``fixed_split``) are planned too, and the best of the three
plans is returned (ties go to the wavefront plan), so the result is never worse than a
baseline; ``lower_bound_ms`` is the sum of the frontiers' ``C*``, a lower bound of every plan
that runs frontier by frontier on allowed counts (when the wave-boundary search moved a MetaOp across a
frontier, the smaller of that and :func:`.overlap.graph_bound`, a bound of every plan).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from balanced_loader.spindle.allocator import allocate, integer_allocation
from balanced_loader.spindle.baselines import PlacedWave, all_devices, fixed_split
from balanced_loader.spindle.columns import generate_columns, lp_waves
from balanced_loader.spindle.exact import all_configurations, ilp_waves
from balanced_loader.spindle.graph import Graph
from balanced_loader.spindle.overlap import graph_bound, split_waves
from balanced_loader.spindle.placement import movement, place
from balanced_loader.spindle.refine import refine
from balanced_loader.spindle.schedule import Wave, WaveOp, WavePlan
from balanced_loader.spindle.wave_kernels import warm
from balanced_loader.spindle.waves import Run, order_waves, pack, waves_ms

CANDIDATES = ("packed+fill", "packed", "columns", "refined", "exact", "single-wave", "sequential")
EXACT_MAX_CONFIGS = 400  # the MILP runs over every maximal configuration when there are at most this many
EXACT_MAX_PAIRS = 600  # ... and at most this many layer variables
OVERLAP_MIN_GAIN = 0.005  # the wave-boundary search's plan is kept when it is at least this much shorter
EXACT_NODES = 5000  # HiGHS branch-and-bound nodes per frontier (its best plan so far is used past it)



def _pairs(configs: Sequence[Sequence[int]]) -> int:
    """Layer variables of the MILP over ``configs``: one per MetaOp present in a configuration."""
    return sum(1 for col in configs for c in col if c)


def frontier_candidates(graph: Graph, frontier: Sequence[int], gpus: int, *,
                        columns: bool = True) -> tuple[float, dict[str, list[list[Run]]]]:
    """``C*`` and the unplaced waves of every candidate schedule of one frontier."""
    c_star, cands, _ = search_frontier(graph, frontier, gpus, columns=columns)
    return c_star, cands


def search_frontier(graph: Graph, frontier: Sequence[int], gpus: int, *,
                    columns: bool = True) -> tuple[float, dict[str, list[list[Run]]], bool]:
    """``C*``, the unplaced waves of every candidate schedule of one frontier, and whether the
    ``exact`` candidate is proven optimal among whole-layer plans.

    ``packed+fill`` and ``packed``: Spindle's greedy packer with and without the idle-device
    fill; ``columns``: the column-generation packer; ``refined``: the wave local search from
    the best allowed-count candidate and from ``columns``; ``exact`` (frontiers of at most
    ``EXACT_MAX_CONFIGS`` maximal configurations): the MILP of :mod:`.exact` over all of them,
    optimal among whole-layer plans when HiGHS finishes, then the local search;
    ``single-wave``: one allowed count per MetaOp; ``sequential``: one MetaOp after another on
    all devices (largest allowed count).
    """
    ops = graph.metaops
    alloc = allocate([ops[i] for i in frontier], frontier, gpus)
    out: dict[str, list[list[Run]]] = {
        "packed+fill": pack(ops, alloc.slices, gpus, fill=True),
        "packed": pack(ops, alloc.slices, gpus, fill=False),
    }
    single = integer_allocation([ops[i] for i in frontier], gpus)
    if single is not None:
        out["single-wave"] = [[Run(op=i, n=n, layers=ops[i].layers) for i, n in zip(frontier, single[1])]]
    out["sequential"] = [[Run(op=i, n=ops[i].best_count(gpus), layers=ops[i].layers)] for i in frontier]
    start = min((k for k in ("packed+fill", "packed", "single-wave") if k in out),
                key=lambda k: waves_ms(ops, out[k]))
    refined = [refine(ops, out[start], gpus)]
    proven = False
    if columns:
        cols, tau = generate_columns(ops, frontier, gpus, [w for ws in out.values() for w in ws])
        out["columns"] = lp_waves(ops, frontier, cols, tau)
        refined.append(refine(ops, out["columns"], gpus))
        # why only small frontiers: the MILP over the column generation's few configurations of a
        # large frontier cost 4-5x the planning time on the 64-MetaOp graphs for no gain
        every = all_configurations(ops, frontier, gpus, limit=EXACT_MAX_CONFIGS) if len(frontier) > 1 else None
        if every is not None and _pairs(every) <= EXACT_MAX_PAIRS:
            exact, proven = ilp_waves(ops, frontier, every, node_limit=EXACT_NODES)
            if exact is not None:
                out["exact"] = refine(ops, exact, gpus)
    out["refined"] = min(refined, key=lambda ws: waves_ms(ops, ws))
    if len(frontier) == 1:
        proven = True  # one MetaOp: every layer on its fastest count (``sequential``) is optimal
    return alloc.finish_ms, out, proven


def _to_waves(graph: Graph, placed: Sequence[tuple[int, PlacedWave]]) -> tuple[Wave, ...]:
    ops = graph.metaops
    done = [0] * len(ops)
    waves = []
    for f, entries in placed:
        wops = []
        for r, ranks in entries:
            op = ops[r.op]
            tp, dp = op.scaling.layout(len(ranks))
            wops.append(WaveOp(op=op.name, ranks=tuple(ranks), first_layer=done[r.op], layers=r.layers,
                               ms=r.layers * op.layer_ms(len(ranks)), tp=tp, dp=dp))
            done[r.op] += r.layers
        waves.append(Wave(ms=max(o.ms for o in wops), frontier=f, ops=tuple(wops)))
    return tuple(waves)


def plan_waves(graph: Graph, gpus: int | None = None, *, handover: bool = False, search: bool = True) -> WavePlan:
    """Plan ``graph`` on ``gpus`` devices (default: the graph's) and return the best plan.

    ``handover``: let placement also reduce the data moved from predecessors into a MetaOp's
    first wave; ``search``: run placement's local search.
    """
    import scipy.optimize  # noqa: F401  (the column packer's LP solver, loaded before timing)

    warm()
    t0 = time.perf_counter()
    if gpus is not None and gpus != graph.gpus:
        graph = graph.with_gpus(gpus)
    n_gpus, node, ops = graph.gpus, graph.gpus_per_node, graph.metaops
    bounds: list[float] = []
    chosen: list[tuple[int, list[Run]]] = []
    for f, frontier in enumerate(graph.frontiers()):
        c_star, cands = frontier_candidates(graph, frontier, n_gpus)
        bounds.append(c_star)
        best = min(cands, key=lambda k: (waves_ms(ops, cands[k]), CANDIDATES.index(k)))
        chosen.extend((f, w) for w in order_waves(cands[best], chosen[-1][1] if chosen else ()))
    early = split_waves(ops, chosen, n_gpus)  # MetaOps ready before their frontier's barrier use idle devices
    lower = sum(bounds)
    # kept only for a real gain: the plan then crosses frontiers and is measured against a weaker bound
    if waves_ms(ops, [w for _, w in early]) < waves_ms(ops, [w for _, w in chosen]) * (1 - OVERLAP_MIN_GAIN):
        chosen = early
        lower = min(lower, graph_bound(ops, n_gpus))  # the plan crosses frontiers: C* bounds only plans that don't
    ranks = place(ops, [w for _, w in chosen], n_gpus, node, handover=handover, search=search)
    spindle = _to_waves(graph, [(f, list(zip(w, rk))) for (f, w), rk in zip(chosen, ranks)])
    unified = _to_waves(graph, all_devices(graph))
    split = fixed_split(graph)
    decoupled = _to_waves(graph, split.waves) if split is not None else None

    def total(ws: tuple[Wave, ...] | None) -> float:
        return sum(w.ms for w in ws) if ws is not None else float("inf")

    plans = {"spindle": spindle, "fixed_split": decoupled, "all": unified}
    method = min(plans, key=lambda k: (total(plans[k]), list(plans).index(k)))
    waves = plans[method]
    assert waves is not None
    index = {op.name: i for i, op in enumerate(ops)}
    moved = movement(ops, [[(index[o.op], o.ranks) for o in w.ops] for w in waves])
    return WavePlan(method=method, gpus=n_gpus, gpus_per_node=node, waves=waves, lower_bound_ms=lower,
                    frontier_bounds_ms=tuple(bounds), spindle_ms=total(spindle), all_ms=total(unified),
                    fixed_split_ms=total(decoupled), fixed_split=split.devices if split is not None else (),
                    moved_samples=moved, plan_seconds=time.perf_counter() - t0)
