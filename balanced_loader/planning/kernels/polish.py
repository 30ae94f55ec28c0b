"""Local search over the one-lane passes that end a plan's lanes (hydra's portfolio polishes its winner).

After a lane's last group of several lanes, its one-lane passes run back to back, so the lane finishes at
``base + sum over its passes of (beta + work)``; moving docs among those *tail* passes changes only the
two lanes involved. :func:`polish_tail_kernel` repeatedly takes the lane that finishes last and applies
the best of: moving one of its docs into another lane's pass with token room, into a new pass on the lane
that finishes first (one more ``beta``), or swapping it with a doc of another lane (both passes within the
cap); a move is taken only when both lanes then finish before the last lane did. It stops when the last
lane has no such move or after ``max_moves``. The pure-Python reference is
:func:`polish_tail_reference` (below).
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
