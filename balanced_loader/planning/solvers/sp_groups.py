"""One FlexSP microbatch: sequence-parallel groups of power-of-two degrees over a pool's lanes.

Given the docs of one microbatch, groups whose degrees sum to at most the pool's lanes each
run some docs; the slowest group's contract-2 time is to be minimal under the token cap
``tokens <= max_tokens_per_lane * degree``. This module holds the pieces that need no
solver (the MILPs are in :mod:`balanced_loader.planning.solvers.sp_milp`):

* :func:`greedy_homogeneous`: for each degree ``d``, ``lanes // d`` groups filled longest doc
  first onto the group with the least time that still has room; the best ``d`` wins (FlexSP's
  warm start, and the plan every MILP result is compared with).
* :func:`makespan_lower_bound`: a bound used to skip solves that cannot pay off.
* :func:`polish`: local search (moves, then swaps, out of the slowest group), deterministic.
* :func:`place_lanes`: aligned lane blocks per microbatch (largest degree first), each group on
  the free block that becomes idle earliest, which contract 2 rewards because lanes run ahead
  across microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from balanced_loader.cost import ShapeCost


@dataclass(frozen=True, kw_only=True, slots=True)
class SpGroup:
    """A group of one microbatch before lane placement."""

    degree: int
    docs: tuple[int, ...]  # [num_docs] indices into the microbatch's docs
    ms: float  # contract-2 group time with real lengths


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupChoice:
    """The groups of one microbatch and where they came from."""

    groups: tuple[SpGroup, ...]
    makespan: float  # slowest group's time
    source: str  # "greedy d=8" or "milp"


def segment_table(lengths: np.ndarray, sc: ShapeCost, degrees: list[int]) -> np.ndarray:
    """``[num_degrees, n]`` time each doc adds to a group of each degree."""
    ln = np.asarray(lengths, dtype=np.float64)
    return np.stack([np.asarray(sc.segment_ms(ln, d), dtype=np.float64) for d in degrees]) if degrees else \
        np.zeros((0, len(ln)))


def group_time(sc: ShapeCost, seg_row: np.ndarray, docs: list[int] | tuple[int, ...]) -> float:
    """Contract-2 time of a group: ``microbatch_ms`` plus its docs' segment times."""
    return float(sc.microbatch_ms + seg_row[list(docs)].sum())


# ---------------------------------------------------------------------------------------------
# Greedy homogeneous plan
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def fill_kernel(lengths: np.ndarray, times: np.ndarray, order: np.ndarray, groups: int, cap: int) -> np.ndarray:
    load = np.zeros(groups, dtype=np.float64)  # [groups] ms
    tok = np.zeros(groups, dtype=np.int64)  # [groups]
    out = np.full(lengths.shape[0], -1, dtype=np.int64)  # [n]
    for t in range(order.shape[0]):
        i = order[t]
        pick = -1
        for g in range(groups):
            if tok[g] + lengths[i] <= cap and (pick < 0 or load[g] < load[pick]):
                pick = g
        if pick < 0:
            return np.full(lengths.shape[0], -1, dtype=np.int64)
        out[i] = pick
        load[pick] += times[i]
        tok[pick] += lengths[i]
    return out


def fill_reference(lengths: np.ndarray, times: np.ndarray, order: np.ndarray, groups: int, cap: int) -> np.ndarray:
    """Pure-Python twin of the homogeneous fill: longest first onto the least-loaded group with room."""
    load = [0.0] * groups
    tok = [0] * groups
    out = [-1] * len(lengths)
    for i in order:
        pick = -1
        for g in range(groups):
            if tok[g] + int(lengths[i]) <= cap and (pick < 0 or load[g] < load[pick]):
                pick = g
        if pick < 0:
            return np.full(len(lengths), -1, dtype=np.int64)
        out[i] = pick
        load[pick] += float(times[i])
        tok[pick] += int(lengths[i])
    return np.asarray(out, dtype=np.int64)


def fill_groups(lengths: np.ndarray, times: np.ndarray, groups: int, cap: int) -> np.ndarray:
    """Group per doc ``[n]`` (longest first, least time with room), all -1 when some doc finds no room."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.lexsort((np.arange(len(lengths)), -lengths)).astype(np.int64)
    return fill_kernel(lengths, np.asarray(times, dtype=np.float64), order, int(groups), int(cap))


def greedy_homogeneous(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int],
                       seg: np.ndarray | None = None) -> GroupChoice | None:
    """Best homogeneous plan (all groups of one degree); ``None`` when no degree holds the docs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    seg = segment_table(lengths, sc, degrees) if seg is None else seg
    cap = sc.max_tokens_per_lane
    best: GroupChoice | None = None
    longest = int(lengths.max()) if lengths.size else 0
    for j, d in enumerate(degrees):
        if longest > cap * d:
            continue
        assign = fill_groups(lengths, seg[j], num_lanes // d, cap * d)
        if assign.size and assign[0] < 0:
            continue
        groups = []
        for g in range(num_lanes // d):
            docs = tuple(int(i) for i in np.flatnonzero(assign == g))
            if docs:
                groups.append(SpGroup(degree=d, docs=docs, ms=group_time(sc, seg[j], docs)))
        span = max(g.ms for g in groups)
        if best is None or span < best.makespan - 1e-9:
            best = GroupChoice(groups=tuple(groups), makespan=span, source=f"greedy d={d}")
    return best


def makespan_lower_bound(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int],
                         seg: np.ndarray | None = None) -> float:
    """A lower bound on the slowest group when groups use all lanes.

    Every doc runs in some group (``beta + its own time``), and the lanes' total busy time
    ``sum_g d_g * time_g = lanes * beta + sum_docs d * T(s, d)`` is at most ``lanes * C``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    seg = segment_table(lengths, sc, degrees) if seg is None else seg
    cap = sc.max_tokens_per_lane
    deg = np.asarray(degrees, dtype=np.float64)[:, None]  # [D, 1]
    fits = lengths[None, :] <= cap * deg  # [D, n]
    own = np.where(fits, seg, np.inf).min(axis=0)  # [n]
    work = np.where(fits, seg * deg, np.inf).min(axis=0)  # [n]
    return float(sc.microbatch_ms + max(own.max(), work.sum() / num_lanes))


# ---------------------------------------------------------------------------------------------
# Local search
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def polish_kernel(lengths: np.ndarray, seg: np.ndarray, gdeg: np.ndarray, gcap: np.ndarray,
                   assign: np.ndarray, beta: float, max_iter: int) -> np.ndarray:
    n = lengths.shape[0]
    ng = gdeg.shape[0]
    out = assign.copy()  # [n]
    gtime = np.full(ng, beta)  # [G]
    gtok = np.zeros(ng, dtype=np.int64)  # [G]
    gcnt = np.zeros(ng, dtype=np.int64)  # [G]
    for i in range(n):
        g = out[i]
        gtime[g] += seg[gdeg[g], i]
        gtok[g] += lengths[i]
        gcnt[g] += 1
    for _ in range(max_iter):
        g = 0
        for h in range(ng):
            if gtime[h] > gtime[g]:
                g = h
        top = gtime[g] - 1e-9
        best = top
        bi = -1
        bh = -1
        bj = -1
        if gcnt[g] > 1:  # moves
            for i in range(n):
                if out[i] != g:
                    continue
                for h in range(ng):
                    if h == g or gtok[h] + lengths[i] > gcap[h]:
                        continue
                    a = gtime[h] + seg[gdeg[h], i]
                    b = gtime[g] - seg[gdeg[g], i]
                    m = a if a > b else b
                    if m < best:
                        best = m
                        bi = i
                        bh = h
        if bi < 0:  # swaps
            for i in range(n):
                if out[i] != g:
                    continue
                for j in range(n):
                    h = out[j]
                    if h == g:
                        continue
                    if gtok[g] - lengths[i] + lengths[j] > gcap[g] or gtok[h] - lengths[j] + lengths[i] > gcap[h]:
                        continue
                    a = gtime[g] - seg[gdeg[g], i] + seg[gdeg[g], j]
                    b = gtime[h] - seg[gdeg[h], j] + seg[gdeg[h], i]
                    m = a if a > b else b
                    if m < best:
                        best = m
                        bi = i
                        bj = j
        if bi < 0:
            break
        if bj < 0:
            out[bi] = bh
            gtime[g] -= seg[gdeg[g], bi]
            gtime[bh] += seg[gdeg[bh], bi]
            gtok[g] -= lengths[bi]
            gtok[bh] += lengths[bi]
            gcnt[g] -= 1
            gcnt[bh] += 1
        else:
            h = out[bj]
            out[bi] = h
            out[bj] = g
            gtime[g] += seg[gdeg[g], bj] - seg[gdeg[g], bi]
            gtime[h] += seg[gdeg[h], bi] - seg[gdeg[h], bj]
            gtok[g] += lengths[bj] - lengths[bi]
            gtok[h] += lengths[bi] - lengths[bj]
    return out


def polish_reference(lengths: np.ndarray, seg: np.ndarray, gdeg: np.ndarray, gcap: np.ndarray,
                     assign: np.ndarray, beta: float, max_iter: int) -> np.ndarray:
    """Pure-Python twin of the local search: the best move out of the slowest group, else the best swap."""
    n, ng = len(lengths), len(gdeg)
    out = [int(a) for a in assign]
    gtime = [float(beta)] * ng
    gtok = [0] * ng
    gcnt = [0] * ng
    for i in range(n):
        g = out[i]
        gtime[g] += float(seg[gdeg[g], i])
        gtok[g] += int(lengths[i])
        gcnt[g] += 1
    for _ in range(max_iter):
        g = max(range(ng), key=lambda h: (gtime[h], -h))
        best, bi, bh, bj = gtime[g] - 1e-9, -1, -1, -1
        if gcnt[g] > 1:
            for i in (i for i in range(n) if out[i] == g):
                for h in range(ng):
                    if h == g or gtok[h] + lengths[i] > gcap[h]:
                        continue
                    m = max(gtime[h] + seg[gdeg[h], i], gtime[g] - seg[gdeg[g], i])
                    if m < best:
                        best, bi, bh = m, i, h
        if bi < 0:
            for i in (i for i in range(n) if out[i] == g):
                for j in range(n):
                    h = out[j]
                    if h == g or gtok[g] - lengths[i] + lengths[j] > gcap[g] \
                            or gtok[h] - lengths[j] + lengths[i] > gcap[h]:
                        continue
                    m = max(gtime[g] - seg[gdeg[g], i] + seg[gdeg[g], j],
                            gtime[h] - seg[gdeg[h], j] + seg[gdeg[h], i])
                    if m < best:
                        best, bi, bj = m, i, j
        if bi < 0:
            break
        if bj < 0:
            out[bi] = bh
            gtime[g] -= seg[gdeg[g], bi]
            gtime[bh] += seg[gdeg[bh], bi]
            gtok[g] -= int(lengths[bi])
            gtok[bh] += int(lengths[bi])
            gcnt[g] -= 1
            gcnt[bh] += 1
        else:
            h = out[bj]
            out[bi], out[bj] = h, g
            gtime[g] += seg[gdeg[g], bj] - seg[gdeg[g], bi]
            gtime[h] += seg[gdeg[h], bi] - seg[gdeg[h], bj]
            gtok[g] += int(lengths[bj] - lengths[bi])
            gtok[h] += int(lengths[bi] - lengths[bj])
    return np.asarray(out, dtype=np.int64)


def polish(choice: GroupChoice, lengths: np.ndarray, sc: ShapeCost, degrees: list[int], seg: np.ndarray,
           max_iter: int = 200) -> GroupChoice:
    """Improve ``choice`` by moving or swapping docs out of the slowest group (never empties a group)."""
    dj = {d: j for j, d in enumerate(degrees)}
    assign = np.zeros(len(lengths), dtype=np.int64)  # [n]
    for g, grp in enumerate(choice.groups):
        assign[list(grp.docs)] = g
    gdeg = np.asarray([dj[g.degree] for g in choice.groups], dtype=np.int64)  # [G]
    gcap = np.asarray([sc.max_tokens_per_lane * g.degree for g in choice.groups], dtype=np.int64)  # [G]
    out = polish_kernel(np.asarray(lengths, dtype=np.int64), seg, gdeg, gcap, assign,
                         float(sc.microbatch_ms), int(max_iter))
    groups = []
    for g, grp in enumerate(choice.groups):
        docs = tuple(int(i) for i in np.flatnonzero(out == g))
        groups.append(SpGroup(degree=grp.degree, docs=docs, ms=group_time(sc, seg[gdeg[g]], docs)))
    span = max(g.ms for g in groups)
    if span >= choice.makespan - 1e-9:
        return choice
    return GroupChoice(groups=tuple(groups), makespan=span, source=choice.source + "+polish")


# ---------------------------------------------------------------------------------------------
# Lane placement
# ---------------------------------------------------------------------------------------------


def place_lanes(microbatches: list[tuple[SpGroup, ...]], num_lanes: int, pp: int = 1) -> list[list[tuple[int, ...]]]:
    """Aligned lane block per group, microbatch by microbatch, ``[num_microbatches][groups]``.

    Groups go largest degree first (so blocks stay aligned), slowest first within a degree,
    each onto the free aligned block whose lanes become idle earliest (contract-2 run-ahead).
    The degrees of one microbatch must sum to at most ``num_lanes``.
    """
    # the contract-2 lane recurrence (balanced_loader.simulate.lane_schedule), kept incremental here
    # because each group's block is chosen from the finish times the groups before it leave
    finish = np.zeros(num_lanes)  # [num_lanes] ms
    out: list[list[tuple[int, ...]]] = []
    for groups in microbatches:
        assert sum(g.degree for g in groups) <= num_lanes
        used = np.zeros(num_lanes, dtype=bool)  # [num_lanes]
        lanes_of: list[tuple[int, ...]] = [()] * len(groups)
        order = sorted(range(len(groups)), key=lambda k: (-groups[k].degree, -groups[k].ms, k))
        for k in order:
            d = groups[k].degree
            nb = num_lanes // d
            # aligned blocks of d lanes as rows: a block is free when none of its lanes is taken in this
            # microbatch, and it can start when its last lane is idle
            blocks_free = ~used[:nb * d].reshape(nb, d).any(axis=1)  # [num_lanes // d]
            starts = np.where(blocks_free, finish[:nb * d].reshape(nb, d).max(axis=1), np.inf)
            b = int(np.argmin(starts))
            assert np.isfinite(starts[b])
            lanes = tuple(range(b * d, (b + 1) * d))
            used[b * d:(b + 1) * d] = True
            finish[b * d:(b + 1) * d] = starts[b] + groups[k].ms / pp
            lanes_of[k] = lanes
        out.append(lanes_of)
    return out


def rebalance_single_lanes(microbatches: list[tuple[SpGroup, ...]], lanes: list[list[tuple[int, ...]]],
                           lengths: np.ndarray, sc: ShapeCost, num_lanes: int, pp: int = 1, passes: int = 1
                           ) -> tuple[list[tuple[SpGroup, ...]], list[list[tuple[int, ...]]]]:
    """Re-deal each microbatch's 1-lane groups over their lanes, given when those lanes become free.

    FlexSP balances each microbatch on its own; under contract 2 a lane whose earlier groups
    were short starts the next microbatch early. For the docs of a microbatch's 1-lane groups:
    longest first onto the lane (among those lanes) that would finish it earliest and still
    has room under ``max_tokens_per_lane`` (where that greedy deal leaves a doc without room,
    the microbatch keeps its 1-lane groups). Larger groups keep their docs and lanes.
    With ``passes > 1`` a lane may open up to ``passes`` 1-lane groups (each paying
    ``microbatch_ms``) where that finishes a doc earlier: a lane that is free early takes a second
    group of short docs instead of a late lane holding them (its 2nd .. groups go into extra
    microbatches right after this one). ``lengths`` ``[n]`` are indexed by the groups' doc indices.
    """
    finish = np.zeros(num_lanes)  # [num_lanes] ms, the lane recurrence as in place_lanes
    out_mbs: list[tuple[SpGroup, ...]] = []
    out_lanes: list[list[tuple[int, ...]]] = []
    for groups, placed in zip(microbatches, lanes):
        kept, kept_lanes, docs, free = [], [], [], []
        for g, ln in zip(groups, placed):
            if g.degree == 1:
                docs.extend(g.docs)
                free.append(ln[0])
                continue
            idx = list(ln)
            finish[idx] = finish[idx].max() + g.ms / pp
            kept.append(g)
            kept_lanes.append(ln)
        extra: list[list[tuple[SpGroup, tuple[int, ...]]]] = []
        if docs:
            single = [[(g, ln) for g, ln in zip(groups, placed) if g.degree == 1]]
            dealt = _redeal(docs, free, finish, lengths, sc, pp, passes) or single
            for k, part in enumerate(dealt):
                for g, ln in part:
                    finish[ln[0]] += g.ms / pp
                    if k == 0:
                        kept.append(g)
                        kept_lanes.append(ln)
                if k:
                    extra.append(part)
        out_mbs.append(tuple(kept))
        out_lanes.append(kept_lanes)
        for part in extra:
            out_mbs.append(tuple(g for g, _ in part))
            out_lanes.append([ln for _, ln in part])
    return out_mbs, out_lanes


def _redeal(docs: list[int], free: list[int], finish: np.ndarray, lengths: np.ndarray, sc: ShapeCost,
            pp: int, passes: int = 1) -> list[list[tuple[SpGroup, tuple[int, ...]]]] | None:
    """``docs`` longest first onto the lane of ``free`` that would finish it earliest with room (in its
    last group, or in a new one while it has fewer than ``passes``); per pass ``k`` the groups of every
    lane's ``k``-th group. ``None`` when this greedy deal leaves a doc without room (the original groups
    are kept then)."""
    cap = sc.max_tokens_per_lane
    beta = sc.microbatch_ms
    work = np.asarray(sc.compute_ms(lengths[docs].astype(np.float64)))  # [k]
    free_arr = np.asarray(free, dtype=np.int64)
    nf = len(free)
    held = np.zeros(nf)  # [lanes] ms of this microbatch's groups on each lane (beta included)
    tok = np.zeros(nf, dtype=np.int64)  # [lanes] tokens of each lane's last group
    ngroups = np.zeros(nf, dtype=np.int64)  # [lanes]
    members: list[list[list[int]]] = [[] for _ in free]  # [lane][group] doc indices
    loads: list[list[float]] = [[] for _ in free]  # [lane][group] work ms
    for k in np.lexsort((np.asarray(docs), -work)):
        i = docs[int(k)]
        # into the lane's last group (its first one pays beta), or into a new group (another beta)
        same = (ngroups == 0) | (tok + lengths[i] <= cap)
        end_same = np.where(same, finish[free_arr] + (held + work[k] + (ngroups == 0) * beta) / pp, np.inf)
        more = (ngroups >= 1) & (ngroups < passes)
        end_new = np.where(more, finish[free_arr] + (held + beta + work[k]) / pp, np.inf)
        j_same, j_new = int(np.argmin(end_same)), int(np.argmin(end_new))
        if not np.isfinite(end_same[j_same]) and not np.isfinite(end_new[j_new]):
            return None
        if end_same[j_same] <= end_new[j_new]:
            j = j_same
            if ngroups[j] == 0:
                ngroups[j] = 1
                held[j] += beta
                members[j].append([])
                loads[j].append(0.0)
        else:
            j = j_new
            ngroups[j] += 1
            held[j] += beta
            tok[j] = 0
            members[j].append([])
            loads[j].append(0.0)
        held[j] += work[k]
        tok[j] += lengths[i]
        members[j][-1].append(int(i))
        loads[j][-1] += float(work[k])
    out: list[list[tuple[SpGroup, tuple[int, ...]]]] = [[] for _ in range(int(ngroups.max(initial=1)))]
    for j, lane in enumerate(free):
        for p_, (mem, load) in enumerate(zip(members[j], loads[j])):
            out[p_].append((SpGroup(degree=1, docs=tuple(mem), ms=float(beta + load)), (lane,)))
    return out
