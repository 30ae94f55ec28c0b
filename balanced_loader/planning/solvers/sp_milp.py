"""FlexSP's bucketed MILPs for one microbatch, solved with HiGHS (papers/flexsp.md §1).

Docs are bucketed by the error-minimizing DP (:func:`~balanced_loader.planning.solvers.blaster.buckets_for`);
bucket ``q`` has ``count[q]`` docs and bound ``bound[q]`` (its longest). Memory rows use the
bound (so every decoded group fits); time rows use the bucket's mean per-doc time at each
degree (unbiased). A bucket may only use degrees that hold its bound (minimum-degree pruning).
Two formulations:

* :func:`slot_milp`, FlexSP's own: ``lanes // d`` candidate slots per degree (pruned by the
  lanes the longest docs must take), integer ``A[q, p]``, binary ``m[p]``, makespan ``C``:
  every bucket assigned; ``sum_q bound_q A[q,p] <= cap d_p m[p]``; ``beta m[p] + sum_q T A[q,p] <= C``;
  used slots non-empty; ``sum_p d_p m[p] = lanes``; plus a work row
  ``sum_p d_p time_p <= lanes C`` and token ordering of same-degree slots. Exact on the
  bucketed instance, but slot symmetry makes HiGHS slow: on the 64-lane GPT-7B setting it
  found no incumbent, or one worse than the greedy plan, within 5 s (docs/results/planners.md).
  Used when it is small (``exact_vars``).
* :func:`class_milp`, the same model aggregated over identical slots: integer ``n[d]`` groups
  of degree ``d`` and integer ``x[q, d]`` docs of bucket ``q`` on them, for a target makespan
  ``C``: ``sum_q T x[q,d] <= n[d] (C - beta)``, ``sum_q bound_q x[q,d] <= n[d] cap d``,
  ``sum_d d n[d] = lanes``, every group non-empty, ``x[q,d] = 0`` where one doc alone exceeds
  ``C``, and packing cuts (docs over half / a third of a group's time or tokens: at most one
  / two per group). :func:`solve_microbatch` bisects ``C`` between a lower bound and the
  greedy plan; each feasible point is decoded (longest docs to the largest degrees, then
  longest-time-first into the class's groups under the token cap) and polished.

Every result is re-costed with real lengths and kept only if faster than the greedy plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from balanced_loader.cost import ShapeCost, fit_degrees
from balanced_loader.planning.solvers.blaster import buckets_for
from balanced_loader.planning.solvers.solver import MilpResult, solve_milp
from balanced_loader.planning.solvers.sp_groups import (
    GroupChoice,
    SpGroup,
    group_time,
    polish,
    segment_table,
)

# The class MILP is small but its infeasibility proofs near the optimum are hard; HiGHS's root
# sub-MIP heuristics then dominate the time (0.6-1.5 s per call measured), so they are off.
CLASS_HIGHS_OPTIONS: dict[str, float | int | bool] = {
    "mip_heuristic_effort": 0.0, "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False, "mip_heuristic_run_feasibility_jump": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class Buckets:
    """A microbatch's docs in buckets, with per-degree times."""

    lengths: np.ndarray  # [n]
    seg: np.ndarray  # [D, n] segment time of each doc at each degree
    degrees: tuple[int, ...]  # [D]
    label: np.ndarray  # [n] bucket of each doc
    bound: np.ndarray  # [Q] longest length in each bucket
    count: np.ndarray  # [Q]
    mean_t: np.ndarray  # [D, Q] mean segment time
    max_t: np.ndarray  # [D, Q] segment time of the bound
    minsp: np.ndarray  # [Q] smallest degree holding the bound
    max_groups: np.ndarray  # [D] group count limit per degree after pruning

    @staticmethod
    def build(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int], q0: int = 16,
              seg: np.ndarray | None = None) -> Buckets:
        lengths = np.asarray(lengths, dtype=np.int64)
        seg = segment_table(lengths, sc, degrees) if seg is None else seg
        cap = sc.max_tokens_per_lane
        label, bound = buckets_for(lengths, num_lanes * cap, q0=q0)
        nq = len(bound)
        count = np.bincount(label, minlength=nq).astype(np.int64)
        mean_t = np.stack([np.bincount(label, weights=seg[j], minlength=nq) / count for j in range(len(degrees))])
        max_t = segment_table(bound, sc, degrees)
        minsp = fit_degrees(bound, cap, degrees)
        assert minsp.min() > 0, "every bucket bound is a real length that some degree holds"
        sp_max = int(minsp.max())
        big = minsp == sp_max
        lanes_big = sp_max * -(-int((bound[big] * count[big]).sum()) // (cap * sp_max))
        max_groups = np.zeros(len(degrees), dtype=np.int64)
        for j, d in enumerate(degrees):
            n = num_lanes // d
            if d < sp_max:
                n = min(n, (num_lanes - lanes_big) // d)
            max_groups[j] = max(0, min(n, int(count[minsp <= d].sum())))
        return Buckets(lengths=lengths, seg=seg, degrees=tuple(degrees), label=label, bound=bound, count=count,
                       mean_t=mean_t, max_t=max_t, minsp=minsp, max_groups=max_groups)

    def members(self, q: int) -> np.ndarray:
        """Docs of bucket ``q``, longest first (stable)."""
        m = np.flatnonzero(self.label == q)
        return m[np.lexsort((m, -self.lengths[m]))]


class _Rows:
    """Sparse constraint rows as coordinates."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, entries: list[tuple[int, float]], low: float, high: float) -> None:
        k = len(self.lo)
        for col, val in entries:
            self.r.append(k)
            self.c.append(col)
            self.v.append(val)
        self.lo.append(low)
        self.hi.append(high)

    def solve(self, c: np.ndarray, integ: np.ndarray, lb: np.ndarray, ub: np.ndarray, *, time_limit_s: float,
              node_limit: int | None, rel_gap: float,
              highs_options: dict[str, float | int | bool] | None = None) -> MilpResult:
        return solve_milp(c, integ, lb, ub, (np.asarray(self.r, dtype=np.int64), np.asarray(self.c, dtype=np.int64),
                                             np.asarray(self.v, dtype=np.float64)),
                          np.asarray(self.lo), np.asarray(self.hi), time_limit_s=time_limit_s,
                          node_limit=node_limit, rel_gap=rel_gap, highs_options=highs_options)


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpOutcome:
    choice: GroupChoice | None  # decoded, re-costed groups; None without incumbent or decode
    result: MilpResult


# ---------------------------------------------------------------------------------------------
# FlexSP's per-slot formulation
# ---------------------------------------------------------------------------------------------


def slot_pairs(bk: Buckets, sc: ShapeCost, upper: float = np.inf) -> tuple[list[int], list[tuple[int, int]]]:
    """Slot degrees and the allowed (bucket, slot) pairs of :func:`slot_milp`."""
    slot_deg = [d for j, d in enumerate(bk.degrees) for _ in range(int(bk.max_groups[j]))]
    dj = {d: j for j, d in enumerate(bk.degrees)}
    pairs = [(q, p) for p, d in enumerate(slot_deg) for q in range(len(bk.bound))
             if bk.minsp[q] <= d and sc.microbatch_ms + bk.max_t[dj[d], q] < upper]
    return slot_deg, pairs


def slot_milp(bk: Buckets, sc: ShapeCost, num_lanes: int, *, time_limit_s: float, node_limit: int | None,
              rel_gap: float = 1e-4, upper: float = np.inf) -> MilpOutcome:
    """FlexSP's bucketed per-slot MILP; ``upper`` (optional) bounds the makespan from above."""
    cap = sc.max_tokens_per_lane
    slot_deg, pairs = slot_pairs(bk, sc, upper)
    dj = {d: j for j, d in enumerate(bk.degrees)}
    # columns: x[(q, p)] docs of bucket q on slot p (integer), m[p] slot p is used (binary), then the makespan C
    nq, npl, na = len(bk.bound), len(slot_deg), len(pairs)
    m0, ci = na, na + npl
    nv = ci + 1
    c = np.zeros(nv)
    c[ci] = 1.0
    integ = np.ones(nv)
    integ[ci] = 0
    lb = np.zeros(nv)
    ub = np.ones(nv)
    ub[ci] = upper
    for v, (q, p) in enumerate(pairs):  # a slot holds at most as many docs of a bucket as fit its token cap
        ub[v] = min(int(bk.count[q]), (cap * slot_deg[p]) // int(bk.bound[q]))
    by_q: list[list[int]] = [[] for _ in range(nq)]
    by_p: list[list[int]] = [[] for _ in range(npl)]
    for v, (q, p) in enumerate(pairs):
        by_q[q].append(v)
        by_p[p].append(v)
    rows = _Rows()
    for q in range(nq):
        rows.add([(v, 1.0) for v in by_q[q]], float(bk.count[q]), float(bk.count[q]))
    # rows per slot: tokens under the cap if used, its time (mean segment times + microbatch_ms) <= C,
    # and used only when it holds a doc; work (lane-ms over all slots) <= lanes * C is a valid cut
    work: list[tuple[int, float]] = [(ci, -float(num_lanes))]
    for p, d in enumerate(slot_deg):
        j = dj[d]
        toks = [(v, float(bk.bound[pairs[v][0]])) for v in by_p[p]]
        times = [(v, float(bk.mean_t[j, pairs[v][0]])) for v in by_p[p]]
        rows.add(toks + [(m0 + p, -float(cap * d))], -np.inf, 0.0)
        rows.add(times + [(m0 + p, sc.microbatch_ms), (ci, -1.0)], -np.inf, 0.0)
        rows.add([(v, 1.0) for v in by_p[p]] + [(m0 + p, -1.0)], 0.0, np.inf)
        work += [(v, d * t) for v, t in times] + [(m0 + p, d * sc.microbatch_ms)]
        if p + 1 < npl and slot_deg[p + 1] == d:  # same-degree slots: tokens non-increasing
            rows.add(toks + [(v, -float(bk.bound[pairs[v][0]])) for v in by_p[p + 1]], 0.0, np.inf)
    rows.add([(m0 + p, float(d)) for p, d in enumerate(slot_deg)], float(num_lanes), float(num_lanes))
    rows.add(work, -np.inf, 0.0)
    if any(not by_q[q] for q in range(nq)):
        return MilpOutcome(choice=None, result=MilpResult(x=None, objective=np.inf, optimal=False,
                                                          time_limit_hit=False, node_limit_hit=False,
                                                          infeasible=True, note="no slot can take some bucket"))
    res = rows.solve(c, integ, lb, ub, time_limit_s=time_limit_s, node_limit=node_limit, rel_gap=rel_gap)
    if res.x is None:
        return MilpOutcome(choice=None, result=res)
    left = np.zeros((nq, npl), dtype=np.int64)  # [Q, P] docs of bucket q still to place on slot p
    for v, (q, p) in enumerate(pairs):
        left[q, p] = int(res.x[v])
    assert (left.sum(axis=1) == bk.count).all()
    # the MILP counts docs per (bucket, slot); real docs of each bucket, longest bucket first, go to the
    # slot with room in that count whose real time stays lowest (bucketed times are upper bounds)
    load = np.zeros(npl)  # [P]
    docs_of: list[list[int]] = [[] for _ in range(npl)]
    for q in np.argsort(-bk.bound, kind="stable"):
        for i in bk.members(int(q)):
            cand = np.flatnonzero(left[q] > 0)
            t = np.array([bk.seg[dj[slot_deg[p]], i] for p in cand]) + load[cand]
            p = int(cand[int(np.argmin(t))])
            left[q, p] -= 1
            load[p] += bk.seg[dj[slot_deg[p]], i]
            docs_of[p].append(int(i))
    groups = tuple(SpGroup(degree=slot_deg[p], docs=tuple(docs_of[p]),
                           ms=group_time(sc, bk.seg[dj[slot_deg[p]]], docs_of[p]))
                   for p in range(npl) if docs_of[p])
    return MilpOutcome(choice=GroupChoice(groups=groups, makespan=max(g.ms for g in groups), source="slot-milp"),
                       result=res)


# ---------------------------------------------------------------------------------------------
# Aggregated formulation at a target makespan
# ---------------------------------------------------------------------------------------------


def class_milp(bk: Buckets, sc: ShapeCost, num_lanes: int, target: float, *, time_limit_s: float,
               node_limit: int | None, rel_gap: float = 0.05) -> MilpOutcome:
    """Groups per degree and bucket counts per degree that meet makespan ``target`` (see module docstring)."""
    cap = sc.max_tokens_per_lane
    budget = target - sc.microbatch_ms
    nd, nq = len(bk.degrees), len(bk.bound)
    pairs = [(q, j) for j, d in enumerate(bk.degrees) for q in range(nq)
             if bk.max_groups[j] > 0 and bk.minsp[q] <= d and bk.max_t[j, q] <= budget]
    covered = {q for q, _ in pairs}
    if budget <= 0 or len(covered) < nq:
        return MilpOutcome(choice=None, result=MilpResult(x=None, objective=np.inf, optimal=False,
                                                          time_limit_hit=False, node_limit_hit=False,
                                                          infeasible=True, note="some doc alone exceeds the target"))
    na = len(pairs)
    nv = na + nd  # x[q, d] then n[d]
    c = np.zeros(nv)
    integ = np.ones(nv)
    lb = np.zeros(nv)
    ub = np.zeros(nv)
    for v, (q, j) in enumerate(pairs):
        d = bk.degrees[j]
        c[v] = d * bk.mean_t[j, q]
        ub[v] = bk.count[q]
    ub[na:] = bk.max_groups
    rows = _Rows()
    for q in range(nq):
        rows.add([(v, 1.0) for v, (qq, _) in enumerate(pairs) if qq == q], float(bk.count[q]), float(bk.count[q]))
    for j, d in enumerate(bk.degrees):
        mine = [(v, q) for v, (q, jj) in enumerate(pairs) if jj == j]
        n_col = na + j
        if not mine:
            continue
        rows.add([(v, float(bk.mean_t[j, q])) for v, q in mine] + [(n_col, -budget)], -np.inf, 0.0)
        rows.add([(v, float(bk.bound[q])) for v, q in mine] + [(n_col, -float(cap * d))], -np.inf, 0.0)
        rows.add([(v, 1.0) for v, _ in mine] + [(n_col, -1.0)], 0.0, np.inf)
        for k in (2, 3):  # packing cuts: at most k-1 docs over 1/k of a group's time or tokens
            heavy = [(v, 1.0) for v, q in mine if bk.mean_t[j, q] > budget / k or bk.bound[q] > cap * d / k]
            if heavy:
                rows.add(heavy + [(n_col, -float(k - 1))], -np.inf, 0.0)
    rows.add([(na + j, float(d)) for j, d in enumerate(bk.degrees)], float(num_lanes), float(num_lanes))
    res = rows.solve(c, integ, lb, ub, time_limit_s=time_limit_s, node_limit=node_limit, rel_gap=rel_gap,
                     highs_options=CLASS_HIGHS_OPTIONS)
    if res.x is None:
        return MilpOutcome(choice=None, result=res)
    x = np.zeros((nq, nd), dtype=np.int64)  # [Q, D]
    for v, (q, j) in enumerate(pairs):
        x[q, j] = int(res.x[v])
    ngroups = np.round(res.x[na:]).astype(np.int64)  # [D]
    return MilpOutcome(choice=_decode_classes(bk, sc, x, ngroups), result=res)


def _decode_classes(bk: Buckets, sc: ShapeCost, x: np.ndarray, ngroups: np.ndarray) -> GroupChoice | None:
    """Docs to degree classes (longest to the largest degree), then into each class's groups.

    Within a class: longest-time-first onto the group with the least time that has room.
    A doc that finds no room (the aggregated memory row is not bin packing) is repaired
    afterwards onto the group of any degree with room where it adds the least time; the
    local search balances the result. ``None`` when the repair finds no room either.
    """
    cap = sc.max_tokens_per_lane
    per_class: list[list[int]] = [[] for _ in bk.degrees]
    for q in range(len(bk.bound)):
        members = list(bk.members(q))
        for j in range(len(bk.degrees) - 1, -1, -1):
            take, members = members[: x[q, j]], members[x[q, j]:]
            per_class[j].extend(int(i) for i in take)
    gdeg: list[int] = []  # [G] degree index per group
    gdocs: list[list[int]] = []
    spill: list[int] = []
    for j in range(len(bk.degrees)):
        docs = per_class[j]
        if not docs:
            continue
        g = int(ngroups[j])
        ids = np.asarray(docs, dtype=np.int64)
        load = np.zeros(g)
        tok = np.zeros(g, dtype=np.int64)
        members: list[list[int]] = [[] for _ in range(g)]
        for k in np.lexsort((ids, -bk.seg[j, ids])):
            i = int(ids[k])
            room = tok + bk.lengths[i] <= cap * bk.degrees[j]
            if not room.any():
                spill.append(i)
                continue
            h = int(np.argmin(np.where(room, load, np.inf)))
            load[h] += bk.seg[j, i]
            tok[h] += bk.lengths[i]
            members[h].append(i)
        for m in members:
            if m:
                gdeg.append(j)
                gdocs.append(m)
    if spill:
        load = np.array([bk.seg[gdeg[g], gdocs[g]].sum() for g in range(len(gdocs))])
        tok = np.array([int(bk.lengths[gdocs[g]].sum()) for g in range(len(gdocs))], dtype=np.int64)
        room_cap = np.array([cap * bk.degrees[j] for j in gdeg], dtype=np.int64)
        for i in sorted(spill, key=lambda i: (-int(bk.lengths[i]), i)):
            added = np.array([bk.seg[j, i] for j in gdeg])
            ok = tok + bk.lengths[i] <= room_cap
            if not ok.any():
                return None
            h = int(np.argmin(np.where(ok, load + added, np.inf)))
            load[h] += added[h]
            tok[h] += bk.lengths[i]
            gdocs[h].append(i)
    groups = tuple(SpGroup(degree=bk.degrees[j], docs=tuple(m), ms=group_time(sc, bk.seg[j], m))
                   for j, m in zip(gdeg, gdocs))
    return GroupChoice(groups=groups, makespan=max(g.ms for g in groups), source="class-milp")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class MicrobatchSolve:
    """Best groups found for one microbatch and what the solver did."""

    choice: GroupChoice
    solves: int = 0
    time_limit_hits: int = 0
    failures: list[str] = field(default_factory=list)  # solver problems (not proven infeasibility)


def solve_microbatch(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int], greedy: GroupChoice,
                     lower: float, *, time_limit_s: float, node_limit: int | None, rel_gap: float = 0.002,
                     q0: int = 16, exact_vars: int = 64, bisect_steps: int = 6, bisect_tol: float = 0.005,
                     seg: np.ndarray | None = None) -> MicrobatchSolve:
    """Improve on ``greedy`` with the bucketed MILPs; never returns anything slower than ``greedy``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    seg = segment_table(lengths, sc, degrees) if seg is None else seg
    best = polish(greedy, lengths, sc, degrees, seg)
    out = MicrobatchSolve(choice=best)
    bk = Buckets.build(lengths, sc, num_lanes, degrees, q0=q0, seg=seg)

    def consider(res: MilpOutcome) -> None:
        out.solves += int(res.result.seconds > 0)  # pre-solve rejections cost nothing
        out.time_limit_hits += int(res.result.time_limit_hit)
        if res.result.x is None and not res.result.infeasible and not res.result.node_limit_hit:
            out.failures.append(res.result.note)
        if res.choice is not None:
            cand = polish(res.choice, lengths, sc, degrees, seg)
            if cand.makespan < out.choice.makespan - 1e-9:
                out.choice = cand

    if len(slot_pairs(bk, sc, best.makespan)[1]) <= exact_vars:
        consider(slot_milp(bk, sc, num_lanes, time_limit_s=time_limit_s, node_limit=node_limit,
                           rel_gap=min(rel_gap, 1e-4), upper=best.makespan))
        return out
    lo, hi = lower, best.makespan
    for _ in range(bisect_steps):
        if hi - lo <= bisect_tol * hi:
            break
        target = (lo + hi) / 2
        res = class_milp(bk, sc, num_lanes, target, time_limit_s=time_limit_s, node_limit=node_limit)
        consider(res)
        if res.choice is None:
            lo = target
        else:
            hi = min(target, out.choice.makespan)
    return out
