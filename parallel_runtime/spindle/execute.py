"""Execute a Spindle wave plan on a gloo (or NCCL) world, and check it against one process.

``python -m parallel_runtime.spindle.execute --graph recipes/spindle-cpu-4.yaml --world-size 4 [--steps K] [--seed S]``
plans the graph's waves for ``--world-size`` devices (``plan_waves(graph, gpus=N)``, or
``--plan PLAN.json`` from ``balanced-loader waves --out``), spawns that many gloo processes,
runs ``--steps`` training steps of :mod:`parallel_runtime.spindle.model` wave by wave, runs
the same steps in this process without parallelism, and prints one JSON object: per-step
losses of both, ``max_rel_diff_loss``, ``max_rel_diff_grad`` and each wave's measured time
next to its planned ``ms``. Exit code 1 when a difference exceeds ``--tolerance``, 2 for bad
input. ``--reference`` runs only the single-process reference and prints its losses.

Execution (:func:`build_exec_plan` turns the plan into this, every rank computes the same):

* **Lanes.** An entry's samples are split over its lanes by ``batch_shards``; a lane's work is
  done by its first rank (tp index 0). Entries with ``tp > 1`` are executed this way too: the
  other TP ranks of the lane stay idle (there is no tensor-parallel engine for these blocks),
  so results are exact and only the timing of such entries is pessimistic. Lanes with no
  sample (more lanes than samples) do nothing.
* **Forward, wave by wave.** Before wave ``k`` every entry's input moves to its lanes: from
  the lanes of the MetaOp's previous entry (re-sharding when ranks or lane counts change), or,
  for its first entry, from the last entries of its predecessors (the encoder -> backbone
  hand-over; several predecessors are summed). The moves are point-to-point ``isend``/``irecv``
  of per-sample activations; shapes follow from the plan, so there is no handshake. A piece
  that stays on its rank is copied. Every received piece is a leaf of this wave's autograd
  graph, so waves are independent graphs.
* **Backward, in reverse wave order.** Each entry back-propagates from its outputs' gradient
  (accumulated from every consumer) and, for the last entry of a sink MetaOp, its loss; the
  gradients of its input pieces travel the same moves in reverse and accumulate at the
  producer.
* **Gradients.** Parameters are replicated on every rank. Each parameter's gradient is summed
  by one all-reduce over the union of the ranks that ran it (all MetaOps sharing its module,
  all entries), one flat buffer per distinct union, unions created up front in one order on
  every rank (:class:`parallel_runtime.groups.ProcessGroups`); a rank outside a union neither
  reduces nor updates those parameters (it never reads them). Each sink's loss is its summed
  per-sample loss divided by its global batch, so the sum over lanes is exact.
  Then every rank applies SGD to the parameters it holds gradients for.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parallel_runtime.spindle.model import (
    ModelConfig,
    MultiTaskModel,
    OpSpec,
    block_names,
    head_names,
    max_rel_diff,
    op_specs,
    reference_step,
    sinks,
)

if TYPE_CHECKING:
    from balanced_loader.spindle.graph import Graph
    from balanced_loader.spindle.schedule import WavePlan

EntryKey = tuple[int, int]  # (wave, index of the entry in the wave)


@dataclass(frozen=True, kw_only=True, slots=True)
class Lane:
    rank: int  # the rank that does the lane's work (its tp index 0)
    start: int
    stop: int  # samples [start, stop) of the MetaOp's batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    key: EntryKey
    op: str
    first_layer: int
    layers: int
    batch: int  # the MetaOp's global batch
    lanes: tuple[Lane, ...]  # [lanes with samples]
    sources: tuple[EntryKey, ...]  # the entries whose outputs are its input (summed); () for synthetic input
    loss: bool  # the last entry of a sink MetaOp: ends in its head and loss

    def lane_of(self, rank: int) -> Lane | None:
        return next((ln for ln in self.lanes if ln.rank == rank), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """Samples ``[start, stop)`` of an entry's output going from ``src`` to ``dst`` (an entry's input)."""

    tag: int  # unique in the step (the backward reply uses tag + num_moves)
    src_entry: EntryKey
    dst_entry: EntryKey
    src: int
    dst: int
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecPlan:
    """What every rank executes for one wave plan (identical on every rank)."""

    world_size: int
    waves: tuple[tuple[Entry, ...], ...]  # [num_waves][entries]
    moves: tuple[tuple[Move, ...], ...]  # [num_waves] moves into the entries of that wave
    grad_groups: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]  # [groups] (union ranks, parameter names)
    planned_ms: tuple[float, ...]  # [num_waves]

    @property
    def num_moves(self) -> int:
        return sum(len(m) for m in self.moves)

    def moved_samples(self) -> int:
        """Samples whose activations change rank (re-sharding and hand-over), per step."""
        return sum(m.stop - m.start for ms in self.moves for m in ms if m.src != m.dst)

    def group_of(self, name: str) -> tuple[int, ...]:
        return next(ranks for ranks, names in self.grad_groups if name in names)


def build_exec_plan(graph: Graph, plan: WavePlan) -> ExecPlan:
    """Lanes, moves and gradient groups of ``plan`` (validated against ``graph``)."""
    from balanced_loader.spindle.schedule import batch_shards

    if graph.gpus != plan.gpus:
        graph = graph.with_gpus(plan.gpus)
    plan.validate(graph)
    specs = op_specs(graph)
    ops = {op.name: op for op in specs}
    sink_set = set(sinks(specs))
    last: dict[str, EntryKey] = {}  # MetaOp -> its latest entry so far
    entries: dict[EntryKey, Entry] = {}
    waves: list[tuple[Entry, ...]] = []
    moves: list[tuple[Move, ...]] = []
    tag = 0
    for k, w in enumerate(plan.waves):
        wave_entries, wave_moves = [], []
        for i, wo in enumerate(w.ops):
            op = ops[wo.op]
            shards = batch_shards(op.batch, wo.num_lanes)
            lanes = tuple(Lane(rank=ranks[0], start=a, stop=b) for ranks, (a, b) in zip(wo.lanes(), shards) if b > a)
            if wo.first_layer > 0:
                sources: tuple[EntryKey, ...] = (last[wo.op],)
            else:
                sources = tuple(last[a] for a in op.after)
            done = wo.first_layer + wo.layers == op.layers
            e = Entry(key=(k, i), op=wo.op, first_layer=wo.first_layer, layers=wo.layers, batch=op.batch,
                      lanes=lanes, sources=sources, loss=done and wo.op in sink_set)
            for s in sources:
                for src in entries[s].lanes:
                    for dst in lanes:
                        a, b = max(src.start, dst.start), min(src.stop, dst.stop)
                        if b > a:
                            wave_moves.append(Move(tag=tag, src_entry=s, dst_entry=e.key, src=src.rank,
                                                   dst=dst.rank, start=a, stop=b))
                            tag += 1
            entries[e.key] = e
            last[wo.op] = e.key
            wave_entries.append(e)
        waves.append(tuple(wave_entries))
        moves.append(tuple(wave_moves))
    # the ranks that ran each parameter, then one group per distinct union (sorted by ranks)
    ran: dict[str, set[int]] = {}
    for e in entries.values():
        names = [n for layer in range(e.first_layer, e.first_layer + e.layers)
                 for n in block_names(ops[e.op].module, layer)]
        if e.loss:
            names += head_names(e.op)
        for n in names:
            ran.setdefault(n, set()).update(ln.rank for ln in e.lanes)
    by_union: dict[tuple[int, ...], list[str]] = {}
    for n, ranks in ran.items():
        by_union.setdefault(tuple(sorted(ranks)), []).append(n)
    groups = tuple((ranks, tuple(by_union[ranks])) for ranks in sorted(by_union, key=lambda r: (len(r), r)))
    return ExecPlan(world_size=plan.gpus, waves=tuple(waves), moves=tuple(moves), grad_groups=groups,
                    planned_ms=tuple(w.ms for w in plan.waves))


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every rank runs: plain data, so worker processes import only torch and this package."""

    ops: tuple[OpSpec, ...]
    xp: ExecPlan
    config: ModelConfig
    steps: int = 1
    lr: float = 0.01


def make_job(graph: Graph, plan: WavePlan, config: ModelConfig, *, steps: int = 1, lr: float = 0.01) -> Job:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return Job(ops=op_specs(graph), xp=build_exec_plan(graph, plan), config=config, steps=steps, lr=lr)


def _exchange(sends: Sequence[tuple[Any, int, int]], recvs: Sequence[tuple[Any, int, int]]) -> None:
    """Post every ``(tensor, peer, tag)`` receive and send, then wait for all."""
    import torch.distributed as dist

    reqs = [dist.irecv(t, src=peer, tag=tag) for t, peer, tag in recvs]
    reqs += [dist.isend(t, dst=peer, tag=tag) for t, peer, tag in sends]
    for r in reqs:
        r.wait()


def _step(model: MultiTaskModel, xp: ExecPlan, step: int, rank: int, groups: Any,
          times: dict[str, list[float]]) -> dict[str, float]:
    """Forward wave by wave, backward in reverse, gradient all-reduce; returns this rank's partial losses."""
    import torch
    import torch.distributed as dist

    c = model.config
    width = (c.tokens, c.hidden)
    outs: dict[EntryKey, torch.Tensor] = {}  # this rank's lane output of each entry
    pieces: dict[int, torch.Tensor] = {}  # move tag -> received input piece (autograd leaf)
    losses: dict[EntryKey, torch.Tensor] = {}
    num_waves = len(xp.waves)
    fwd, bwd, comm = [0.0] * num_waves, [0.0] * num_waves, [0.0] * num_waves
    model.zero_grad()
    for k, entries in enumerate(xp.waves):
        t0 = time.perf_counter()
        sends, recvs = [], []
        for m in xp.moves[k]:
            if m.src == rank:
                lane = _lane(xp, m.src_entry, rank)
                piece = outs[m.src_entry].detach()[m.start - lane.start:m.stop - lane.start]
                if m.dst == rank:
                    pieces[m.tag] = piece.clone()
                else:
                    sends.append((piece.contiguous(), m.dst, m.tag))
            elif m.dst == rank:
                pieces[m.tag] = torch.empty((m.stop - m.start, *width))
                recvs.append((pieces[m.tag], m.src, m.tag))
        _exchange(sends, recvs)
        t1 = time.perf_counter()
        for e in entries:
            lane = e.lane_of(rank)
            if lane is None:
                continue
            if e.sources:
                x = None
                for s in e.sources:
                    mine = sorted((m for m in xp.moves[k] if m.dst_entry == e.key and m.src_entry == s
                                   and m.dst == rank), key=lambda m: m.start)
                    assert mine[0].start == lane.start and mine[-1].stop == lane.stop
                    part = torch.cat([pieces[m.tag].requires_grad_() for m in mine])
                    x = part if x is None else x + part
            else:
                x = model.op_input(e.op, step)[lane.start:lane.stop]
            y = model.run_layers(e.op, x, e.first_layer, e.layers)
            outs[e.key] = y
            if e.loss:
                labels = model.labels(e.op, step)[lane.start:lane.stop]
                losses[e.key] = model.loss_sum(e.op, y, labels) / e.batch
        t2 = time.perf_counter()
        fwd[k], comm[k] = t2 - t1, t1 - t0
    grad_out: dict[EntryKey, torch.Tensor] = {}
    for k in reversed(range(num_waves)):
        t0 = time.perf_counter()
        for e in xp.waves[k]:
            if e.lane_of(rank) is None:
                continue
            roots, grads = [], []
            if e.key in grad_out:
                roots.append(outs[e.key])
                grads.append(grad_out.pop(e.key))
            if e.key in losses:
                roots.append(losses[e.key])
                grads.append(torch.ones_like(losses[e.key]))
            assert roots, f"entry {e.key} of '{e.op}' has neither consumers nor a loss"
            torch.autograd.backward(roots, grads)
        t1 = time.perf_counter()
        sends, recvs, into = [], [], []
        for m in xp.moves[k]:
            back = m.tag + xp.num_moves
            if m.dst == rank:
                g = pieces[m.tag].grad
                g = torch.zeros_like(pieces[m.tag]) if g is None else g
                if m.src == rank:
                    into.append((m, g))
                else:
                    sends.append((g.contiguous(), m.src, back))
            elif m.src == rank:
                buf = torch.empty((m.stop - m.start, *width))
                recvs.append((buf, m.dst, back))
                into.append((m, buf))
        _exchange(sends, recvs)
        for m, g in into:
            lane = _lane(xp, m.src_entry, rank)
            if m.src_entry not in grad_out:
                grad_out[m.src_entry] = torch.zeros_like(outs[m.src_entry])
            grad_out[m.src_entry][m.start - lane.start:m.stop - lane.start] += g
        t2 = time.perf_counter()
        bwd[k], comm[k] = t1 - t0, comm[k] + t2 - t1
    assert not grad_out, "every gradient sent back was consumed by a backward"
    t0 = time.perf_counter()
    for ranks, names in xp.grad_groups:
        if rank not in ranks:
            continue
        ps = [model.params[n] for n in names]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        if len(ranks) > 1:
            dist.all_reduce(flat, group=groups.get(ranks))
        off = 0
        for p in ps:
            p.grad = flat[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
    times["fwd"].append(fwd)
    times["bwd"].append(bwd)
    times["comm"].append(comm)
    times["reduce"].append(time.perf_counter() - t0)
    return {xp.waves[key[0]][key[1]].op: float(v.detach()) for key, v in losses.items()}


def _lane(xp: ExecPlan, key: EntryKey, rank: int) -> Lane:
    lane = xp.waves[key[0]][key[1]].lane_of(rank)
    assert lane is not None
    return lane


def run_rank(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Run ``job.steps`` steps of the wave plan on this rank (call on every rank of the world).

    Returns per step this rank's partial losses (by sink) and the reduced gradients of the
    parameters it ran, and per-wave compute and communication seconds.
    """
    import torch

    from parallel_runtime.groups import ProcessGroups

    xp = job.xp
    if world_size != xp.world_size:
        raise ValueError(f"the wave plan is for {xp.world_size} devices but the world has {world_size} ranks")
    groups = ProcessGroups.build(extra=[ranks for ranks, _ in xp.grad_groups])
    model = MultiTaskModel(job.ops, job.config)
    mine = [n for ranks, names in xp.grad_groups if rank in ranks for n in names]
    times: dict[str, list[Any]] = {"fwd": [], "bwd": [], "comm": [], "reduce": []}
    losses, grads = [], []
    for step in range(job.steps):
        losses.append(_step(model, xp, step, rank, groups, times))
        grads.append({n: model.params[n].grad.detach().clone() for n in mine})
        with torch.no_grad():
            model.sgd(job.lr)
    return {"losses": losses, "grads": grads, "times": times}


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


def run_reference(graph: Graph, config: ModelConfig, *, steps: int, lr: float
                  ) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """Per-step losses and gradients of the single-process reference (SGD between steps)."""
    model = MultiTaskModel(graph, config)
    losses, grads = [], []
    for step in range(steps):
        lo, gr = reference_step(model, step)
        losses.append(lo)
        grads.append(gr)
        model.sgd(lr)
    return losses, grads


def compare(graph: Graph, plan: WavePlan, config: ModelConfig, results: Sequence[dict[str, Any]], *,
            steps: int, lr: float) -> dict[str, Any]:
    """The report of a distributed run (``results`` by rank) against the reference."""
    xp = build_exec_plan(graph, plan)
    ref_losses, ref_grads = run_reference(graph, config, steps=steps, lr=lr)
    losses = []
    for step in range(steps):
        tot: dict[str, float] = dict.fromkeys(sinks(op_specs(graph)), 0.0)
        for res in results:
            for s, v in res["losses"][step].items():
                tot[s] += v
        losses.append(tot)
    diff_loss = max(abs(losses[t][s] - ref_losses[t][s]) / max(abs(ref_losses[t][s]), 1e-12)
                    for t in range(steps) for s in ref_losses[t])
    diff_grad = max(max_rel_diff(res["grads"][t], ref_grads[t]) for res in results for t in range(steps))
    covered = set().union(*(res["grads"][0] for res in results))
    missing = sorted(set(ref_grads[0]) - covered)
    # per-wave time: the slowest rank's compute (forward + backward), median over steps after the first
    timed = range(1, steps) if steps > 1 else range(steps)
    measured = []
    for k in range(len(xp.waves)):
        per_step = [max(res["times"]["fwd"][t][k] + res["times"]["bwd"][t][k] for res in results) for t in timed]
        measured.append(1e3 * statistics.median(per_step))
    comm = [1e3 * statistics.median(max(res["times"]["comm"][t][k] for res in results) for t in timed)
            for k in range(len(xp.waves))]
    ratios = [m / p if p > 0 else math.nan for m, p in zip(measured, xp.planned_ms)]
    return {
        "world_size": xp.world_size, "steps": steps, "method": plan.method,
        "planned_total_ms": round(plan.total_ms, 6), "measured_total_ms": round(sum(measured), 3),
        "num_waves": len(xp.waves), "moves": xp.num_moves, "moved_samples": xp.moved_samples(),
        "grad_groups": [list(ranks) for ranks, _ in xp.grad_groups],
        "losses": [{s: round(v, 7) for s, v in lo.items()} for lo in losses],
        "reference_losses": [{s: round(v, 7) for s, v in lo.items()} for lo in ref_losses],
        "max_rel_diff_loss": diff_loss, "max_rel_diff_grad": diff_grad, "params_not_reduced": missing,
        "waves": [{"planned_ms": round(p, 6), "measured_ms": round(m, 3), "comm_ms": round(cm, 3),
                   "ratio": round(r, 4)} for p, m, cm, r in zip(xp.planned_ms, measured, comm, ratios)],
        "ratio_median": round(statistics.median(ratios), 4),
        "pearson_r": _pearson(list(xp.planned_ms), measured),
    }


def _pearson(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Pearson correlation (None for fewer than 3 points or no spread)."""
    if len(a) < 3:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    if sa == 0 or sb == 0:
        return None
    return round(sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sa * sb), 4)


def execute(graph: Graph, plan: WavePlan, config: ModelConfig, *, steps: int = 1, lr: float = 0.01,
            timeout_s: float = 300.0, threads: int = 1) -> dict[str, Any]:
    """Spawn ``plan.gpus`` gloo processes, run the plan, and compare with the reference (see :func:`compare`)."""
    from parallel_runtime.launch import spawn_world

    job = make_job(graph, plan, config, steps=steps, lr=lr)  # bad input fails here, before any process starts
    results = spawn_world(run_rank, plan.gpus, job, timeout_s=timeout_s, threads=threads)
    return compare(graph, plan, config, results, steps=steps, lr=lr)


def calibrate(config: ModelConfig, batches: Sequence[int] = (1, 2, 4, 8, 16, 32), repeats: int = 20
              ) -> dict[str, Any]:
    """Fit ``t(b) = alpha_ms + beta_ms * b`` to one block's forward+backward on ``b`` samples, one thread.

    Each point is the fastest of ``repeats`` runs; the fit is least squares over ``batches``.
    """
    import torch

    from balanced_loader.spindle.graph import graph_from_dict

    probe = graph_from_dict({"gpus": 1, "metaops": [{"name": "probe", "task": "probe", "layers": 1, "batch": 1,
                                                     "alpha_ms": 0.0, "beta_ms": 0.0}]})
    model = MultiTaskModel(probe, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ms = []
    try:
        for b in batches:
            x = torch.randn((b, config.tokens, config.hidden), requires_grad=True)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = model.run_layers("probe", x, 0, 1)
                y.backward(torch.ones_like(y))
                best = min(best, time.perf_counter() - t0)
            ms.append(1e3 * best)
    finally:
        torch.set_num_threads(threads)
    mb, mt = statistics.fmean(batches), statistics.fmean(ms)
    beta = sum((b - mb) * (t - mt) for b, t in zip(batches, ms)) / sum((b - mb) ** 2 for b in batches)
    return {"hidden": config.hidden, "ffn": config.ffn, "tokens": config.tokens,
            "alpha_ms": round(mt - beta * mb, 4), "beta_ms": round(beta, 5),
            "points": {str(b): round(t, 4) for b, t in zip(batches, ms)}}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime.spindle.execute", description=__doc__.splitlines()[0])
    ap.add_argument("--graph", required=True, help="multi-task graph YAML (recipes/spindle-*.yaml)")
    ap.add_argument("--world-size", type=int, default=None, help="gloo processes = devices planned for "
                    "(default: the graph's gpus, or the --plan's)")
    ap.add_argument("--plan", default=None, help="execute this wave plan JSON instead of planning")
    ap.add_argument("--reference", action="store_true", help="only the single-process reference: print its losses")
    ap.add_argument("--calibrate", action="store_true",
                    help="only measure one block's forward+backward here and print the fitted alpha_ms, beta_ms")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seeds parameters, inputs and labels")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate between steps")
    ap.add_argument("--hidden", type=int, default=64, help="block width")
    ap.add_argument("--ffn", type=int, default=256, help="inner width of each block's MLP")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss/gradient difference")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is stopped")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = _run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in report.items()) + "\n}")
    return 0 if report.get("ok", True) else 1


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from balanced_loader.spindle.graph import load_graph
    from balanced_loader.spindle.planner import plan_waves
    from balanced_loader.spindle.schedule import WavePlan

    for k in ("steps", "hidden", "ffn", "tokens"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k} must be >= 1, got {getattr(args, k)}")
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    graph = load_graph(args.graph)
    op_specs(graph)  # equal batches along edges
    config = ModelConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens, seed=args.seed)
    if args.calibrate:
        return calibrate(config)
    if args.reference:
        losses, grads = run_reference(graph, config, steps=args.steps, lr=args.lr)
        norms = [math.sqrt(sum(float(g.square().sum()) for g in gr.values())) for gr in grads]
        return {"reference": True, "steps": args.steps, "losses": losses, "grad_norm": norms}
    if args.plan is not None:
        plan = WavePlan.load(args.plan)
        if args.world_size is not None and args.world_size != plan.gpus:
            raise ValueError(f"--world-size {args.world_size} differs from the plan's {plan.gpus} devices")
    else:
        plan = plan_waves(graph, gpus=args.world_size or graph.gpus)
    report = execute(graph, plan, config, steps=args.steps, lr=args.lr, timeout_s=args.timeout)
    report["graph"] = args.graph
    report["tolerance"] = args.tolerance
    report["ok"] = (report["max_rel_diff_grad"] <= args.tolerance and report["max_rel_diff_loss"] <= args.tolerance
                    and not report["params_not_reduced"])
    return report


if __name__ == "__main__":
    sys.exit(main())
