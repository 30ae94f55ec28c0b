"""Hydraulis's two-stage assignment of a batch's docs to heterogeneous pipelines (papers/hydraulis.md §3).

Times here are one stage's (contract-2 whole-model time / pp), so a pipeline's contract-2
time with microbatches of per-stage work ``W_j`` is ``sum_j (c + W_j) + (pp - 1) (c + max_j W_j)``
with ``c = microbatch_ms / pp``: :func:`balanced_loader.simulate.serial_pool_ms`.

* **Stage 1** (:func:`dispatch`): randomized greedy with restarts. Docs that not every
  pipeline can hold go first, longest first; the rest in a random order (restart 0: longest
  first). Each doc goes to the pipeline, among those holding it, that minimizes the new
  largest ``sum cost + (pp - 1) * largest single cost`` over all pipelines; ties prefer an empty
  pipeline, then the smaller own value, then the lower index. The restart with the smallest
  largest value wins. Orders come from ``numpy.random.default_rng(seed)``: deterministic.
* **Stage 2** (:func:`pack_pipeline`): each pipeline's docs into ``v`` microbatches under its
  token cap. For each ``v`` from ``ceil(tokens / cap)`` (at most 16 values, plus the
  first-fit-decreasing count), longest-time-first greedy, and where it can matter (``pp > 1``
  and the greedy largest microbatch is above its lower bound, or the greedy found no packing)
  the min-max ILP (binary doc-to-microbatch, minimize the largest microbatch cost under the
  token cap; HiGHS with a node limit and a short time limit). The ``v`` with the smallest
  contract-2 time wins; this equals the paper's ``(M_v + c)(pp - 1 + v)`` when microbatches are
  balanced and is exact otherwise. First-fit decreasing is the fallback that always exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from balanced_loader.planning.packing import pack
from balanced_loader.planning.solvers.solver import MilpResult, solve_milp
from balanced_loader.simulate import serial_pool_ms

# ---------------------------------------------------------------------------------------------
# Stage 1
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def dispatch_kernel(cost: np.ndarray, allowed: np.ndarray, ppm1: np.ndarray, orders: np.ndarray
                     ) -> tuple[np.ndarray, float]:
    n, p = cost.shape
    best_assign = np.full(n, -1, dtype=np.int64)
    best_obj = np.inf
    for r in range(orders.shape[0]):
        acc = np.zeros(p)
        mx = np.zeros(p)
        val = np.zeros(p)
        cnt = np.zeros(p, dtype=np.int64)
        assign = np.full(n, -1, dtype=np.int64)
        for t in range(n):
            i = orders[r, t]
            top1 = -1
            top2 = -1
            # the two largest pipeline values: the largest value "elsewhere" is top1's, or top2's for top1 itself
            for q in range(p):
                if top1 < 0 or val[q] > val[top1]:
                    top2 = top1
                    top1 = q
                elif top2 < 0 or val[q] > val[top2]:
                    top2 = q
            pick = -1
            pick_max = np.inf
            pick_own = np.inf
            pick_empty = False
            for q in range(p):
                if not allowed[i, q]:
                    continue
                m = mx[q] if mx[q] > cost[i, q] else cost[i, q]
                own = acc[q] + cost[i, q] + ppm1[q] * m
                other = 0.0
                if q != top1:
                    other = val[top1]
                elif top2 >= 0:
                    other = val[top2]
                new_max = own if own > other else other
                empty = cnt[q] == 0
                tie = new_max <= pick_max + 1e-9
                tie_wins = (empty and not pick_empty) or (empty == pick_empty and own < pick_own - 1e-9)
                if pick < 0 or new_max < pick_max - 1e-9 or (tie and tie_wins):
                    pick = q
                    pick_max = new_max
                    pick_own = own
                    pick_empty = empty
            assign[i] = pick
            acc[pick] += cost[i, pick]
            if cost[i, pick] > mx[pick]:
                mx[pick] = cost[i, pick]
            val[pick] = acc[pick] + ppm1[pick] * mx[pick]
            cnt[pick] += 1
        obj = val.max()
        if obj < best_obj - 1e-9:
            best_obj = obj
            best_assign = assign
    return best_assign, best_obj


def dispatch_reference(cost: np.ndarray, allowed: np.ndarray, ppm1: np.ndarray, orders: np.ndarray
                       ) -> tuple[np.ndarray, float]:
    """Pure-Python twin of :func:`dispatch`'s kernel."""
    n, p = cost.shape
    best_assign, best_obj = np.full(n, -1, dtype=np.int64), np.inf
    for order in orders:
        acc, mx, val, cnt = [0.0] * p, [0.0] * p, [0.0] * p, [0] * p
        assign = np.full(n, -1, dtype=np.int64)
        for i in order:
            key = None
            pick = -1
            for q in range(p):
                if not allowed[i, q]:
                    continue
                own = acc[q] + cost[i, q] + ppm1[q] * max(mx[q], cost[i, q])
                other = max((val[x] for x in range(p) if x != q), default=0.0)
                new_max = max(own, other)
                cand = (new_max, cnt[q] != 0, own)
                if key is None or _less(cand, key):
                    key, pick = cand, q
            assign[i] = pick
            acc[pick] += cost[i, pick]
            mx[pick] = max(mx[pick], cost[i, pick])
            val[pick] = acc[pick] + ppm1[pick] * mx[pick]
            cnt[pick] += 1
        obj = max(val)
        if obj < best_obj - 1e-9:
            best_obj, best_assign = obj, assign
    return best_assign, best_obj


def _less(a: tuple[float, bool, float], b: tuple[float, bool, float]) -> bool:
    if a[0] < b[0] - 1e-9:
        return True
    if a[0] > b[0] + 1e-9:
        return False
    if a[1] != b[1]:
        return not a[1]  # empty (False) first
    return a[2] < b[2] - 1e-9


def dispatch_orders(lengths: np.ndarray, allowed: np.ndarray, restarts: int, seed: int) -> np.ndarray:
    """``[restarts, n]`` doc orders: constrained docs longest first, then the rest (restart 0: longest first)."""
    n = len(lengths)
    idx = np.arange(n)
    desc = np.lexsort((idx, -lengths))
    constrained = ~allowed.all(axis=1)
    head = desc[constrained[desc]]
    tail = desc[~constrained[desc]]
    rng = np.random.default_rng(seed)
    out = np.empty((max(1, restarts), n), dtype=np.int64)
    out[0] = np.concatenate([head, tail])
    for r in range(1, len(out)):
        out[r] = np.concatenate([head, tail[rng.permutation(len(tail))]])
    return out


def dispatch(cost: np.ndarray, allowed: np.ndarray, ppm1: np.ndarray, lengths: np.ndarray, *, restarts: int = 50,
             seed: int = 0) -> tuple[np.ndarray, float]:
    """Stage 1: pipeline per doc ``[n]`` and the largest pipeline value. ``cost``/``allowed``: ``[n, P]``."""
    assert allowed.any(axis=1).all(), "every doc must fit some pipeline"
    orders = dispatch_orders(np.asarray(lengths, dtype=np.int64), allowed, restarts, seed)
    return dispatch_kernel(np.asarray(cost, dtype=np.float64), np.asarray(allowed, dtype=np.bool_),
                            np.asarray(ppm1, dtype=np.float64), orders)


# ---------------------------------------------------------------------------------------------
# Stage 2
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Packing:
    """A pipeline's microbatches (doc indices into its docs) and what the solver did."""

    bins: list[list[int]]  # [v][docs]
    ms: float
    source: str  # "ffd", "greedy", "ilp"
    solves: int = 0
    time_limit_hits: int = 0
    failures: list[str] = field(default_factory=list)


def _greedy(lengths: np.ndarray, work: np.ndarray, v: int, cap: int) -> list[list[int]] | None:
    """Longest-time-first onto the microbatch with the least work that has room."""
    load = np.zeros(v)
    tok = np.zeros(v, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(v)]
    for i in np.lexsort((np.arange(len(work)), -work)):
        room = tok + lengths[i] <= cap
        if not room.any():
            return None
        j = int(np.argmin(np.where(room, load, np.inf)))
        load[j] += work[i]
        tok[j] += lengths[i]
        bins[j].append(int(i))
    return bins if all(bins) else None


# HiGHS spends most of a small ILP's time in root heuristics; the node limit is the work bound.
STAGE2_HIGHS_OPTIONS: dict[str, float | int | bool] = {
    "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False, "mip_heuristic_run_root_reduced_cost": False}


def minmax_ilp(lengths: np.ndarray, work: np.ndarray, v: int, cap: int, *, upper: float = np.inf,
               time_limit_s: float, node_limit: int | None, rel_gap: float = 1e-4) -> tuple[list[list[int]] | None,
                                                                                           MilpResult]:
    """Docs into ``v`` non-empty microbatches minimizing the largest work under the token cap.

    Docs (longest first) may only use microbatches ``0..i`` (symmetry breaking); ``upper``
    bounds the largest work from above.
    """
    n = len(lengths)
    order = np.lexsort((np.arange(n), -lengths))  # doc at position r
    cols: list[tuple[int, int]] = [(int(order[r]), j) for r in range(n) for j in range(min(r + 1, v))]
    nx = len(cols)
    mcol = nx
    c = np.zeros(nx + 1)
    c[mcol] = 1.0
    integ = np.ones(nx + 1)
    integ[mcol] = 0
    lb = np.zeros(nx + 1)
    ub = np.ones(nx + 1)
    ub[mcol] = upper
    rr: list[int] = []
    cc: list[int] = []
    vv: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    by_doc: list[list[int]] = [[] for _ in range(n)]
    by_bin: list[list[int]] = [[] for _ in range(v)]
    for k, (i, j) in enumerate(cols):
        by_doc[i].append(k)
        by_bin[j].append(k)

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for col, val in entries:
            rr.append(r)
            cc.append(col)
            vv.append(val)
        lo.append(low)
        hi.append(high)

    for i in range(n):
        row([(k, 1.0) for k in by_doc[i]], 1.0, 1.0)
    for j in range(v):
        row([(k, float(lengths[cols[k][0]])) for k in by_bin[j]], -np.inf, float(cap))
        row([(k, float(work[cols[k][0]])) for k in by_bin[j]] + [(mcol, -1.0)], -np.inf, 0.0)
        row([(k, 1.0) for k in by_bin[j]], 1.0, np.inf)
    res = solve_milp(c, integ, lb, ub, (np.asarray(rr), np.asarray(cc), np.asarray(vv)), np.asarray(lo),
                     np.asarray(hi), time_limit_s=time_limit_s, node_limit=node_limit, rel_gap=rel_gap,
                     highs_options=STAGE2_HIGHS_OPTIONS)
    if res.x is None:
        return None, res
    bins: list[list[int]] = [[] for _ in range(v)]
    for k, (i, j) in enumerate(cols):
        if res.x[k] > 0.5:
            bins[j].append(i)
    return bins, res


def pack_pipeline(lengths: np.ndarray, work: np.ndarray, cap: int, c: float, pp: int, *, time_limit_s: float,
                  node_limit: int | None, max_v: int = 16, use_ilp: bool = True, ilp_max_vars: int = 2000,
                  rel_gap: float = 0.002, min_gain: float = 0.01) -> Packing:
    """Stage 2 for one pipeline: docs ``lengths``/``work`` ``[n]`` (per-stage work) into microbatches.

    The ILP runs for a ``v`` only where the greedy packing failed or where its pipeline time is
    more than ``min_gain`` (relative) above that ``v``'s lower bound, and where it has at most
    ``ilp_max_vars`` doc-microbatch pairs.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    work = np.asarray(work, dtype=np.float64)
    n = len(lengths)
    if n == 0:
        return Packing(bins=[], ms=0.0, source="empty")
    assert int(lengths.max()) <= cap
    total_w, w_max = float(work.sum()), float(work.max())
    ffd = pack(lengths, cap, "ffd")
    v_ffd = int(ffd.max()) + 1
    bins0 = [list(map(int, np.flatnonzero(ffd == j))) for j in range(v_ffd)]
    best = Packing(bins=bins0, ms=serial_pool_ms(np.array([work[b].sum() for b in bins0]), pp, c), source="ffd")
    v_lo = max(1, -(-int(lengths.sum()) // cap))
    for v in sorted(set(range(v_lo, min(n, v_lo + max_v - 1) + 1)) | {v_ffd}):
        if v > n:
            continue
        # no packing into v microbatches beats perfectly even ones (largest = max(longest doc, average))
        lower = v * c + total_w + (pp - 1) * (c + max(w_max, total_w / v))
        if lower >= best.ms - 1e-9:
            if pp == 1:
                break
            continue
        bins = _greedy(lengths, work, v, cap)
        source = "greedy"
        cur = serial_pool_ms(np.array([work[b].sum() for b in bins]), pp, c) if bins else np.inf
        # the ILP can only shrink the (pp - 1) * largest-microbatch term; skip it where that gain is small
        need_ilp = bins is None or (pp > 1 and min(cur, best.ms) - lower > min_gain * min(cur, best.ms))
        if use_ilp and need_ilp and n * v <= ilp_max_vars:
            upper = (min(cur, best.ms) - v * c - total_w) / (pp - 1) - c if pp > 1 else np.inf
            got, res = minmax_ilp(lengths, work, v, cap, upper=upper, time_limit_s=time_limit_s,
                                  node_limit=node_limit, rel_gap=rel_gap)
            best.solves += 1
            best.time_limit_hits += int(res.time_limit_hit)
            if got is None and not (res.infeasible or res.node_limit_hit or res.time_limit_hit):
                best.failures.append(res.note)
            if got is not None and (bins is None or max(work[b].sum() for b in got) < max(work[b].sum() for b in bins)):
                bins, source = got, "ilp"
        if bins is None:
            continue
        ms = serial_pool_ms(np.array([work[b].sum() for b in bins]), pp, c)
        if ms < best.ms - 1e-9:
            best.bins, best.ms, best.source = bins, ms, source
    best.bins = sorted(best.bins, key=lambda b: (-float(work[b].sum()), b))
    return best
