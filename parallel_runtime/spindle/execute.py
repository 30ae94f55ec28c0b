"""Execute a Spindle wave plan on a gloo (or NCCL) world, and check it against one process.

``python -m parallel_runtime.spindle.execute --graph recipes/spindle-cpu-4.yaml --world-size 4 [--steps K] [--seed S]``
plans the graph's waves for ``--world-size`` devices (``plan_waves(graph, gpus=N)``, or
``--plan PLAN.json`` from ``balanced-loader waves --out``), spawns that many gloo processes,
runs ``--steps`` training steps of :mod:`parallel_runtime.spindle.model` wave by wave, runs
the same steps in this process without parallelism, and prints one JSON object: per-step
losses of both, ``max_rel_diff_loss``, ``max_rel_diff_grad`` and each wave's measured time
next to its planned ``ms``. Exit code 1 when a difference exceeds ``--tolerance``, 2 for bad
input. ``--reference`` runs only the single-process reference and prints its losses.

Three rooms: what every rank executes (:mod:`.exec_plan`: lanes, moves, gradient groups), the
schedule (this module: :func:`run_step`), and moving tensors between ranks (:mod:`.transport`).
Execution (:func:`~parallel_runtime.spindle.exec_plan.build_exec_plan` turns the plan into this,
every rank computes the same):

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
  every rank (:class:`parallel_runtime.groups.GroupCache`); a rank outside a union neither
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_runtime.groups import GroupCache
from parallel_runtime.launch import spawn_world
from parallel_runtime.spindle.exec_plan import Entry, EntryKey, ExecPlan, build_exec_plan
from parallel_runtime.spindle.model import (
    MetaOpModelConfig,
    MultiTaskModel,
    OpSpec,
    max_rel_diff,
    op_specs,
    reference_step,
    sinks,
)
from parallel_runtime.spindle.transport import all_reduce_grads, return_gradients, send_activations

if TYPE_CHECKING:
    from balanced_loader.spindle.graph import Graph
    from balanced_loader.spindle.wave_plan import WavePlan

# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every rank runs: plain data, so worker processes import only torch and this package."""

    ops: tuple[OpSpec, ...]
    exec_plan: ExecPlan
    config: MetaOpModelConfig
    steps: int = 1
    lr: float = 0.01


def make_job(graph: Graph, plan: WavePlan, config: MetaOpModelConfig, *, steps: int = 1, lr: float = 0.01) -> Job:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return Job(ops=op_specs(graph), exec_plan=build_exec_plan(graph, plan), config=config, steps=steps, lr=lr)


@dataclass(kw_only=True)
class StepState:
    """What one rank holds during a step, by entry and by move."""

    outputs: dict[EntryKey, torch.Tensor] = field(default_factory=dict)  # [lane samples, tokens, hidden]
    pieces: dict[int, torch.Tensor] = field(default_factory=dict)  # move tag -> input piece [samples, tokens, hidden]
    losses: dict[EntryKey, torch.Tensor] = field(default_factory=dict)  # sink entry -> [] its share of the loss
    output_grads: dict[EntryKey, torch.Tensor] = field(default_factory=dict)  # like outputs, summed over consumers


def run_step(model: MultiTaskModel, exec_plan: ExecPlan, step: int, rank: int, groups: GroupCache,
             times: dict[str, list[Any]]) -> dict[str, float]:
    """Forward wave by wave, backward in reverse wave order, gradient all-reduce; returns this rank's
    partial losses by sink and appends per-wave seconds to ``times``."""
    c = model.config
    sample_shape = (c.tokens, c.hidden)
    num_waves = len(exec_plan.waves)
    fwd, bwd, comm = [0.0] * num_waves, [0.0] * num_waves, [0.0] * num_waves

    def lane_start(key: EntryKey) -> int:
        return exec_plan.entry(key).my_lane(rank).start

    state = StepState()
    model.zero_grad()
    for wave, entries in enumerate(exec_plan.waves):
        t0 = time.perf_counter()
        state.pieces.update(send_activations(exec_plan.moves[wave], rank, state.outputs, lane_start, sample_shape))
        t1 = time.perf_counter()
        for entry in entries:
            if entry.lane_of(rank) is not None:
                forward_entry(model, exec_plan, entry, step, rank, state)
        fwd[wave], comm[wave] = time.perf_counter() - t1, t1 - t0
    # backward in reverse wave order: by the time a wave runs backward, every consumer of its outputs
    # (all in later waves) has sent its gradient back, so each entry back-propagates once
    for wave in reversed(range(num_waves)):
        t0 = time.perf_counter()
        for entry in exec_plan.waves[wave]:
            if entry.lane_of(rank) is not None:
                backward_entry(entry, state)
        t1 = time.perf_counter()
        returned = return_gradients(exec_plan.moves[wave], rank, state.pieces, exec_plan.num_moves, sample_shape)
        for move, grad in returned:
            add_output_grad(state, move.src_entry, move.start - lane_start(move.src_entry), grad)
        bwd[wave], comm[wave] = t1 - t0, comm[wave] + time.perf_counter() - t1
    assert not state.output_grads, "every gradient sent back was consumed by a backward"
    t0 = time.perf_counter()
    reduce_gradients(model, exec_plan, rank, groups)
    times["fwd"].append(fwd)
    times["bwd"].append(bwd)
    times["comm"].append(comm)
    times["reduce"].append(time.perf_counter() - t0)
    return {exec_plan.entry(key).op: float(v.detach()) for key, v in state.losses.items()}


def entry_input(model: MultiTaskModel, exec_plan: ExecPlan, entry: Entry, step: int, rank: int,
                state: StepState) -> torch.Tensor:
    """This rank's input of ``entry`` (``[lane samples, tokens, hidden]``): its pieces from each source
    entry, concatenated in sample order and summed over sources; synthetic data for a first entry."""
    lane = entry.my_lane(rank)
    if not entry.sources:
        return model.op_input(entry.op, step)[lane.start:lane.stop]
    moves = exec_plan.moves[entry.key[0]]
    x = None  # [lane samples, tokens, hidden]
    for src in entry.sources:
        mine = sorted((mv for mv in moves if mv.dst_entry == entry.key and mv.src_entry == src and mv.dst == rank),
                      key=lambda mv: mv.start)  # this lane's pieces from source ``src``, in sample order
        assert mine[0].start == lane.start and mine[-1].stop == lane.stop, "pieces must tile the lane"
        part = torch.cat([state.pieces[mv.tag].requires_grad_() for mv in mine])
        x = part if x is None else x + part
    return x


def forward_entry(model: MultiTaskModel, exec_plan: ExecPlan, entry: Entry, step: int, rank: int,
                  state: StepState) -> None:
    """Run ``entry``'s layers on this rank's lane; a sink's last entry adds its loss (summed / global batch)."""
    lane = entry.my_lane(rank)
    y = model.run_layers(  # [lane samples, tokens, hidden]
        entry.op, entry_input(model, exec_plan, entry, step, rank, state), entry.first_layer, entry.layers)
    state.outputs[entry.key] = y
    if entry.loss:
        labels = model.labels(entry.op, step)[lane.start:lane.stop]
        # dividing by the MetaOp's global batch makes the sum of the lanes' losses the batch mean
        state.losses[entry.key] = model.loss_sum(entry.op, y, labels) / entry.batch


def backward_entry(entry: Entry, state: StepState) -> None:
    """Back-propagate ``entry`` from its outputs' gradient (from every consumer) and its loss."""
    roots, grads = [], []
    if entry.key in state.output_grads:
        roots.append(state.outputs[entry.key])
        grads.append(state.output_grads.pop(entry.key))
    if entry.key in state.losses:
        roots.append(state.losses[entry.key])
        grads.append(torch.ones_like(state.losses[entry.key]))
    assert roots, f"entry {entry.key} of '{entry.op}' has neither consumers nor a loss"
    torch.autograd.backward(roots, grads)


def add_output_grad(state: StepState, key: EntryKey, offset: int, grad: torch.Tensor) -> None:
    """Add a consumer's gradient of samples ``[offset, offset + len(grad))`` of this rank's output of ``key``."""
    if key not in state.output_grads:
        state.output_grads[key] = torch.zeros_like(state.outputs[key])
    state.output_grads[key][offset:offset + len(grad)] += grad


def reduce_gradients(model: MultiTaskModel, exec_plan: ExecPlan, rank: int, groups: GroupCache) -> None:
    """Sum each parameter's gradient over the ranks that ran it (one all-reduce per gradient group)."""
    for ranks, names in exec_plan.grad_groups:
        if rank in ranks:  # a rank outside a union never reads those parameters
            all_reduce_grads([model.params[n] for n in names], groups.get(ranks), len(ranks))


def run_rank(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Run ``job.steps`` steps of the wave plan on this rank (call on every rank of the world).

    Returns per step this rank's partial losses (by sink) and the reduced gradients of the
    parameters it ran, and per-wave compute and communication seconds.
    """
    exec_plan = job.exec_plan
    if world_size != exec_plan.world_size:
        raise ValueError(f"the wave plan is for {exec_plan.world_size} devices but the world has {world_size} ranks")
    groups = GroupCache.build(extra=[ranks for ranks, _ in exec_plan.grad_groups])
    model = MultiTaskModel(job.ops, job.config)
    mine = [n for ranks, names in exec_plan.grad_groups if rank in ranks for n in names]
    times: dict[str, list[Any]] = {"fwd": [], "bwd": [], "comm": [], "reduce": []}
    losses, grads = [], []
    for step in range(job.steps):
        losses.append(run_step(model, exec_plan, step, rank, groups, times))
        grads.append({n: model.params[n].grad.detach().clone() for n in mine})
        with torch.no_grad():
            model.sgd(job.lr)
    return {"losses": losses, "grads": grads, "times": times}


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


def run_reference(graph: Graph, config: MetaOpModelConfig, *, steps: int, lr: float
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


def compare(graph: Graph, plan: WavePlan, config: MetaOpModelConfig, results: Sequence[dict[str, Any]], *,
            steps: int, lr: float) -> dict[str, Any]:
    """The report of a distributed run (``results`` by rank) against the reference."""
    exec_plan = build_exec_plan(graph, plan)
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
    for k in range(len(exec_plan.waves)):
        per_step = [max(res["times"]["fwd"][t][k] + res["times"]["bwd"][t][k] for res in results) for t in timed]
        measured.append(1e3 * statistics.median(per_step))
    comm = [1e3 * statistics.median(max(res["times"]["comm"][t][k] for res in results) for t in timed)
            for k in range(len(exec_plan.waves))]
    ratios = [m / p if p > 0 else math.nan for m, p in zip(measured, exec_plan.planned_ms)]
    return {
        "world_size": exec_plan.world_size, "steps": steps, "method": plan.method,
        "planned_total_ms": round(plan.total_ms, 6), "measured_total_ms": round(sum(measured), 3),
        "num_waves": len(exec_plan.waves), "moves": exec_plan.num_moves, "moved_samples": exec_plan.moved_samples(),
        "grad_groups": [list(ranks) for ranks, _ in exec_plan.grad_groups],
        "losses": [{s: round(v, 7) for s, v in lo.items()} for lo in losses],
        "reference_losses": [{s: round(v, 7) for s, v in lo.items()} for lo in ref_losses],
        "max_rel_diff_loss": diff_loss, "max_rel_diff_grad": diff_grad, "params_not_reduced": missing,
        "waves": [{"planned_ms": round(p, 6), "measured_ms": round(m, 3), "comm_ms": round(cm, 3),
                   "ratio": round(r, 4)} for p, m, cm, r in zip(exec_plan.planned_ms, measured, comm, ratios)],
        "ratio_median": round(statistics.median(ratios), 4),
        "pearson_r": _pearson(list(exec_plan.planned_ms), measured),
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


def execute(graph: Graph, plan: WavePlan, config: MetaOpModelConfig, *, steps: int = 1, lr: float = 0.01,
            timeout_s: float = 300.0, threads: int = 1) -> dict[str, Any]:
    """Spawn ``plan.gpus`` gloo processes, run the plan, and compare with the reference (see :func:`compare`)."""
    job = make_job(graph, plan, config, steps=steps, lr=lr)  # bad input fails here, before any process starts
    results = spawn_world(run_rank, plan.gpus, job, timeout_s=timeout_s, threads=threads)
    return compare(graph, plan, config, results, steps=steps, lr=lr)


def calibrate(config: MetaOpModelConfig, batches: Sequence[int] = (1, 2, 4, 8, 16, 32), repeats: int = 20
              ) -> dict[str, Any]:
    """Fit ``t(b) = alpha_ms + beta_ms * b`` to one block's forward+backward on ``b`` samples, one thread.

    Each point is the fastest of ``repeats`` runs; the fit is least squares over ``batches``.
    """
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
    from balanced_loader.spindle.wave_plan import WavePlan

    for k in ("steps", "hidden", "ffn", "tokens"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k} must be >= 1, got {getattr(args, k)}")
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    graph = load_graph(args.graph)
    op_specs(graph)  # equal batches along edges
    config = MetaOpModelConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens, seed=args.seed)
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
