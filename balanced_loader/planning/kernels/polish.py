"""Local search over the one-lane passes that end a plan's lanes (hydra's portfolio polishes its winner).

After a lane's last group of several lanes, its one-lane passes run back to back, so the lane finishes at
``base + sum over its passes of (beta + work)``; moving docs among those *tail* passes changes only the
two lanes involved. :func:`polish_tail_kernel` repeatedly takes the lane that finishes last and applies
the best of: moving one of its docs into another lane's pass with token room, into a new pass on the lane
that finishes first (one more ``beta``), or swapping it with a doc of another lane (both passes within the
cap); a move is taken only when both lanes then finish before the last lane did. It stops when the last
lane has no such move or after ``max_moves``. The pure-Python reference is
:func:`polish_tail_reference` (below).

:func:`polish_groups_kernel` does the same over every group of a plan, wide ones included: a group keeps its
block and its place in the order of contract 2 (microbatch, then first lane), so a doc moved into another group
runs at that group's degree. It repeatedly takes the lane that finishes last and applies the best move of one of
the docs of its groups into another group with token room, or swap with a doc of another group, by the step
time of the whole plan (every group starts once all its lanes are free), while that time falls. A group left
empty costs nothing (no ``beta``). Each step evaluation visits every group's lanes; the search stops when it
has visited ``budget`` lanes in all (a count, never the clock: the plan stays a pure function of its inputs).
Its reference is :func:`polish_groups_reference`.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def polish_tail_kernel(tok, work, lane, pas, base, beta, cap, max_moves):
    """Tail docs ``[t]`` (tokens, work ms, lane, pass id ``0 .. P-1``) over lanes finishing their other groups at
    ``base`` ``[L]``: returns ``(lane [t], pass [t])`` after the search (module docstring); new passes get
    ids ``P, P + 1, ..``."""
    t = tok.shape[0]
    nl = base.shape[0]
    lane = lane.copy()
    pas = pas.copy()
    cap_p = t + (pas.max() + 1 if t else 0)  # room for one new pass per move at most
    ptok = np.zeros(cap_p, np.int64)
    pwork = np.zeros(cap_p, np.float64)
    pcount = np.zeros(cap_p, np.int64)
    plane = np.full(cap_p, -1, np.int64)
    npass = pas.max() + 1 if t else 0
    for i in range(t):
        ptok[pas[i]] += tok[i]
        pwork[pas[i]] += work[i]
        pcount[pas[i]] += 1
        plane[pas[i]] = lane[i]
    load = base.copy()
    for p in range(npass):
        if pcount[p] > 0:
            load[plane[p]] += beta + pwork[p]
    for _ in range(max_moves):
        a = 0
        for x in range(nl):
            if load[x] > load[a]:
                a = x
        top = load[a]
        lo = 0
        for x in range(nl):
            if load[x] < load[lo]:
                lo = x
        best = top - 1e-9 * max(1.0, top)
        kind = -1
        bi = -1
        bq = -1
        for i in range(t):
            if lane[i] != a:
                continue
            p = pas[i]
            drop = work[i] + (beta if pcount[p] == 1 else 0.0)
            na = top - drop
            for q in range(npass):  # into another lane's pass with room
                if pcount[q] == 0 or plane[q] == a or ptok[q] + tok[i] > cap:
                    continue
                m = max(na, load[plane[q]] + work[i])
                if m < best:
                    best, kind, bi, bq = m, 0, i, q
            if lo != a:  # into a new pass on the lane that finishes first
                m = max(na, load[lo] + beta + work[i])
                if m < best:
                    best, kind, bi, bq = m, 1, i, lo
            for j in range(t):  # swap with a doc of another lane
                b = lane[j]
                if b == a:
                    continue
                q = pas[j]
                if ptok[p] - tok[i] + tok[j] > cap or ptok[q] - tok[j] + tok[i] > cap:
                    continue
                m = max(top - work[i] + work[j], load[b] - work[j] + work[i])
                if m < best:
                    best, kind, bi, bq = m, 2, i, j
        if kind < 0:
            break
        i = bi
        p = pas[i]
        if kind == 2:
            j = bq
            q = pas[j]
            b = lane[j]
            load[a] += work[j] - work[i]
            load[b] += work[i] - work[j]
            ptok[p] += tok[j] - tok[i]
            ptok[q] += tok[i] - tok[j]
            pwork[p] += work[j] - work[i]
            pwork[q] += work[i] - work[j]
            pas[i], pas[j] = q, p
            lane[i], lane[j] = b, a
            continue
        load[a] -= work[i]
        ptok[p] -= tok[i]
        pwork[p] -= work[i]
        pcount[p] -= 1
        if pcount[p] == 0:
            load[a] -= beta
        if kind == 0:
            q = bq
        else:
            q = npass
            npass += 1
            plane[q] = bq
            load[bq] += beta
        b = plane[q]
        load[b] += work[i]
        ptok[q] += tok[i]
        pwork[q] += work[i]
        pcount[q] += 1
        pas[i] = q
        lane[i] = b
    return lane, pas


def polish_tail_reference(tok, work, lane, pas, base, beta: float, cap: int, max_moves: int):
    """Pure-Python twin of :func:`polish_tail_kernel` (same scan order,
    same strict comparisons)."""
    t, nl = len(tok), len(base)
    lane, pas = [int(x) for x in lane], [int(x) for x in pas]
    npass = max(pas) + 1 if t else 0
    ptok, pwork, pcount, plane = [0] * (npass + t), [0.0] * (npass + t), [0] * (npass + t), [-1] * (npass + t)
    for i in range(t):
        ptok[pas[i]] += int(tok[i])
        pwork[pas[i]] += float(work[i])
        pcount[pas[i]] += 1
        plane[pas[i]] = lane[i]
    load = [float(x) for x in base]
    for p in range(npass):
        if pcount[p]:
            load[plane[p]] += beta + pwork[p]
    for _ in range(max_moves):
        a = max(range(nl), key=lambda x: (load[x], -x))
        lo = min(range(nl), key=lambda x: (load[x], x))
        top = load[a]
        best, move = top - 1e-9 * max(1.0, top), None
        for i in (i for i in range(t) if lane[i] == a):
            p = pas[i]
            na = top - float(work[i]) - (beta if pcount[p] == 1 else 0.0)
            for q in range(npass):
                if pcount[q] and plane[q] != a and ptok[q] + tok[i] <= cap:
                    m = max(na, load[plane[q]] + float(work[i]))
                    if m < best:
                        best, move = m, (0, i, q)
            if lo != a:
                m = max(na, load[lo] + beta + float(work[i]))
                if m < best:
                    best, move = m, (1, i, lo)
            for j in range(t):
                b, q = lane[j], pas[j]
                if b == a or ptok[p] - tok[i] + tok[j] > cap or ptok[q] - tok[j] + tok[i] > cap:
                    continue
                m = max(top - float(work[i]) + float(work[j]), load[b] - float(work[j]) + float(work[i]))
                if m < best:
                    best, move = m, (2, i, j)
        if move is None:
            break
        kind, i, x = move
        p = pas[i]
        if kind == 2:
            j, q, b = x, pas[x], lane[x]
            dw, dt = float(work[j]) - float(work[i]), int(tok[j]) - int(tok[i])
            load[a] += dw
            load[b] -= dw
            ptok[p] += dt
            ptok[q] -= dt
            pwork[p] += dw
            pwork[q] -= dw
            pas[i], pas[j], lane[i], lane[j] = q, p, b, a
            continue
        load[a] -= float(work[i])
        ptok[p] -= int(tok[i])
        pwork[p] -= float(work[i])
        pcount[p] -= 1
        if pcount[p] == 0:
            load[a] -= beta
        if kind == 0:
            q = x
        else:
            q, npass = npass, npass + 1
            plane[q] = x
            load[x] += beta
        b = plane[q]
        load[b] += float(work[i])
        ptok[q] += int(tok[i])
        pwork[q] += float(work[i])
        pcount[q] += 1
        pas[i], lane[i] = q, b
    return np.asarray(lane, dtype=np.int64), np.asarray(pas, dtype=np.int64)


@njit(cache=True)
def _groups_step(gl0, gdeg, gsum, gcnt, beta, finish, a, sum_a, cnt_a, b, sum_b, cnt_b):
    """Contract-2 step time of groups in order (first lane ``gl0`` ``[G]``, lanes ``gdeg``, summed segments
    ``gsum``, docs ``gcnt``; empty ones skipped) with groups ``a`` and ``b`` (``-1``: none) taken as
    ``(sum_a, cnt_a)`` and ``(sum_b, cnt_b)``; ``finish`` ``[lanes]`` is overwritten with each lane's finish."""
    finish[:] = 0.0
    for g in range(gl0.shape[0]):
        t, c = gsum[g], gcnt[g]
        if g == a:
            t, c = sum_a, cnt_a
        elif g == b:
            t, c = sum_b, cnt_b
        if c == 0:
            continue
        start = 0.0
        for x in range(gl0[g], gl0[g] + gdeg[g]):
            if finish[x] > start:
                start = finish[x]
        end = start + beta + t
        for x in range(gl0[g], gl0[g] + gdeg[g]):
            finish[x] = end
    top = 0.0
    for x in range(finish.shape[0]):
        if finish[x] > top:
            top = finish[x]
    return top


@njit(cache=True)
def polish_groups_kernel(gl0, gdeg, glev, item_g, tok, seg, beta, cap, lanes, budget):
    """Docs ``[n]`` (tokens ``tok``, group ``item_g``, segment ms ``seg`` ``[n, levels]`` at each level, ``inf``
    where the doc does not fit) in groups ``[G]`` in contract-2 order (first lane ``gl0``, lanes ``gdeg``, level
    ``glev``); returns each doc's group after the search (module docstring)."""
    n = item_g.shape[0]
    ng = gl0.shape[0]
    item_g = item_g.copy()
    gtok = np.zeros(ng, np.int64)
    gsum = np.zeros(ng, np.float64)
    gcnt = np.zeros(ng, np.int64)
    for i in range(n):
        g = item_g[i]
        gtok[g] += tok[i]
        gsum[g] += seg[i, glev[g]]
        gcnt[g] += 1
    slots = 0  # lanes one evaluation visits
    for g in range(ng):
        slots += gdeg[g]
    finish = np.zeros(lanes)
    scratch = np.zeros(lanes)
    block_end = np.zeros(ng)  # [G] the latest finish over each group's lanes
    spent = 0
    while spent < budget:
        top = _groups_step(gl0, gdeg, gsum, gcnt, beta, finish, -1, 0.0, 0, -1, 0.0, 0)
        spent += slots
        last = 0
        for x in range(lanes):
            if finish[x] > finish[last]:
                last = x
        for g in range(ng):
            m = 0.0
            for x in range(gl0[g], gl0[g] + gdeg[g]):
                if finish[x] > m:
                    m = finish[x]
            block_end[g] = m
        best = top - 1e-9 * max(1.0, top)
        kind = -1
        bi = -1
        bx = -1
        for i in range(n):
            a = item_g[i]
            if not (gl0[a] <= last < gl0[a] + gdeg[a]) or spent >= budget:
                continue
            sa = seg[i, glev[a]]
            if not best > top - sa:  # a group made shorter by sa ends at most sa earlier, and so does the step
                continue
            for b in range(ng):  # move into another group with room
                if b == a or gcnt[b] == 0 or gtok[b] + tok[i] > gdeg[b] * cap:
                    continue
                sb = seg[i, glev[b]]
                on_last = gl0[b] <= last < gl0[b] + gdeg[b]
                if not on_last and block_end[b] + sb >= best:  # its lanes would end after the best so far
                    continue
                if spent >= budget:
                    break
                m = _groups_step(gl0, gdeg, gsum, gcnt, beta, scratch, a, gsum[a] - sa, gcnt[a] - 1, b,
                                 gsum[b] + sb, gcnt[b] + 1)
                spent += slots
                if m < best:
                    best, kind, bi, bx = m, 0, i, b
            for j in range(n):  # swap with a doc of another group
                b = item_g[j]
                if b == a or gtok[a] - tok[i] + tok[j] > gdeg[a] * cap or gtok[b] - tok[j] + tok[i] > gdeg[b] * cap:
                    continue
                da = seg[j, glev[a]] - sa
                if not da < 0.0:  # group a must get shorter
                    continue
                db = seg[i, glev[b]] - seg[j, glev[b]]
                if not best > top + da + min(db, 0.0):
                    continue
                on_last = gl0[b] <= last < gl0[b] + gdeg[b]
                if not on_last and block_end[b] + db >= best:
                    continue
                if spent >= budget:
                    break
                m = _groups_step(gl0, gdeg, gsum, gcnt, beta, scratch, a, gsum[a] + da, gcnt[a], b, gsum[b] + db,
                                 gcnt[b])
                spent += slots
                if m < best:
                    best, kind, bi, bx = m, 1, i, j
        if kind < 0:
            break
        i = bi
        a = item_g[i]
        if kind == 0:
            b = bx
            gsum[a] -= seg[i, glev[a]]
            gsum[b] += seg[i, glev[b]]
            gtok[a] -= tok[i]
            gtok[b] += tok[i]
            gcnt[a] -= 1
            gcnt[b] += 1
            item_g[i] = b
        else:
            j = bx
            b = item_g[j]
            gsum[a] += seg[j, glev[a]] - seg[i, glev[a]]
            gsum[b] += seg[i, glev[b]] - seg[j, glev[b]]
            gtok[a] += tok[j] - tok[i]
            gtok[b] += tok[i] - tok[j]
            item_g[i] = b
            item_g[j] = a
    return item_g


def polish_groups_reference(gl0, gdeg, glev, item_g, tok, seg, beta: float, cap: int, lanes: int, budget: int):
    """Pure-Python twin of :func:`polish_groups_kernel` (same scan order, same arithmetic, same budget)."""
    n, ng = len(item_g), len(gl0)
    item_g = [int(g) for g in item_g]
    gtok, gsum, gcnt = [0] * ng, [0.0] * ng, [0] * ng
    for i in range(n):
        g = item_g[i]
        gtok[g] += int(tok[i])
        gsum[g] += float(seg[i, glev[g]])
        gcnt[g] += 1
    slots = int(sum(int(d) for d in gdeg))

    def step(over: dict) -> list:
        finish = [0.0] * lanes
        for g in range(ng):
            t, c = over.get(g, (gsum[g], gcnt[g]))
            if c == 0:
                continue
            lo, hi = int(gl0[g]), int(gl0[g]) + int(gdeg[g])
            end = max(0.0, *finish[lo:hi]) + beta + t
            finish[lo:hi] = [end] * (hi - lo)
        return finish

    def holds(g: int, x: int) -> bool:
        return int(gl0[g]) <= x < int(gl0[g]) + int(gdeg[g])

    spent = 0
    while spent < budget:
        finish = step({})
        spent += slots
        top = max(0.0, *finish)
        last = max(range(lanes), key=lambda x: (finish[x], -x))
        block_end = [max(0.0, *finish[int(gl0[g]):int(gl0[g]) + int(gdeg[g])]) for g in range(ng)]
        best, move = top - 1e-9 * max(1.0, top), None
        for i in range(n):
            a = item_g[i]
            if not holds(a, last) or spent >= budget:
                continue
            sa = float(seg[i, glev[a]])
            if not best > top - sa:
                continue
            for b in range(ng):
                if b == a or gcnt[b] == 0 or gtok[b] + tok[i] > gdeg[b] * cap:
                    continue
                sb = float(seg[i, glev[b]])
                if not holds(b, last) and block_end[b] + sb >= best:
                    continue
                if spent >= budget:
                    break
                m = max(0.0, *step({a: (gsum[a] - sa, gcnt[a] - 1), b: (gsum[b] + sb, gcnt[b] + 1)}))
                spent += slots
                if m < best:
                    best, move = m, (0, i, b)
            for j in range(n):
                b = item_g[j]
                if b == a or gtok[a] - tok[i] + tok[j] > gdeg[a] * cap or gtok[b] - tok[j] + tok[i] > gdeg[b] * cap:
                    continue
                da = float(seg[j, glev[a]]) - sa
                if not da < 0.0:
                    continue
                db = float(seg[i, glev[b]]) - float(seg[j, glev[b]])
                if not best > top + da + min(db, 0.0):
                    continue
                if not holds(b, last) and block_end[b] + db >= best:
                    continue
                if spent >= budget:
                    break
                m = max(0.0, *step({a: (gsum[a] + da, gcnt[a]), b: (gsum[b] + db, gcnt[b])}))
                spent += slots
                if m < best:
                    best, move = m, (1, i, j)
        if move is None:
            break
        kind, i, x = move
        a = item_g[i]
        if kind == 0:
            b = x
            gsum[a] -= float(seg[i, glev[a]])
            gsum[b] += float(seg[i, glev[b]])
            gtok[a] -= int(tok[i])
            gtok[b] += int(tok[i])
            gcnt[a] -= 1
            gcnt[b] += 1
            item_g[i] = b
        else:
            j, b = x, item_g[x]
            gsum[a] += float(seg[j, glev[a]]) - float(seg[i, glev[a]])
            gsum[b] += float(seg[i, glev[b]]) - float(seg[j, glev[b]])
            gtok[a] += int(tok[j]) - int(tok[i])
            gtok[b] += int(tok[i]) - int(tok[j])
            item_g[i], item_g[j] = b, a
    return np.asarray(item_g, dtype=np.int64)
