"""GPU-ready without a GPU: ``python -m parallel_runtime estimate --recipe R [--steps K] [--device-gib G] --out DIR``.

Plans ``K`` steps as the recipe's run would (the trainer's loader, the same plans), then:

1. **memory per rank role**: a role is what a rank does in those steps: its pool shape, stage, whether it
   is tp index 0 (which pushes the parameters replicated in its TP group) and the CP degrees it meets.
   One rank per role (the one with the most tokens in flight) runs the runtime's real step
   (:func:`~parallel_runtime.training.rank_step.execute_step` and the optimizer step) on fake tensors under
   torch's fake process group, with the GPU's code paths and a flash-attention stand-in
   (:mod:`~parallel_runtime.diagnostics.fake_world`): its worst step twice, so the optimizer's buffers and
   the bucket buffers count. Its peak is split by kind (parameters, gradients, optimizer shards, buckets,
   activations, attention workspace, temporaries). Every rank's peak is its role's fixed bytes plus the
   role's token-proportional bytes scaled to the rank's own tokens in flight, and must fit the device
   less a reserve: the CUDA context, a share per NCCL communicator the rank uses, and the caching
   allocator's slack (:data:`balanced_loader.presets.RESERVE`).
2. **bytes per collective** of each role's measured step by kind and group (TP, pipeline, CP, the
   optimizer's exchange, the world), against the cost model's communication terms; the exchange's buckets
   and per-peer message sizes; the step's host reads of device values and device synchronizes.
3. **the NCCL replay** (:mod:`~parallel_runtime.diagnostics.replay`) of every rank's ordered communication
   in all ``K`` steps of the real plan. The traces come from every rank's real step with the recipe's model
   cut to ``--replay-layers`` layers per stage (a stage repeats its communication layer by layer, on the
   same communicators in the same order; ``0`` keeps every layer).

Writes ``DIR/estimate.json`` and prints the table. Exit 0: every rank fits and the replay completes; 1: a
rank is over the device or the replay finds a deadlock or a mismatched collective; 2: bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balanced_loader.materialize import Microbatch, num_valid_tokens
from balanced_loader.plan import StepPlan
from balanced_loader.presets import RESERVE
from parallel_runtime.diagnostics.estimate_report import format_table, rank_memory, role_report
from parallel_runtime.diagnostics.fake_world import CommTrace, FakeRank
from parallel_runtime.diagnostics.replay import ReplayResult, replay
from parallel_runtime.engines.pipeline import FORWARD, schedule_1f1b
from parallel_runtime.topology import PoolShape, Topology

GIB = 2**30


# ---- the plan, per rank ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Place:
    """What one rank does in one step."""

    pool: int
    tp: int
    pp: int
    stage: int
    tp_index: int
    tokens: dict[int, int]  # microbatch -> this lane's tokens in it
    degrees: frozenset[int]  # CP degrees of its groups
    in_flight: int  # the most tokens whose activations it holds at once (1F1B)


def in_flight_tokens(tokens: dict[int, int], m: int, pp: int, stage: int, barriers: Sequence[int] = ()) -> int:
    """The most tokens of forwarded, not yet backwarded microbatches at once in ``stage``'s 1F1B order
    (over the pool's ``m`` microbatches, skipping those absent from ``tokens``; each stretch between
    barriers drains)."""
    edges = [0, *barriers, m]
    best = 0
    for lo, hi in zip(edges, edges[1:]):
        held = 0
        for kind, j in schedule_1f1b(hi - lo, pp, stage):
            n = tokens.get(lo + j)
            if n is None:
                continue
            held += n if kind == FORWARD else -n
            best = max(best, held)
    return best


def place_of(plan: StepPlan, topo: Topology, rank: int) -> Place:
    c = topo.coord(rank)
    pool = plan.pools[c.pool]
    work = topo.lane_work(rank, plan)
    tokens: dict[int, int] = {}
    degrees = set()
    for k, w in enumerate(work):
        if w is None:
            continue
        g = w.group
        degrees.add(g.degree)
        tokens[k] = lane_tokens(g.segments, g.degree)
    return Place(pool=c.pool, tp=pool.tp, pp=pool.pp, stage=c.stage, tp_index=c.tp_index, tokens=tokens,
                 degrees=frozenset(degrees), in_flight=in_flight_tokens(tokens, len(pool.microbatches), pool.pp,
                                                                        c.stage, pool.barriers))


def lane_tokens(segments: Sequence[tuple[int, int, int]], degree: int) -> int:
    """Tokens one lane of a group holds: padded segment lengths / degree (the loader's layout)."""
    from balanced_loader.materialize import padded_length

    if degree == 1:
        return sum(int(s[2]) for s in segments)
    return sum(padded_length(int(s[2]), degree) for s in segments) // degree


@dataclass(frozen=True, kw_only=True)
class Role:
    key: tuple  # (tp, pp, stage, tp index 0?, CP degrees)
    ranks: tuple[int, ...]
    rep: int  # the rank that runs (most tokens in flight)
    step: int  # its worst step

    @property
    def name(self) -> str:
        tp, pp, stage, lead, degrees = self.key
        return (f"tp{tp} pp{pp} stage {stage}{' tp0' if lead and tp > 1 else ' tp1+' if tp > 1 else ''} "
                f"CP {','.join(map(str, sorted(degrees))) or '-'}")


def find_roles(places: list[list[Place]]) -> list[Role]:
    """``places[step][rank]`` -> the distinct roles, each with its ranks and its worst (rank, step)."""
    world = len(places[0])
    members: dict[tuple, list[int]] = defaultdict(list)
    for r in range(world):
        ps = [p[r] for p in places]
        first = ps[0]
        degrees = frozenset().union(*(p.degrees for p in ps))
        members[(first.tp, first.pp, first.stage, first.tp_index == 0, degrees)].append(r)
    roles = []
    for key, ranks in sorted(members.items(), key=lambda kv: kv[1][0]):
        rep, step = max(((r, s) for r in ranks for s in range(len(places))),
                        key=lambda rs: (places[rs[1]][rs[0]].in_flight, -rs[0]))
        roles.append(Role(key=key, ranks=tuple(ranks), rep=rep, step=step))
    return roles


# ---- the optimizer, with every rank's slices known ------------------------------------------------------


def stage_names(cfg, pp: int, stage: int, cache: dict) -> list[str]:
    """Parameter names of a stage model, in its order (what its ``local_params`` lists)."""
    key = (pp, stage)
    if key not in cache:
        from parallel_runtime.engines.pipeline import stage_layers
        from parallel_runtime.model import Transformer

        m = Transformer(cfg, layers=stage_layers(cfg.num_layers, pp, stage), first_stage=stage == 0,
                        last_stage=stage == pp - 1, device="meta", seed=None)
        cache[key] = [n for n, _ in m.named_parameters()]
    return cache[key]


def world_rows(cfg, layout, topo: Topology, plan: StepPlan, *, push: bool, cache: dict) -> list[np.ndarray]:
    """Every rank's exchange description (what its ``ShardExchange.describe`` gives) for a pull or a push."""
    out = []
    for q in range(topo.world_size):
        c = topo.coord(q)
        pool = topo.pools[c.pool]
        names = stage_names(cfg, pool.pp, c.stage, cache)
        if push:
            ran = any(w is not None for w in topo.lane_work(q, plan))
            if not ran:
                names = []
            names = [n for n in names if layout.specs[layout.index[n]].tp_dim is not None or c.tp_index == 0]
        out.append(np.array([(layout.index[n], c.tp_index, pool.tp) for n in names], dtype=np.int64).reshape(-1, 3))
    return out


def _known_world_exchange():
    """A :class:`ShardExchange` whose planning issues its collectives (for the trace) but takes every rank's
    description from the plan (the fake process group moves nothing)."""
    import hashlib

    import torch
    import torch.distributed as dist

    from parallel_runtime.training.exchange import world_load
    from parallel_runtime.training.transport import ShardExchange

    loads: dict[tuple, np.ndarray] = {}  # shared by every rank of an estimate (same world, same layout)

    class KnownWorld(ShardExchange):
        expected: list[list[np.ndarray]]
        tracker: Any = None
        copy_slices = False  # fake tensors: the copies move nothing (the buffers and collectives stay)

        def plan_for(self, rows: np.ndarray) -> Any:
            self._every = self.expected.pop(0)
            if not np.array_equal(self._every[self.rank], rows):
                raise AssertionError(f"rank {self.rank}: the estimate's description of its slices is not the "
                                     f"runtime's ({len(self._every[self.rank])} vs {len(rows)} rows)")
            return super().plan_for(rows)

        def _gather_key(self, fp: int, n: int) -> tuple[int, ...]:
            meta = torch.zeros(2, dtype=torch.int64)
            dist.all_gather([torch.empty_like(meta) for _ in range(self.layout.world_size)], meta, group=self.group)
            return tuple(v for rows in self._every for v in (_fp(rows), len(rows)))

        def _gather_rows(self, rows: np.ndarray, key: tuple[int, ...]) -> list[np.ndarray]:
            mine = torch.zeros((max(key[1::2]), 3), dtype=torch.int64)
            dist.all_gather([torch.empty_like(mine) for _ in range(self.layout.world_size)], mine, group=self.group)
            return self._every

        def _reduce_max(self, load: np.ndarray) -> np.ndarray:
            dist.all_reduce(torch.zeros(len(load), dtype=torch.int64), op=dist.ReduceOp.MAX, group=self.group)
            key = (self.bucket_elems, *(_fp(rows) for rows in self._every))
            if key not in loads:
                loads[key] = world_load(self.layout, self._every, self.bucket_elems)
            return loads[key]

        def _buffer(self, slot: int, n: int):
            if self.tracker is None:
                return super()._buffer(slot, n)
            with self.tracker.kind("buckets"):
                return super()._buffer(slot, n)

    def _fp(rows: np.ndarray) -> int:
        return int.from_bytes(hashlib.blake2b(rows.tobytes(), digest_size=8).digest(), "little", signed=True)

    return KnownWorld


# ---- one rank's steps on fake tensors ----------------------------------------------------------------------


@dataclass(kw_only=True)
class StepFigures:
    """One measured step of a rank."""

    peak: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # bytes by kind at the peak
    kind_peaks: dict[str, int] = field(default_factory=dict)
    host_reads: dict[str, int] = field(default_factory=dict)  # phase -> device values read on the host
    syncs: int = 0  # device synchronizes
    ops: list = field(default_factory=list)  # the step's communication ops


@dataclass(kw_only=True)
class RankRun:
    rank: int
    trace: CommTrace
    steps: list[StepFigures]
    cpu_s: float


class Context:
    """What every rank's run of one estimate shares: the recipe, its plans, their topologies and microbatches."""

    def __init__(self, recipe, plans: list[StepPlan], microbatches, lengths) -> None:
        self.recipe, self.plans = recipe, plans
        self.topos = [Topology(world_size=p.world_size, pools=tuple(PoolShape.of(x) for x in p.pools)) for p in plans]
        self.microbatches = microbatches  # (step, rank) -> list[Microbatch]
        self.lengths = lengths  # step -> the sequences the plan tiles (BatchItems, or lengths by doc_id)
        self.names: dict = {}
        self.exchange_class = _known_world_exchange()


def run_rank(ctx: Context, rank: int, steps: Sequence[int], *, recipe=None, flash: bool = True) -> RankRun:
    """``rank``'s real steps ``steps`` (plan indices) on fake tensors; the recipe may be a cut one (replay)."""
    import torch
    import torch.distributed as dist

    from parallel_runtime.groups import GroupCache, declared_groups
    from parallel_runtime.training.optimizer import FlatLayout, ShardedOptimizer
    from parallel_runtime.training.overlap import BUCKET_ELEMS, Overlap, overlap_wanted
    from parallel_runtime.training.params import param_specs
    from parallel_runtime.training.plan_check import check_plan_runs_here
    from parallel_runtime.training.rank_step import execute_step
    from parallel_runtime.training.runtime import DTYPES, Runtime
    from parallel_runtime.training.trainer import declared_topologies
    from parallel_runtime.training.transport import bucket_limit, exchange_group

    recipe = recipe or ctx.recipe
    w, t = recipe.world, recipe.train
    world = w.size
    specs = param_specs(recipe.model)
    layout = FlatLayout(specs, world)
    cpu = torch.device("cpu")
    c0 = time.process_time()
    figures: list[StepFigures] = []
    with FakeRank(rank, world, flash=flash) as fr:
        tracker, trace = fr.tracker, fr.trace
        trace.phase = "setup"
        groups = GroupCache(rank=rank)
        groups.ensure(declared_groups(declared_topologies(recipe), w.cp_engine, w.cp_inner))
        on = overlap_wanted(t.overlap, gpu=True)  # the GPU run this estimates
        xgroup = exchange_group(world) if on else None
        fr.label(xgroup, "exchange")
        with tracker.kind("optimizer"):
            opt = ShardedOptimizer(layout, ((s.name, torch.empty(s.shape)) for s in specs), recipe.optimizer,
                                   rank=rank, device=cpu, group=xgroup)
        xc = ctx.exchange_class(opt, bucket_elems=bucket_limit(BUCKET_ELEMS, world, gpu=True) if on else None)
        xc.tracker = tracker
        overlap = Overlap(xc) if on else None
        rt = Runtime(recipe.model, rank=rank, device=cpu, dtype=DTYPES[t.dtype], attention=t.attention,
                     groups=groups, specs=specs, layout=layout)
        for s in steps:
            plan, topo = ctx.plans[s], ctx.topos[s]
            fig = StepFigures()
            first_op = len(trace.ops)
            tracker.reset_peak()
            reads0 = tracker.host_reads
            trace.phase = "plan check"
            topo, _ = check_plan_runs_here(plan, recipe=recipe, sequences=ctx.lengths[s], groups=groups,
                                           comm_device=cpu)
            xc.expected = [world_rows(recipe.model, layout, topo, plan, push=push,
                                       cache=ctx.names.setdefault(id(recipe), {})) for push in (False, True)]
            hooks = _Hooks(fr, rt, fig)
            fig.host_reads["plan check"] = tracker.host_reads - reads0
            syncs0 = sum(1 for e in trace.events if e[0] == "sync")
            execute_step(rt, xc, overlap, topo, plan, ctx.microbatches[(s, rank)], num_valid_tokens(plan),
                         step=s, push=True, share_grad=True, recompute=t.recompute, hooks=hooks)
            reads0 = tracker.host_reads
            trace.phase = "optimizer"
            opt.step()
            trace.phase = "step figures"  # the trainer's per-step all-gathers of every rank's figures
            dist.all_gather([torch.zeros(8) for _ in range(world)], torch.zeros(8))
            fig.host_reads["optimizer"] = tracker.host_reads - reads0
            fig.syncs = sum(1 for e in trace.events if e[0] == "sync") - syncs0
            fig.peak, fig.parts, fig.kind_peaks = tracker.peak, dict(tracker.peak_parts), dict(tracker.kind_peaks)
            fig.ops = trace.ops[first_op:]
            figures.append(fig)
    return RankRun(rank=rank, trace=trace, steps=figures, cpu_s=time.process_time() - c0)


class _Hooks:
    """The estimate around a step's pieces: the trace's phase, the memory kinds, the host reads per phase."""

    def __init__(self, fr: FakeRank, rt, fig: StepFigures) -> None:
        self.fr, self.rt, self.fig = fr, rt, fig
        self._reads = 0

    def phase(self, name: str):
        import contextlib

        fr, fig = self.fr, self.fig

        @contextlib.contextmanager
        def ctx():
            fr.trace.phase = name
            reads = fr.tracker.host_reads
            saved = fr.tracker.saved_hooks() if name == "forward_backward" else contextlib.nullcontext()
            with saved:
                yield
            fig.host_reads[name] = fig.host_reads.get(name, 0) + fr.tracker.host_reads - reads

        return ctx()

    def model(self, sm) -> None:
        for lp in sm.params:
            self.fr.tracker.retag(lp.tensor, "parameters")

    def between(self) -> None:
        flat = self.rt.grads._flat
        if flat is not None:
            self.fr.tracker.retag(flat, "gradients")

    def before_push(self, sm) -> None:
        pass


# ---- the whole estimate ------------------------------------------------------------------------------


def plan_steps(recipe, steps: int):
    """The recipe's first ``steps`` plans (the trainer's loader, every rank's plan), the sequences each tiles
    and the loader."""
    from parallel_runtime.training.recipe_setup import open_data, recipe_loader

    source = open_data(recipe, build=True)
    loader = recipe_loader(recipe, source, recipe.policy.name, rank=0, prefetch_steps=0)
    batches = [next(loader) for _ in range(steps)]
    return [b.plan for b in batches], [b.sequences for b in batches], loader


class _Microbatches(dict):
    """(step, rank) -> that rank's microbatches, materialized when first asked for (the replay asks once)."""

    def __init__(self, loader, plans: list[StepPlan], keep: set[tuple[int, int]]) -> None:
        super().__init__()
        self.loader, self.plans, self.keep = loader, plans, keep

    def __missing__(self, key: tuple[int, int]) -> list[Microbatch]:
        mbs = self.loader.microbatches(self.plans[key[0]], key[1])
        if key in self.keep:
            self[key] = mbs
        return mbs


def cut_recipe(recipe, layers_per_stage: int):
    """The recipe with its model cut to ``layers_per_stage`` layers per stage of its deepest pipeline."""
    if layers_per_stage <= 0:
        return recipe
    pp = max(p for _, p in recipe.shapes())
    n = min(recipe.model.num_layers, pp * layers_per_stage)
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, num_layers=n))


def _trace_rank(args: tuple) -> CommTrace:
    ctx, rank, steps, recipe, flash = args
    return run_rank(ctx, rank, steps, recipe=recipe, flash=flash).trace


def replay_traces(ctx: Context, recipe, *, jobs: int = 1, flash: bool = True) -> list[CommTrace]:
    """Every rank's trace of every planned step (``jobs`` processes, forked)."""
    work = [(ctx, r, list(range(len(ctx.plans))), recipe, flash) for r in range(recipe.world.size)]
    if jobs <= 1:
        return [_trace_rank(w) for w in work]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(jobs) as pool:
        return pool.map(_trace_rank, work, chunksize=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime estimate", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--steps", type=int, default=2, help="steps to plan (every one is replayed; default 2)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one device (default 80)")
    ap.add_argument("--out", required=True, help="folder for estimate.json")
    ap.add_argument("--replay-layers", type=int, default=1,
                    help="layers per stage in the replay's traces (0: the whole model; default 1)")
    ap.add_argument("--no-replay", action="store_true", help="memory and bytes only")
    ap.add_argument("--no-flash", action="store_true", help="the GPU has no flash-attention (the fallback kernels)")
    ap.add_argument("--jobs", type=int, default=1, help="processes for the replay's traces (default 1)")
    ap.add_argument("--unpaired-p2p", action="store_true",
                    help="demonstration: the pipeline's old order (separate isend/irecv), which deadlocks on NCCL")
    ap.add_argument("--sync-each-block", action="store_true",
                    help="demonstration: the old CUDA clock (a device synchronize around every compute block)")
    args = ap.parse_args(argv)
    from parallel_runtime.config import load_recipe
    from parallel_runtime.engines import pipeline

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if recipe.model.hf is not None:
            raise ValueError("estimate runs the native decoder; this recipe sets model.hf")
        if args.steps < 1 or not args.device_gib > 0 or not math.isfinite(args.device_gib) or args.jobs < 1 \
                or args.replay_layers < 0:
            raise ValueError("--steps and --jobs must be >= 1, --device-gib a finite number > 0, --replay-layers >= 0")
        from balanced_loader.outputs.files import check_output

        check_output(args.out, inputs=[args.recipe], folder=True, names=["estimate.json"])
    except ValueError as e:
        print(f"parallel_runtime estimate: error: {e}", file=sys.stderr)
        return 2
    saved = pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK
    pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK = args.unpaired_p2p, args.sync_each_block
    try:
        rep = estimate(recipe, steps=args.steps, device_gib=args.device_gib, replay_layers=args.replay_layers,
                       do_replay=not args.no_replay, flash=not args.no_flash, jobs=args.jobs)
    finally:
        pipeline.UNPAIRED, pipeline.SYNC_EACH_BLOCK = saved
    rep["recipe"] = args.recipe
    from balanced_loader.outputs.files import write_json

    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "estimate.json"), rep, indent=1)
    print(format_table(rep), flush=True)
    return 0 if rep["ok"] else 1


def estimate(recipe, *, steps: int, device_gib: float = 80.0, replay_layers: int = 1, do_replay: bool = True,
             flash: bool = True, jobs: int = 1) -> dict[str, Any]:
    """The whole estimate as a JSON-ready dict (see the module docstring); ``ok``: every rank fits and the
    replay (if run) completes."""
    t0 = time.perf_counter()
    plans, sequences, loader = plan_steps(recipe, steps)
    ctx0 = Context(recipe, plans, None, sequences)
    places = [[place_of(p, t, r) for r in range(recipe.world.size)] for p, t in zip(plans, ctx0.topos)]
    roles = find_roles(places)
    ctx0.microbatches = _Microbatches(loader, plans, {(ro.step, ro.rep) for ro in roles})
    reports = []
    for ro in roles:
        run = run_rank(ctx0, ro.rep, [ro.step, ro.step], flash=flash)
        reports.append(role_report(ctx0, ro, run, places))
    result: dict[str, Any] = {"steps": steps, "world_size": recipe.world.size, "device_gib": device_gib,
                              "reserve": dataclasses.asdict(RESERVE), "roles": reports}
    comms: dict[int, int] = {}
    if do_replay:
        cut = cut_recipe(recipe, replay_layers)
        traces = replay_traces(ctx0, cut, jobs=jobs, flash=flash)
        res: ReplayResult = replay(traces)
        comms = res.communicators
        result["replay"] = {"ok": res.ok, "ops": res.ops, "completed": res.completed, "deadlock": list(res.deadlock),
                            "mismatched": list(res.mismatched), "layers": cut.model.num_layers,
                            "summary": res.summary()}
    result["ranks"] = rank_memory(reports, places, comms, device_gib)
    result["over"] = [r["rank"] for r in result["ranks"] if not r["fits"]]
    result["ok"] = not result["over"] and (not do_replay or result["replay"]["ok"])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
