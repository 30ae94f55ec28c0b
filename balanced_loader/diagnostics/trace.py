"""Traces of a plan or of a measured run in the Chrome / Perfetto trace-event format.

A trace is trace-event JSON in its object form, which https://ui.perfetto.dev and chrome://tracing open:
``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"format": "balanced-loader/trace", ...}}``.
A plan (:func:`plan_trace`: the contract-2 schedule of :mod:`balanced_loader.simulate`) and a measured run
(:func:`write_trace` over the :class:`TraceRecord` s a runtime took) both go through
:func:`trace_events`, so the two have the same tracks, slice names and args and open side by side.

Layout of the file:

* process 0 ``steps``: a track ``steps`` with one slice per step (its span over all records of the step;
  args: the step's figures), and a track ``pool p`` per pool with one slice per step (the pool's span)
  and an instant at each pool barrier (records with ``rank = -1``);
* one process per ``(pool, stage)`` when every rank keeps its pool and stage over the traced steps
  (``pool 0 (tp1 pp2) stage 1``), else one process ``ranks``; in it one track per rank (``tid`` = rank,
  named ``rank r``, sorted by rank);
* on a rank's track, one complete slice (``"ph": "X"``) per record: ``compute`` (one group's share of
  one microbatch on this rank, named ``mb<k> d<degree>``; args: step, microbatch, group, degree, lanes,
  ranks, docs as ``{"doc_id", "start", "length"}``, tokens, pool, stage, tp, pp, ms), ``wait`` (e.g. a
  barrier wait), ``pull``, ``push``, ``optimizer``, ...; a record shorter than a nanosecond is an
  instant (``"ph": "i"``, thread scope);
* with ``flows=True``, a flow (``"ph": "s"`` then ``"f"``) from a group's slice at stage ``s`` to the
  same group at stage ``s + 1`` on the group's first rank: the pipeline, drawn as arrows.

``ts`` and ``dur`` are microseconds from the earliest record (or ``t0_s``), rounded to the nanosecond,
with ``dur = round(end) - round(start)`` so slices that touch on a track never overlap.

The plan's schedule (contract 2): on each lane the groups that include it run in microbatch order, a
group starting when its last lane is free (:func:`balanced_loader.simulate.group_schedule`) and holding
its lanes for ``time(g) / pp``; stage ``s`` of a pool runs stage 0's schedule ``s * max_g time(g) / pp``
later (the pipeline fill and drain the contract charges), so the last stage ends at the pool's
makespan, and the steps are laid end to end (each starts at the previous step's ``step_ms``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from balanced_loader.cost import CostModel
from balanced_loader.outputs.files import read_json
from balanced_loader.plan import Segment, StepPlan

TRACE_FORMAT = "balanced-loader/trace"
TRACE_VERSION = 1
RANKS_PROCESS = "ranks"  # the one process of all rank tracks when pools or stages change between steps


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRecord:
    """One timed piece of work (or wait) on one rank: a slice of a trace.

    ``start_s`` / ``end_s`` are seconds on one clock that every rank of the trace shares (e.g.
    ``time.time()`` on one host, or ``time.perf_counter()`` offsets aligned at a barrier); the trace
    starts at the earliest record. Fields that do not apply keep their defaults and are left out of
    the slice's args.
    """

    rank: int  # global rank; -1 puts the record on its pool's summary track (e.g. a barrier instant)
    step: int  # optimizer step
    start_s: float  # seconds
    end_s: float  # seconds, >= start_s; under a nanosecond later makes an instant event
    kind: str = "compute"  # "compute" | "wait" | "pull" | "push" | "optimizer" | "barrier" | any other word
    microbatch: int = -1  # microbatch index in the pool (-1: not a microbatch's work)
    group: int = -1  # group index inside the microbatch (-1: unknown)
    pool: int = -1  # pool index in the step's plan (-1: unknown)
    stage: int = -1  # pipeline stage of this rank in its pool (-1: unknown)
    tp: int = 0  # the pool's shape (0: unknown)
    pp: int = 0
    lanes: tuple[int, ...] = ()  # [degree] the group's lanes in its pool
    ranks: tuple[int, ...] = ()  # the group's ranks at this stage (every tp rank of its lanes)
    degree: int = 0  # CP/SP degree; 0: len(lanes)
    segments: tuple[Segment, ...] = ()  # [num_segments] (doc_id, start, length) of the group
    name: str = ""  # slice name; default "mb<k> d<degree>" for a microbatch's compute, else kind
    args: Mapping[str, Any] | None = None  # more JSON-able args of the slice (e.g. predicted vs measured ms)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and math.isfinite(self.end_s)) or self.end_s < self.start_s:
            raise ValueError(f"trace record of rank {self.rank}, step {self.step}: times must be finite with "
                             f"end_s >= start_s, got {self.start_s!r} .. {self.end_s!r}")
        if self.rank < -1 or (self.rank == -1 and self.pool < 0):
            raise ValueError(f"trace record of step {self.step}: rank must be >= 0 (or -1 with a pool), "
                             f"got rank {self.rank}, pool {self.pool}")
        if not self.kind:
            raise ValueError(f"trace record of rank {self.rank}, step {self.step}: kind must not be empty")

    @property
    def label(self) -> str:
        """The slice name."""
        if self.name:
            return self.name
        if self.kind == "compute" and self.microbatch >= 0:
            return f"mb{self.microbatch} d{self.degree or len(self.lanes) or 1}"
        return self.kind

    def slice_args(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "kind": self.kind}
        for key in ("microbatch", "group", "pool", "stage"):
            if getattr(self, key) >= 0:
                d[key] = getattr(self, key)
        if self.tp:
            d["tp"], d["pp"] = self.tp, self.pp
        if self.lanes or self.degree:
            d["degree"] = self.degree or len(self.lanes)
        if self.lanes:
            d["lanes"] = list(self.lanes)
        if self.ranks:
            d["ranks"] = list(self.ranks)
        if self.segments:
            d["tokens"] = sum(s[2] for s in self.segments)
            d["docs"] = [{"doc_id": a, "start": b, "length": c} for a, b, c in self.segments]
        d["ms"] = round((self.end_s - self.start_s) * 1e3, 6)
        if self.args:
            d.update(self.args)
        return d


def pool_process_name(pool: int, stage: int, tp: int, pp: int) -> str:
    """The process (track group) of the ranks of one pool stage (``tp = 0``: shape unknown)."""
    return f"pool {pool}" + (f" (tp{tp} pp{pp})" if tp else "") + (f" stage {stage}" if pp > 1 or stage > 0 else "")


def rank_processes(keys: Mapping[int, set[tuple[int, int, int, int]]]) -> dict[int, str]:
    """rank -> process name from each rank's ``{(pool, stage, tp, pp)}`` over the traced steps: one
    process per pool stage when every rank has one key, else every rank in :data:`RANKS_PROCESS`."""
    if any(len(v) != 1 for v in keys.values()):
        return {r: RANKS_PROCESS for r in keys}
    return {r: pool_process_name(*next(iter(v))) for r, v in keys.items()}


def _us(seconds: float, t0: float) -> float:
    return round((seconds - t0) * 1e6, 3)


def _dur_us(a: float, b: float, t0: float) -> float:
    """The ``dur`` of a slice from ``a`` to ``b`` (seconds): rounded end minus rounded start."""
    return round(_us(b, t0) - _us(a, t0), 3)


def _meta(kind: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {key: value}}


def _span(name: str, cat: str, pid: int, tid: int, t0: float, a: float, b: float,
          args: Mapping[str, Any]) -> dict[str, Any]:
    ts, dur = _us(a, t0), _dur_us(a, b, t0)
    if dur <= 0:  # under a nanosecond: an instant
        return {"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "args": dict(args)}
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": dict(args)}


def trace_events(records: Iterable[TraceRecord], *, world_size: int | None = None,
                 processes: Mapping[int, str] | None = None, step_args: Mapping[int, Mapping[str, Any]] | None = None,
                 pool_args: Mapping[tuple[int, int], Mapping[str, Any]] | None = None, flows: bool = False,
                 t0_s: float | None = None) -> list[dict[str, Any]]:
    """The trace events of ``records`` (layout in the module docstring).

    ``world_size``: ranks ``0 .. world_size - 1`` get a track even without records (an idle rank);
    ``processes``: rank -> process name (default :func:`rank_processes` of the records' pools and stages);
    ``step_args`` / ``pool_args``: args of the step slices (by step) and pool slices (by ``(step, pool)``).
    """
    recs = list(records)
    on_ranks = [r for r in recs if r.rank >= 0]
    ranks = sorted({r.rank for r in on_ranks} | set(range(world_size or 0)))
    if processes is None:
        keys: dict[int, set[tuple[int, int, int, int]]] = {r: set() for r in ranks}
        for r in on_ranks:
            if r.pool >= 0:
                keys[r.rank].add((r.pool, max(r.stage, 0), r.tp, r.pp))
        processes = rank_processes({r: k for r, k in keys.items() if k}) if any(keys.values()) else {}
    t0 = min((r.start_s for r in recs), default=0.0) if t0_s is None else float(t0_s)
    summary_tid = ranks[-1] + 1 if ranks else 0  # tids are unique over the file: ranks, then summary tracks

    names = [processes.get(r, RANKS_PROCESS) for r in ranks]
    first_rank: dict[str, int] = {}
    for r, n in zip(ranks, names):
        first_rank.setdefault(n, r)
    pid_of = {n: 1 + i for i, n in enumerate(sorted(first_rank, key=first_rank.__getitem__))}  # by first rank
    rank_pid = {r: pid_of[n] for r, n in zip(ranks, names)}
    pools = sorted({r.pool for r in recs if r.pool >= 0})
    pool_tid = {p: summary_tid + 1 + i for i, p in enumerate(pools)}

    ev: list[dict[str, Any]] = [_meta("process_name", 0, 0, "steps"), _meta("process_sort_index", 0, 0, 0),
                                _meta("thread_name", 0, summary_tid, "steps"),
                                _meta("thread_sort_index", 0, summary_tid, 0)]
    for p, tid in pool_tid.items():
        ev += [_meta("thread_name", 0, tid, f"pool {p}"), _meta("thread_sort_index", 0, tid, 1 + p)]
    for n, pid in pid_of.items():
        ev += [_meta("process_name", pid, 0, n), _meta("process_sort_index", pid, 0, pid)]
    for r in ranks:
        ev += [_meta("thread_name", rank_pid[r], r, f"rank {r}"), _meta("thread_sort_index", rank_pid[r], r, r)]

    # summary slices: each step's and each pool's span over its records
    step_span: dict[int, list[float]] = {}
    pool_span: dict[tuple[int, int], list[float]] = {}
    pool_shape: dict[tuple[int, int], tuple[int, int]] = {}
    for r in recs:
        for d, key in ((step_span, r.step), (pool_span, (r.step, r.pool))):
            if d is pool_span and r.pool < 0:
                continue
            span = d.setdefault(key, [r.start_s, r.end_s])
            span[0], span[1] = min(span[0], r.start_s), max(span[1], r.end_s)
        if r.pool >= 0 and r.tp:
            pool_shape[(r.step, r.pool)] = (r.tp, r.pp)
    for s, (a, b) in sorted(step_span.items()):
        ev.append(_span(f"step {s}", "step", 0, summary_tid, t0, a, b, {"step": s, **(step_args or {}).get(s, {})}))
    for (s, p), (a, b) in sorted(pool_span.items()):
        shape = pool_shape.get((s, p))
        name = f"pool {p}" + (f" tp{shape[0]} pp{shape[1]}" if shape else "")
        ev.append(_span(name, "pool", 0, pool_tid[p], t0, a, b,
                        {"step": s, "pool": p, **(pool_args or {}).get((s, p), {})}))

    for r in recs:
        pid, tid = (rank_pid[r.rank], r.rank) if r.rank >= 0 else (0, pool_tid[r.pool])
        ev.append(_span(r.label, r.kind, pid, tid, t0, r.start_s, r.end_s, r.slice_args()))
    if flows:
        ev += _flows(on_ranks, rank_pid, t0)
    return ev


def _flows(recs: Sequence[TraceRecord], rank_pid: Mapping[int, int], t0: float) -> list[dict[str, Any]]:
    """Arrows from each group's slice at stage ``s`` to its slice at stage ``s + 1`` (first rank of each)."""
    first: dict[tuple[int, int, int, int], dict[int, TraceRecord]] = defaultdict(dict)
    for r in recs:
        if (r.kind == "compute" and min(r.microbatch, r.group, r.pool, r.stage) >= 0
                and _dur_us(r.start_s, r.end_s, t0) > 0):  # an instant binds no flow
            at = first[(r.step, r.pool, r.microbatch, r.group)]
            if r.stage not in at or r.rank < at[r.stage].rank:
                at[r.stage] = r
    out: list[dict[str, Any]] = []
    fid = 0
    for by_stage in first.values():
        for s in sorted(by_stage):
            if s + 1 not in by_stage:
                continue
            a, b = by_stage[s], by_stage[s + 1]
            fid += 1
            # each end sits in the middle of its slice, so the viewer binds it to that slice
            for ph, rec in (("s", a), ("f", b)):
                e = {"ph": ph, "id": fid, "name": "pipeline", "cat": "pipeline", "pid": rank_pid[rec.rank],
                     "tid": rec.rank, "ts": _us((rec.start_s + rec.end_s) / 2, t0)}
                if ph == "f":
                    e["bp"] = "e"
                out.append(e)
    return out


def trace_json(events: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """The file's object: events, the display unit, and ``meta`` (source, policy, cost, ...) as ``otherData``."""
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": TRACE_FORMAT, "version": TRACE_VERSION, **meta}}


def save_trace(path: str, trace: Mapping[str, Any]) -> str:
    """Write a trace file's object at ``path``, complete or not at all."""
    from balanced_loader.outputs.files import write_text

    write_text(path, json.dumps(trace, separators=(",", ":"), allow_nan=False) + "\n")  # one write: fast
    return path


def write_trace(path: str, records: Iterable[TraceRecord], *, meta: Mapping[str, Any] | None = None,
                **options: Any) -> str:
    """Write ``records`` as a trace file at ``path`` (complete or not at all); ``options`` are
    :func:`trace_events`'s (``world_size``, ``processes``, ``step_args``, ``pool_args``, ``flows``, ``t0_s``)."""
    return save_trace(path, trace_json(trace_events(records, **options), **dict(meta or {})))


def read_trace(path: str) -> dict[str, Any]:
    """A trace file's object; one ``ValueError`` line unless it is trace-event JSON of this format's shape."""
    data = read_json(path, "trace file")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"trace file {path} has no traceEvents list (expected trace-event JSON)")
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not {"ph", "name", "pid", "tid"} <= e.keys() or (
                e["ph"] != "M" and not isinstance(e.get("ts"), (int, float))):
            raise ValueError(f"trace file {path}: event {i} is not a trace event (needs ph, name, pid, tid, ts)")
    return data if isinstance(data, dict) else {"traceEvents": events}


# ---------------------------------------------------------------------------------------------
# The plan side: contract-2 schedule as records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRun:
    """A plan's modeled run: :func:`trace_events`'s inputs."""

    records: tuple[TraceRecord, ...]
    world_size: int
    processes: dict[int, str]  # rank -> process name
    step_args: dict[int, dict[str, Any]]  # step -> simulate's figures of the step
    pool_args: dict[tuple[int, int], dict[str, Any]]  # (step, pool) -> simulate's figures of the pool


def plan_run(steps: Sequence[StepPlan], cost: CostModel) -> PlannedRun:
    """The contract-2 schedule of ``steps`` (laid end to end) as trace records, in seconds from 0."""
    import numpy as np

    from balanced_loader.simulate import PoolArrays, group_schedule, simulate_step

    recs: list[TraceRecord] = []
    keys: dict[int, set[tuple[int, int, int, int]]] = defaultdict(set)
    step_args: dict[int, dict[str, Any]] = {}
    pool_args: dict[tuple[int, int], dict[str, Any]] = {}
    world = max((sp.world_size for sp in steps), default=0)
    offset = 0.0  # ms: where this step starts
    for sp in steps:
        m = simulate_step(sp, cost)
        step_args[sp.step] = {**m.to_json(pools=False), "predicted_ms": sp.predicted_ms}
        for pi, (pool, pm) in enumerate(zip(sp.pools, m.pools)):
            for s, stage_ranks in enumerate(pool.ranks):
                for r in stage_ranks:
                    keys[r].add((pi, s, pool.tp, pool.pp))
            arr = PoolArrays.from_pool(pool)
            if len(arr.degree) == 0:
                continue
            pool_args[(sp.step, pi)] = pm.to_json()
            pp = pool.pp
            # [G] group times, the one input of the schedule (by each group's slowest lane on a cluster cost)
            gms = arr.times(cost, pool.tp, pp, np.asarray(pool.ranks, dtype=np.int64), sp.world_size)
            start, arrive, release = group_schedule(arr.lane_ptr, arr.lanes, gms, pp, pool.num_lanes,
                                                    arr.barrier_g)  # [G], [B][lanes], [B]
            shift = float(gms.max()) / pp  # stage s runs stage 0's schedule s * shift later (fill and drain)
            base = dict(step=sp.step, pool=pi, tp=pool.tp, pp=pp)
            g = 0
            for k, mb in enumerate(pool.microbatches):
                for gi, grp in enumerate(mb):
                    a, b = float(start[g]), float(start[g]) + float(gms[g]) / pp
                    for s in range(pp):
                        granks = tuple(x for lane in grp.lanes for x in pool.lane_ranks(lane, s))
                        t_a, t_b = (offset + a + s * shift) / 1e3, (offset + b + s * shift) / 1e3
                        recs += [TraceRecord(rank=x, start_s=t_a, end_s=t_b, microbatch=k, group=gi, stage=s,
                                             lanes=grp.lanes, ranks=granks, segments=grp.segments, **base)
                                 for x in granks]
                    g += 1
            for i, k in enumerate(pool.barriers):
                top = float(release[i])
                waits = np.round(top - arrive[i], 6).tolist()  # [lanes] ms each lane waits
                recs += [TraceRecord(rank=-1, start_s=(offset + top + s * shift) / 1e3,
                                     end_s=(offset + top + s * shift) / 1e3, kind="barrier", stage=s,
                                     name=f"barrier before mb{k}" + (f", stage {s}" if pp > 1 else ""),
                                     microbatch=k, args={"waits_ms": waits}, **base) for s in range(pp)]
                for lane in np.flatnonzero(arrive[i] < top - 1e-6):  # waits of a nanosecond or more
                    for s in range(pp):
                        t_a = (offset + float(arrive[i, lane]) + s * shift) / 1e3
                        recs += [TraceRecord(rank=x, start_s=t_a, end_s=(offset + top + s * shift) / 1e3,
                                             kind="wait", name="barrier wait", stage=s, microbatch=k,
                                             args={"barrier_before_microbatch": k}, **base)
                                 for x in pool.lane_ranks(int(lane), s)]
        offset += m.step_ms
    return PlannedRun(records=tuple(recs), world_size=world, processes=rank_processes(keys),
                      step_args=step_args, pool_args=pool_args)


def plan_trace(steps: Sequence[StepPlan], cost: CostModel, *, flows: bool = True,
               meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace file's object of a plan's modeled run (``meta``: policy, cost name, ... into ``otherData``)."""
    run = plan_run(steps, cost)
    events = trace_events(run.records, world_size=run.world_size, processes=run.processes,
                          step_args=run.step_args, pool_args=run.pool_args, flows=flows, t0_s=0.0)
    return trace_json(events, source="plan", world_size=run.world_size, **dict(meta or {}))
