"""Simulate a plan under the contract-2 cost model: step time, bubbles, skew, throughput, MFU.

Definitions (all times in ms, one step, ``W`` = world size, ``T`` = step time):

* **group time** ``t(g)``: contract 2, ``microbatch_ms + sum_s ((q*s^2 + l*s)/d + [d>1]*comm(s, d))``.
* **lane busy time** ``b(l)``: the sum of ``t(g) / pp`` over the groups that include lane ``l``.
  Every rank of a lane (its ``tp`` ranks at each of the ``pp`` stages) is busy for ``b(l)``.
* **lane finish**: the contract-2 execution order (a group starts when all its lanes are free; at a
  pool barrier ``k``, before microbatch ``k`` every lane of the pool waits for the last of them).
* **barrier wait** ``w(l)``: the time lane ``l`` spends waiting at its pool's barriers (contract 1's
  ``barriers``); **barrier_idle** = ``sum_r w(r) / (W * T)``, a part of ``pp_bubble`` and ``idle``.
* **pool makespan** ``M(p)`` = :func:`pool_ms`: last lane finish plus pipeline fill
  and drain ``(pp - 1) * max_g t(g) / pp``. **Step time** ``T = max_p M(p)`` = :func:`step_ms`.
* **pp_bubble of a pool** = ``1 - sum_{ranks r of p} busy(r) / (N(p) * M(p)) = 1 - mean_l b(l) / M(p)``
  with ``N(p) = lanes * tp * pp`` ranks: the idle share inside the pool, from pipeline fill/drain
  and from lanes of the pool finishing at different times. 0 for a pool with no work.
* **step pp_bubble** = ``sum_p N(p) * pp_bubble(p) / W`` (rank-weighted mean over pools).
* **dp_bubble** = ``1 - sum_p N(p) * M(p) / (W * T)``: the idle share from pools finishing before
  the slowest pool (rank-weighted mean pool makespan over the step makespan).
* **idle** = ``1 - sum_r busy(r) / (W * T)``: every idle rank-millisecond of the step.
* **skew** = ``max_r busy(r) / mean_r busy(r)`` over all ``W`` ranks.
* **tokens/s** = tokens of the step / ``T``.
* **MFU** (with a model shape and hardware): ``(6 * matmul_params * tokens + 6 * layers * heads *
  head_dim * sum_s s^2) / (T * W * peak)``; the second term is causal attention (half the square)
  forward and backward. ``matmul_params`` excludes the input-embedding lookup.

An empty step (no groups) has ``T = 0``, bubbles 0 and skew 1.

This module is the one implementation of contract-2 timing: the per-segment formula is
``ShapeCost.segment_ms`` (:mod:`balanced_loader.cost`); everything that schedules groups on
lanes is here: :func:`lane_finish_ms`, :func:`pool_ms`, :func:`step_ms`, :func:`placed_pool_ms`
(groups not yet in a :class:`~balanced_loader.plan.Pool`), :func:`serial_pool_ms` (its closed form
when each microbatch is one group on all lanes) and :func:`solo_stage_ms` (one doc alone on a lane).
The lane recurrence is a numba kernel (:func:`lane_schedule`) with a pure-Python reference
(:func:`lane_schedule_py`), and :func:`group_schedule` (reference :func:`group_schedule_py`) gives each
group's start for traces; group times are vectorised over segments. They run 100 steps of a
2,048-rank plan in well under a second after the plan is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit

from balanced_loader.cost import CostModel, LaneProfile, ShapeCost
from balanced_loader.plan import Plan, Pool, StepPlan, segment_lengths

if TYPE_CHECKING:
    from balanced_loader.presets import Hardware, ModelShape


# ---------------------------------------------------------------------------------------------
# Contract-2 timing: the lane schedule
# ---------------------------------------------------------------------------------------------


NO_BARRIERS = np.zeros(0, dtype=np.int64)  # [0] int64: a pool without barriers
NO_BARRIERS.flags.writeable = False


@njit(cache=True)
def lane_schedule(lane_ptr: np.ndarray, lanes: np.ndarray, group_ms: np.ndarray, pp: int,
                  num_lanes: int, barrier_g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contract-2 execution of one pool's groups in order.

    ``lane_ptr`` ``[G + 1]`` offsets into ``lanes`` ``[sum of degrees]``; ``group_ms`` ``[G]``;
    ``barrier_g`` ``[B]`` sorted group indices: before group ``barrier_g[i]`` every lane waits for
    the last one (a pool barrier; ``G`` means after the last group).
    Returns ``(finish [num_lanes], busy [num_lanes], barrier wait [num_lanes])`` in ms (one stage's share).
    """
    finish = np.zeros(num_lanes, dtype=np.float64)
    busy = np.zeros(num_lanes, dtype=np.float64)
    wait = np.zeros(num_lanes, dtype=np.float64)
    nb = barrier_g.shape[0]
    bi = 0
    for g in range(group_ms.shape[0] + 1):
        while bi < nb and barrier_g[bi] <= g:
            # a barrier: every lane of the pool starts its next group when the last lane is free
            top = finish.max()
            for x in range(num_lanes):
                wait[x] += top - finish[x]
                finish[x] = top
            bi += 1
        if g == group_ms.shape[0]:
            break
        a = lane_ptr[g]
        b = lane_ptr[g + 1]
        # a group starts once the last of its lanes is free, then holds all of them for one stage's share
        start = 0.0
        for j in range(a, b):
            if finish[lanes[j]] > start:
                start = finish[lanes[j]]
        t = group_ms[g] / pp
        for j in range(a, b):
            finish[lanes[j]] = start + t
            busy[lanes[j]] += t
    return finish, busy, wait


def lane_schedule_py(lane_ptr: np.ndarray, lanes: np.ndarray, group_ms: np.ndarray, pp: int,
                     num_lanes: int, barrier_g: np.ndarray | Sequence[int] = ()
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pure-Python reference of :func:`lane_schedule`."""
    finish = [0.0] * num_lanes
    busy = [0.0] * num_lanes
    wait = [0.0] * num_lanes
    bars = [int(x) for x in barrier_g]
    ng = len(group_ms)
    for g in range(ng + 1):
        for _ in range(bars.count(g)):  # barrier_g holds values in 0..G
            top = max(finish)
            wait = [w + top - f for w, f in zip(wait, finish)]
            finish = [top] * num_lanes
        if g == ng:
            break
        ls = [int(x) for x in lanes[lane_ptr[g]:lane_ptr[g + 1]]]
        start = max([0.0] + [finish[x] for x in ls])
        t = float(group_ms[g]) / pp
        for x in ls:
            finish[x] = start + t
            busy[x] += t
    return (np.asarray(finish, dtype=np.float64), np.asarray(busy, dtype=np.float64),
            np.asarray(wait, dtype=np.float64))


@njit(cache=True)
def group_schedule(lane_ptr: np.ndarray, lanes: np.ndarray, group_ms: np.ndarray, pp: int,
                   num_lanes: int, barrier_g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The start of every group in :func:`lane_schedule`'s execution order (for traces), same arguments.

    ``group_ms`` ``[G]`` is taken as given (whatever made it: the contract-2 formula, lane speeds, classes).
    Returns ``(start [G], arrive [B][num_lanes], release [B])`` in ms, one stage's share: group ``g``
    holds its lanes from ``start[g]`` to ``start[g] + group_ms[g] / pp``; at barrier ``i`` lane ``x`` is
    free from ``arrive[i, x]`` and waits until ``release[i]`` (the last lane's arrival).
    """
    ng = group_ms.shape[0]
    nb = barrier_g.shape[0]
    start = np.zeros(ng, dtype=np.float64)
    arrive = np.zeros((nb, num_lanes), dtype=np.float64)
    release = np.zeros(nb, dtype=np.float64)
    finish = np.zeros(num_lanes, dtype=np.float64)
    bi = 0
    for g in range(ng + 1):
        while bi < nb and barrier_g[bi] <= g:
            top = finish.max() if num_lanes else 0.0
            for x in range(num_lanes):
                arrive[bi, x] = finish[x]
                finish[x] = top
            release[bi] = top
            bi += 1
        if g == ng:
            break
        t0 = 0.0
        for j in range(lane_ptr[g], lane_ptr[g + 1]):
            t0 = max(t0, finish[lanes[j]])
        start[g] = t0
        for j in range(lane_ptr[g], lane_ptr[g + 1]):
            finish[lanes[j]] = t0 + group_ms[g] / pp
    return start, arrive, release


def group_schedule_py(lane_ptr: np.ndarray, lanes: np.ndarray, group_ms: np.ndarray, pp: int,
                      num_lanes: int, barrier_g: np.ndarray | Sequence[int] = ()
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pure-Python reference of :func:`group_schedule`."""
    finish = [0.0] * num_lanes
    starts: list[float] = []
    arrive: list[list[float]] = []
    release: list[float] = []
    bars = [int(x) for x in barrier_g]
    ng = len(group_ms)
    for g in range(ng + 1):
        for _ in range(bars.count(g)):
            arrive.append(list(finish))
            release.append(max(finish, default=0.0))
            finish = [release[-1]] * num_lanes
        if g == ng:
            break
        ls = [int(x) for x in lanes[lane_ptr[g]:lane_ptr[g + 1]]]
        starts.append(max([0.0] + [finish[x] for x in ls]))
        for x in ls:
            finish[x] = starts[-1] + float(group_ms[g]) / pp
    return (np.asarray(starts, dtype=np.float64), np.asarray(arrive, dtype=np.float64).reshape(len(bars), num_lanes),
            np.asarray(release, dtype=np.float64))


def makespan_ms(finish: np.ndarray, gmax: float, pp: int) -> float:
    """Contract-2 pool time from its lanes' finish times ``[num_lanes]`` and its largest group time:
    the last lane's finish plus pipeline fill and drain ``(pp - 1) * gmax / pp`` (0 without work)."""
    return float(finish.max() + (pp - 1) * gmax / pp) if gmax > 0 else 0.0


def placed_pool_ms(lanes_of: Sequence[Sequence[int]], group_ms: Sequence[float] | np.ndarray, pp: int,
                   num_lanes: int, barrier_groups: Sequence[int] = ()) -> float:
    """Contract-2 time of a pool's groups in execution order: group ``g`` on lanes ``lanes_of[g]``
    taking ``group_ms[g]`` (for planners whose groups are not yet a :class:`Pool`); a barrier before
    each group index of ``barrier_groups`` (sorted)."""
    gms = np.asarray(group_ms, dtype=np.float64)  # [G]
    if gms.size == 0:
        return 0.0
    degree = np.fromiter(map(len, lanes_of), dtype=np.int64, count=len(lanes_of))
    lane_ptr = np.zeros(len(degree) + 1, dtype=np.int64)  # [G + 1]
    np.cumsum(degree, out=lane_ptr[1:])
    lanes = np.fromiter(itertools.chain.from_iterable(lanes_of), dtype=np.int64, count=int(lane_ptr[-1]))
    bars = np.asarray(barrier_groups, dtype=np.int64) if len(barrier_groups) else NO_BARRIERS  # [B]
    finish, _, _ = lane_schedule(lane_ptr, lanes, gms, pp, num_lanes, bars)
    return makespan_ms(finish, float(gms.max()), pp)


def serial_pool_ms(work: np.ndarray, pp: int, fixed_ms: float = 0.0) -> float:
    """Contract-2 time of a pool whose every microbatch is one group on all its lanes, taking
    ``fixed_ms + work[j]`` per stage (``[v]``): the lane schedule in closed form,
    ``sum_j (c + W_j) + (pp - 1) (c + max_j W_j)`` (1F1B's ``(v + pp - 1) t`` when balanced)."""
    if len(work) == 0:
        return 0.0
    return float(len(work) * fixed_ms + work.sum() + (pp - 1) * (fixed_ms + work.max()))


def solo_stage_ms(sc: ShapeCost, lengths: np.ndarray, fixed_ms: float | np.ndarray) -> np.ndarray:
    """``[n]`` one stage's share of each doc run alone on one lane, with ``fixed_ms`` (one value or
    ``[n]``) charged in place of ``microbatch_ms`` (planners that amortise it over packed docs)."""
    ln = np.asarray(lengths, dtype=np.float64)
    return (np.asarray(sc.compute_ms(ln)) + fixed_ms) / sc.pp


# ---------------------------------------------------------------------------------------------
# One pool as flat arrays
# ---------------------------------------------------------------------------------------------


def barrier_groups(microbatches: Sequence[Sequence[Any]], barriers: Sequence[int]) -> np.ndarray:
    """``[B]`` int64: for each barrier ``k`` (before microbatch ``k``), the number of groups in
    microbatches ``0 .. k - 1`` (the index of the first group it holds back)."""
    if not len(barriers):
        return NO_BARRIERS
    sizes = np.fromiter(map(len, microbatches), dtype=np.int64, count=len(microbatches))  # [num_microbatches]
    first = np.concatenate(([0], np.cumsum(sizes)))  # [num_microbatches + 1]
    k = np.asarray(barriers, dtype=np.int64)  # [B]
    if k.size and (k.min() < 0 or k.max() > len(sizes) or np.any(np.diff(k) <= 0)):
        raise ValueError(f"barriers {list(barriers)} must be sorted, unique and within 0..{len(sizes)}")
    return first[k]


def _segment_arrays(segments_of: Sequence[Sequence[Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths [S] float64, segments per group [G])`` of per-group ``(doc, start, length)`` segments."""
    nseg = np.fromiter(map(len, segments_of), dtype=np.int64, count=len(segments_of))
    seg_len = np.fromiter((s[2] for segs in segments_of for s in segs), dtype=np.float64, count=int(nseg.sum()))
    return seg_len, nseg


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolArrays:
    """A pool's groups in execution order, flattened."""

    degree: np.ndarray  # [G] lanes per group
    lane_ptr: np.ndarray  # [G + 1] offsets into lanes
    lanes: np.ndarray  # [sum degree] lane indices
    seg_ptr: np.ndarray  # [G + 1] offsets into seg_len
    seg_len: np.ndarray  # [S] float64 segment lengths (tokens)
    barrier_g: np.ndarray  # [B] group index of each barrier (groups before its microbatch)

    @staticmethod
    def from_pool(pool: Pool) -> PoolArrays:
        groups = [g for mb in pool.microbatches for g in mb]
        # a planner's arrays as they are, when the groups read them in order
        seg_len, nseg = segment_lengths(groups) or _segment_arrays([g.segments for g in groups])
        return PoolArrays._build([g.lanes for g in groups], seg_len, nseg,
                                 barrier_groups(pool.microbatches, pool.barriers))

    @staticmethod
    def from_json(pool: dict[str, Any]) -> PoolArrays:
        """From a pool's plan-JSON mapping, without building dataclasses (the fast path)."""
        mbs = pool["microbatches"]
        groups = [g for mb in mbs for g in mb]
        seg_len, nseg = _segment_arrays([g["segments"] for g in groups])
        return PoolArrays._build([g["lanes"] for g in groups], seg_len, nseg,
                                 barrier_groups(mbs, pool.get("barriers", ())))

    @staticmethod
    def _build(lanes_of: list[Sequence[int]], seg_len: np.ndarray, nseg: np.ndarray,
               barrier_g: np.ndarray = NO_BARRIERS) -> PoolArrays:
        """``seg_len [S]`` segment lengths of the groups end to end, ``nseg [G]`` segments per group."""
        # CSR layout: group g's lanes are lanes[lane_ptr[g]:lane_ptr[g+1]], its segment lengths
        # seg_len[seg_ptr[g]:seg_ptr[g+1]]; fromiter with a count fills each array in one pass
        n = len(lanes_of)
        degree = np.fromiter(map(len, lanes_of), dtype=np.int64, count=n)
        lanes = np.fromiter(itertools.chain.from_iterable(lanes_of), dtype=np.int64, count=int(degree.sum()))
        lane_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(degree, out=lane_ptr[1:])
        seg_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nseg, out=seg_ptr[1:])
        return PoolArrays(degree=degree, lane_ptr=lane_ptr, lanes=lanes, seg_ptr=seg_ptr,
                          seg_len=seg_len.astype(np.float64, copy=False), barrier_g=barrier_g)

    def group_ms(self, sc: ShapeCost) -> np.ndarray:
        """Contract-2 time of every group, ``[G]`` ms (``ShapeCost.segment_ms`` per segment, summed per group)."""
        n = len(self.degree)
        nseg = np.diff(self.seg_ptr)  # [G]
        d = np.repeat(self.degree, nseg).astype(np.float64)  # [S] degree of each segment's group
        seg = sc.segment_ms(self.seg_len, d)  # [S]
        group_of_seg = np.repeat(np.arange(n, dtype=np.int64), nseg)  # [S]
        return sc.microbatch_ms + np.bincount(group_of_seg, weights=seg, minlength=n)

    def lane_group_ms(self, prof: LaneProfile, tp: int, pp: int) -> np.ndarray:
        """``[G]`` contract-2 group times on lanes that are not alike: the largest over each group's lanes
        of its class's formula divided by its speed."""
        classes = np.unique(prof.cls[self.lanes]) if len(self.lanes) else np.zeros(0, np.int64)
        per_class = np.zeros((len(prof.models), len(self.degree)), dtype=np.float64)  # [classes, G]
        for c in classes.tolist():
            per_class[c] = self.group_ms(prof.models[c].shape(tp, pp))
        group_of_lane = np.repeat(np.arange(len(self.degree), dtype=np.int64), self.degree)  # [sum degree]
        on_lane = per_class[prof.cls[self.lanes], group_of_lane] / prof.speed[self.lanes]  # [sum degree]
        return np.maximum.reduceat(on_lane, self.lane_ptr[:-1]) if len(on_lane) else on_lane

    def times(self, cost: CostModel, tp: int, pp: int, ranks: np.ndarray | None, world_size: int) -> np.ndarray:
        """``[G]`` group times of this pool under ``cost`` (lane classes and speeds when it has them;
        ``ranks`` ``[pp][lanes * tp]`` is the pool's rank grid)."""
        if cost.uniform or ranks is None:
            return self.group_ms(cost.shape(tp, pp))
        return self.lane_group_ms(cost.lanes(ranks, tp, world_size), tp, pp)

    def schedule(self, sc: ShapeCost | np.ndarray, pp: int, num_lanes: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(group_ms [G], finish, busy, barrier wait [num_lanes])``: the pool's contract-2 lane schedule
        (``sc``: the shape's coefficients, or the group times ``[G]`` themselves)."""
        gms = self.group_ms(sc) if isinstance(sc, ShapeCost) else np.asarray(sc, dtype=np.float64)
        finish, busy, wait = lane_schedule(self.lane_ptr, self.lanes, gms, pp, num_lanes, self.barrier_g)
        return gms, finish, busy, wait

    def attention_tokens2(self) -> float:
        """Sum of squared segment lengths (for attention FLOPs)."""
        return float(np.dot(self.seg_len, self.seg_len))


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolMetrics:
    tp: int
    pp: int
    num_lanes: int
    num_ranks: int
    makespan_ms: float  # pool_ms
    pp_bubble: float
    lane_busy_ms: np.ndarray  # [num_lanes]
    lane_finish_ms: np.ndarray  # [num_lanes]
    max_group_ms: float
    tokens: int
    lane_barrier_ms: np.ndarray  # [num_lanes] time each lane waits at the pool's barriers
    barriers: int = 0  # number of barriers of the pool

    @property
    def barrier_idle(self) -> float:
        """Share of the pool's rank-time spent waiting at its barriers (part of ``pp_bubble``)."""
        w = self.lane_barrier_ms
        return float(w.mean()) / self.makespan_ms if self.makespan_ms > 0 and w.size else 0.0

    def to_json(self) -> dict[str, Any]:
        busy = self.lane_busy_ms
        mean = float(busy.mean()) if busy.size else 0.0
        d = {"tp": self.tp, "pp": self.pp, "lanes": self.num_lanes, "ranks": self.num_ranks,
             "makespan_ms": self.makespan_ms, "pp_bubble": self.pp_bubble,
             "skew": float(busy.max() / mean) if mean > 0 else 1.0, "tokens": self.tokens}
        if self.barriers:
            d["barriers"] = self.barriers
            d["barrier_idle"] = self.barrier_idle
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    step: int
    world_size: int
    step_ms: float
    pp_bubble: float
    dp_bubble: float
    idle: float
    skew: float
    tokens: int
    tokens_per_s: float
    mfu: float | None
    plan_seconds: float
    rank_busy_ms: np.ndarray  # [world_size]
    pools: tuple[PoolMetrics, ...]
    rank_barrier_ms: np.ndarray  # [world_size] time each rank waits at barriers
    barrier_idle: float = 0.0  # share of all rank-time spent waiting at barriers (part of pp_bubble, idle)
    classes: dict[str, dict[str, float]] = field(default_factory=dict)  # per device class (cluster cost models)

    def to_json(self, *, pools: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step, "step_ms": self.step_ms, "pp_bubble": self.pp_bubble,
            "dp_bubble": self.dp_bubble, "idle": self.idle, "barrier_idle": self.barrier_idle, "skew": self.skew,
            "tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "plan_seconds": self.plan_seconds,
        }
        if self.mfu is not None:
            d["mfu"] = self.mfu
        if self.classes:
            d["classes"] = self.classes
        if pools:
            d["pools"] = [p.to_json() for p in self.pools]
        return d


def _pool_metrics(tp: int, pp: int, ranks: np.ndarray, arr: PoolArrays,
                  cost: CostModel, world_size: int) -> tuple[PoolMetrics, float]:
    """Metrics of one pool (rank grid ``[pp][lanes * tp]``) and its sum of squared segment lengths."""
    cost.shape(tp, pp)  # one line when the shape is not in the cost file
    nl = ranks.shape[1] // tp if ranks.size else 0
    nranks = int(ranks.size)
    if len(arr.degree) == 0:
        z = np.zeros(nl, dtype=np.float64)
        return PoolMetrics(tp=tp, pp=pp, num_lanes=nl, num_ranks=nranks, makespan_ms=0.0, pp_bubble=0.0,
                           lane_busy_ms=z, lane_finish_ms=z.copy(), max_group_ms=0.0, tokens=0,
                           lane_barrier_ms=z.copy(), barriers=len(arr.barrier_g)), 0.0
    if int(arr.lanes.min()) < 0 or int(arr.lanes.max()) >= nl:
        raise ValueError(f"pool tp={tp} pp={pp}: a group uses a lane outside 0..{nl - 1}")
    gms, finish, busy, wait = arr.schedule(arr.times(cost, tp, pp, ranks, world_size), pp, nl)  # [G], [nl] x 3
    gmax = float(gms.max())
    makespan = makespan_ms(finish, gmax, pp)
    ppb = 1.0 - float(busy.mean()) / makespan if makespan > 0 else 0.0
    pm = PoolMetrics(tp=tp, pp=pp, num_lanes=nl, num_ranks=nranks, makespan_ms=makespan, pp_bubble=ppb,
                     lane_busy_ms=busy, lane_finish_ms=finish, max_group_ms=gmax, tokens=int(arr.seg_len.sum()),
                     lane_barrier_ms=wait, barriers=len(arr.barrier_g))
    return pm, arr.attention_tokens2()


def model_flops(model: ModelShape, tokens: float, tokens2: float) -> float:
    """Training FLOPs (fwd + bwd) of ``tokens`` tokens whose segment lengths square-sum to ``tokens2``."""
    return 6.0 * model.matmul_params * tokens + 6.0 * model.layers * model.heads * model.head_dim * tokens2


def _step_metrics(step: int, world_size: int, plan_seconds: float,
                  pools_in: Sequence[tuple[int, int, np.ndarray, PoolArrays]], cost: CostModel,
                  model: ModelShape | None, hardware: Hardware | None) -> StepMetrics:
    w = world_size
    pools: list[PoolMetrics] = []
    rank_busy = np.zeros(w, dtype=np.float64)  # [world_size]
    rank_wait = np.zeros(w, dtype=np.float64)  # [world_size]
    tokens2 = 0.0
    for tp, pp, ranks, arr in pools_in:
        pm, t2 = _pool_metrics(tp, pp, ranks, arr, cost, w)
        pools.append(pm)
        tokens2 += t2
        if pm.num_lanes:
            if int(ranks.min()) < 0 or int(ranks.max()) >= w:
                raise ValueError(f"step {step}: pool tp={tp} pp={pp} has a rank outside 0..{w - 1}")
            # ranks is [pp][lanes * tp]: every tp rank of a lane, at every stage, is busy as long as the lane
            rank_busy[ranks] = np.repeat(pm.lane_busy_ms, tp)[None, :]
            rank_wait[ranks] = np.repeat(pm.lane_barrier_ms, tp)[None, :]
    step_ms = max((p.makespan_ms for p in pools), default=0.0)
    tokens = sum(p.tokens for p in pools)
    if step_ms > 0:
        pp_bubble = sum(p.num_ranks * p.pp_bubble for p in pools) / w
        dp_bubble = 1.0 - sum(p.num_ranks * p.makespan_ms for p in pools) / (w * step_ms)
        idle = 1.0 - float(rank_busy.sum()) / (w * step_ms)
        barrier_idle = float(rank_wait.sum()) / (w * step_ms)
        skew = float(rank_busy.max()) / float(rank_busy.mean())
        tps = tokens / (step_ms / 1e3)
    else:
        pp_bubble = dp_bubble = idle = barrier_idle = 0.0
        skew, tps = 1.0, 0.0
    mfu = None
    if model is not None and hardware is not None and step_ms > 0:
        mfu = model_flops(model, tokens, tokens2) / (step_ms / 1e3 * w * hardware.peak_tflops * 1e12)
    return StepMetrics(step=step, world_size=w, step_ms=step_ms, pp_bubble=pp_bubble, dp_bubble=dp_bubble,
                       idle=idle, skew=skew, tokens=tokens, tokens_per_s=tps, mfu=mfu,
                       plan_seconds=plan_seconds, rank_busy_ms=rank_busy, pools=tuple(pools),
                       rank_barrier_ms=rank_wait, barrier_idle=barrier_idle,
                       classes=class_figures(cost, rank_busy, step_ms) if not cost.uniform else {})


def class_figures(cost: CostModel, rank_busy: np.ndarray, step_ms: float) -> dict[str, dict[str, float]]:
    """Per device class (or ``"all"`` with lane speeds only): its ranks, their mean busy ms, busy share of
    the step (1 - idle) and skew, and the slowest speed among them."""
    w = len(rank_busy)
    names = cost.class_names or ("all",)
    cls, speed = cost.rank_class_index(w), cost.rank_speeds(w)  # [world_size] each
    out = {}
    for c, name in enumerate(names):
        b = rank_busy[cls == c]
        if not b.size:
            continue
        mean = float(b.mean())
        out[name] = {"ranks": int(b.size), "mean_busy_ms": mean,
                     "busy_share": mean / step_ms if step_ms > 0 else 0.0,
                     "skew": float(b.max()) / mean if mean > 0 else 1.0, "min_speed": float(speed[cls == c].min())}
    return out


def _ranks(ranks: Sequence[Sequence[int]]) -> np.ndarray:
    arr = np.asarray(ranks, dtype=np.int64)  # [pp][lanes * tp]
    if arr.ndim != 2:
        raise ValueError("every stage of a pool must list the same number of ranks")
    return arr


def simulate_step(plan: StepPlan, cost: CostModel, *, model: ModelShape | None = None,
                  hardware: Hardware | None = None) -> StepMetrics:
    """Metrics of one step (see the module docstring for the definitions)."""
    pools = [(p.tp, p.pp, _ranks(p.ranks), PoolArrays.from_pool(p)) for p in plan.pools]
    return _step_metrics(plan.step, plan.world_size, plan.plan_seconds, pools, cost, model, hardware)


def simulate_step_json(step: dict[str, Any], world_size: int, cost: CostModel, *,
                       model: ModelShape | None = None, hardware: Hardware | None = None) -> StepMetrics:
    """:func:`simulate_step` straight from one step's plan-JSON mapping (no dataclasses: faster)."""
    try:
        pools = [(int(p["tp"]), int(p["pp"]), _ranks(p["ranks"]), PoolArrays.from_json(p)) for p in step["pools"]]
        return _step_metrics(int(step["step"]), world_size, float(step.get("plan_seconds", 0.0)), pools, cost,
                             model, hardware)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"malformed plan step: {type(e).__name__}: {e}") from None


def lane_finish_ms(pool: Pool, cost: CostModel, world_size: int | None = None) -> tuple[np.ndarray, float]:
    """Per-lane finish times (``[num_lanes]`` ms, one stage's share) and the largest group time
    (``world_size``: the plan's, needed when the cost model has lane classes or speeds)."""
    arr = PoolArrays.from_pool(pool)
    if len(arr.degree) == 0:
        return np.zeros(pool.num_lanes, dtype=np.float64), 0.0
    if not cost.uniform and world_size is None:
        raise ValueError("a cost model with device classes or lane speeds needs the plan's world size")
    ranks = _ranks(pool.ranks) if world_size is not None else None
    gms, finish, _, _ = arr.schedule(arr.times(cost, pool.tp, pool.pp, ranks, world_size or 0), pool.pp,
                                     pool.num_lanes)
    return finish, float(gms.max())


def pool_ms(pool: Pool, cost: CostModel, world_size: int | None = None) -> float:
    """Contract-2 time of a pool: its last lane's finish plus pipeline fill and drain."""
    finish, gmax = lane_finish_ms(pool, cost, world_size)
    return makespan_ms(finish, gmax, pool.pp)


def step_ms(plan: StepPlan, cost: CostModel) -> float:
    """Contract-2 step time: the slowest pool."""
    return max((pool_ms(p, cost, plan.world_size) for p in plan.pools), default=0.0)


def simulate_plan(plan: Plan | Sequence[StepPlan], cost: CostModel, *, model: ModelShape | None = None,
                  hardware: Hardware | None = None) -> list[StepMetrics]:
    steps = plan.steps if isinstance(plan, Plan) else plan
    return [simulate_step(s, cost, model=model, hardware=hardware) for s in steps]


def summarize(metrics: Sequence[StepMetrics]) -> dict[str, float]:
    """Totals and means over steps: time-weighted throughput, arithmetic means of the ratios."""
    if not metrics:
        return {"steps": 0, "total_ms": 0.0, "mean_step_ms": 0.0, "pp_bubble": 0.0, "dp_bubble": 0.0,
                "idle": 0.0, "barrier_idle": 0.0, "skew": 1.0, "tokens_per_s": 0.0, "mean_plan_ms": 0.0}
    total = sum(m.step_ms for m in metrics)
    tokens = sum(m.tokens for m in metrics)
    n = len(metrics)
    out = {
        "steps": n,
        "total_ms": total,
        "mean_step_ms": total / n,
        "pp_bubble": sum(m.pp_bubble for m in metrics) / n,
        "dp_bubble": sum(m.dp_bubble for m in metrics) / n,
        "idle": sum(m.idle for m in metrics) / n,
        "barrier_idle": sum(m.barrier_idle for m in metrics) / n,
        "skew": sum(m.skew for m in metrics) / n,
        "tokens_per_s": tokens / (total / 1e3) if total > 0 else 0.0,
        "mean_plan_ms": 1e3 * sum(m.plan_seconds for m in metrics) / n,
    }
    names = sorted({c for m in metrics for c in m.classes})
    if names:  # per device class: the mean share of the step its ranks were busy, and their mean skew
        out["classes"] = {c: {k: sum(m.classes[c][k] for m in metrics if c in m.classes) /
                              max(1, sum(c in m.classes for m in metrics)) for k in ("busy_share", "skew")}
                          for c in names}
    mfus = [m.mfu for m in metrics if m.mfu is not None]
    if mfus and total > 0:
        # time-weighted: total FLOPs over total time
        out["mfu"] = sum(m.mfu * m.step_ms for m in metrics if m.mfu is not None) / total
    return out
