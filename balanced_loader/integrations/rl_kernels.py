"""Numba kernels of :func:`balanced_loader.balance`, each with a pure-Python reference (same ties).

* :func:`~balanced_loader.integrations.rl_kk.grouped_kk_kernel` (its own module): verl's
  equal-size Karmarkar-Karp, exactly.
* :func:`exchange_kernel`: moves and swaps between the heaviest rank and lighter ones until none
  lowers the heaviest load.
* :func:`microbatch_kernel`: each rank's items into microbatches under a token cap:
  first-fit-decreasing to find the counts, then (with equal counts, the largest count on every
  rank) longest first into the microbatch of least work with room.

:func:`balance_kernel` chains them (one call, no Python between the steps); the tests compare every
kernel with its ``*_reference`` on random inputs, and ``balance_kernel`` with the chain of those.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.integrations.rl_kk import grouped_kk_kernel
from balanced_loader.planning.kernels.order import argsort_stable, order_desc
from balanced_loader.planning.kernels.place import block_place_kernel

# ------------------------------------------------------------------------------------------
# pairwise exchange
# ------------------------------------------------------------------------------------------
#
# One round: ``h`` = heaviest rank (ties: lowest index). For the other ranks ``l`` by ascending
# load (ties: lower index) while ``load[l] < load[h]``, with ``gap = load[h] - load[l]``, find the
# exchange whose transferred work ``d`` (an item's work for a move, ``w_i - w_j`` for a swap of
# item ``i`` of ``h`` with item ``j`` of ``l``) satisfies ``0 < d < gap`` and is nearest ``gap / 2``
# (ties: moves before swaps, then lower ``i``, then lower ``j``). The first ``l`` with one applies
# it: both ranks end strictly below the old ``load[h]``, so the sorted loads fall
# lexicographically and the loop ends; it also stops after ``max_rounds``.


@njit(cache=True)
def _best_exchange(work, items_h, items_l, sorted_l, gap):
    """(score, i, j) of the best move (j = -1) or swap; score = |d - gap/2|, inf when none."""
    half = gap / 2.0
    best = np.inf
    bi = -1
    bj = -1
    for t in range(items_h.shape[0]):  # moves (items_h ascending: the first of equal scores is the lowest i)
        i = items_h[t]
        d = work[i]
        if 0.0 < d < gap:
            s = abs(d - half)
            if s < best:
                best, bi, bj = s, i, -1
    m = sorted_l.shape[0]
    for t in range(items_h.shape[0]):  # swaps: for item i, the j of l with w_j nearest w_i - gap/2
        i = items_h[t]
        want = work[i] - half
        lo, hi = 0, m
        while lo < hi:  # first position with work >= want
            mid = (lo + hi) // 2
            if work[items_l[sorted_l[mid]]] < want:
                lo = mid + 1
            else:
                hi = mid
        below = lo - 1
        # why: equal works sort by index, and a tie goes to the lower j: take the first of the run below
        while below > 0 and work[items_l[sorted_l[below - 1]]] == work[items_l[sorted_l[below]]]:
            below -= 1
        for p in (below, lo):
            if p < 0 or p >= m:
                continue
            j = items_l[sorted_l[p]]
            d = work[i] - work[j]
            if 0.0 < d < gap:
                s = abs(d - half)
                if s < best or (s == best and bj >= 0 and (i < bi or (i == bi and j < bj))):
                    best, bi, bj = s, i, j
    return best, bi, bj


@njit(cache=True)
def _drop(members, count, r, item):
    """Remove ``item`` from rank ``r``'s member list, keeping the list ascending."""
    c = count[r]
    p = 0
    while members[r, p] != item:
        p += 1
    for q in range(p, c - 1):
        members[r, q] = members[r, q + 1]
    count[r] = c - 1


@njit(cache=True)
def _add(members, count, r, item):
    """Insert ``item`` into rank ``r``'s ascending member list."""
    c = count[r]
    p = c
    while p > 0 and members[r, p - 1] > item:
        members[r, p] = members[r, p - 1]
        p -= 1
    members[r, p] = item
    count[r] = c + 1


@njit(cache=True)
def exchange_kernel(work, part, k, max_rounds):
    """Moves and swaps that lower the heaviest of ``k`` ranks; returns (part ``[n]``, load ``[k]``, rounds)."""
    n = work.shape[0]
    part = part.copy()
    load = np.zeros(k)
    count = np.zeros(k, np.int64)
    for i in range(n):
        load[part[i]] += work[i]
        count[part[i]] += 1
    # why member lists: a round looks at two ranks' items, O(n / k) each, instead of scanning all n;
    # a round moves at most one item onto a rank, so rows of the largest count + max_rounds never overflow
    width = min(n, count.max() + max(max_rounds, 0))
    members = np.empty((k, width), np.int64)  # [k][width] each rank's items, ascending (the first count[r])
    fill = np.zeros(k, np.int64)
    for i in range(n):
        r = part[i]
        members[r, fill[r]] = i
        fill[r] += 1
    wl = np.empty(n)
    tried = np.zeros(k, np.bool_)
    rounds = 0
    while rounds < max_rounds:
        h = 0
        for r in range(1, k):
            if load[r] > load[h]:
                h = r
        items_h = members[h, :count[h]].copy()
        tried[:] = False
        tried[h] = True
        done = False
        for _ in range(k - 1):
            # the next lightest untried rank (ties: lower index); usually the first one takes an exchange,
            # so this beats sorting all k loads every round
            lr = -1
            for r in range(k):
                if not tried[r] and (lr < 0 or load[r] < load[lr]):
                    lr = r
            tried[lr] = True
            if not load[lr] < load[h]:
                break
            gap = load[h] - load[lr]
            nl = count[lr]
            items_l = members[lr, :nl]
            for p in range(nl):
                wl[p] = work[items_l[p]]
            sorted_l = argsort_stable(wl[:nl])
            _, bi, bj = _best_exchange(work, items_h, items_l, sorted_l, gap)
            if bi < 0:
                continue
            d = work[bi] - (work[bj] if bj >= 0 else 0.0)
            part[bi] = lr
            _drop(members, count, h, bi)
            _add(members, count, lr, bi)
            if bj >= 0:
                part[bj] = h
                _drop(members, count, lr, bj)
                _add(members, count, h, bj)
            load[h] -= d
            load[lr] += d
            done = True
            break
        rounds += 1
        if not done:
            break
    return part, load, rounds


def exchange_reference(work, part, k: int, max_rounds: int) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`exchange_kernel` in plain Python (linear scans, the same ties)."""
    w = [float(x) for x in work]
    part = [int(p) for p in part]
    load = [0.0] * k
    for i, p in enumerate(part):
        load[p] += w[i]
    rounds = 0
    while rounds < max_rounds:
        h = max(range(k), key=lambda r: (load[r], -r))
        items_h = [i for i, p in enumerate(part) if p == h]
        done = False
        for lr in sorted(range(k), key=lambda r: (load[r], r)):
            if lr == h:
                continue
            if not load[lr] < load[h]:
                break
            gap = load[h] - load[lr]
            items_l = [i for i, p in enumerate(part) if p == lr]
            cands = [(abs(w[i] - gap / 2), 0, i, -1) for i in items_h if 0.0 < w[i] < gap]
            # every j of l: the kernel looks only at the two neighbours of w_i - gap/2, the nearest ones
            cands += [(abs(w[i] - w[j] - gap / 2), 1, i, j) for i in items_h for j in items_l
                      if 0.0 < w[i] - w[j] < gap]
            if not cands:
                continue
            _, _, bi, bj = min(cands)
            d = w[bi] - (w[bj] if bj >= 0 else 0.0)
            part[bi] = lr
            if bj >= 0:
                part[bj] = h
            load[h] -= d
            load[lr] += d
            done = True
            break
        rounds += 1
        if not done:
            break
    return np.asarray(part, dtype=np.int64), np.asarray(load, dtype=np.float64), rounds


# ------------------------------------------------------------------------------------------
# microbatches per rank
# ------------------------------------------------------------------------------------------


@njit(cache=True)
def microbatch_kernel(lengths, work, part, k, cap, equal_counts):
    """Microbatch of every item ``[n]`` and the count of every rank ``[k]``; no microbatch over ``cap``.

    Items go longest first (ties: lower index). First-fit-decreasing per rank gives its count
    ``f_r``; the counts are ``max f`` on every rank with ``equal_counts``, else ``f_r``. Then each
    item goes to its rank's microbatch of least work (ties: lower index) with room. A rank where
    that runs out of room keeps its FFD microbatches (``f_r`` <= its count) and fills the empty ones
    by moving the longest item of the microbatch with the most items (ties: lower index) while it
    has two or more.
    """
    n = lengths.shape[0]
    order = order_desc(lengths)  # [n]
    per = np.zeros(k, np.int64)
    for i in range(n):
        per[part[i]] += 1
    width = 1
    for r in range(k):
        width = max(width, per[r])
    room = np.full((k, width), cap, np.int64)  # [k][width] FFD rooms
    ffd = np.empty(n, np.int64)
    used = np.zeros(k, np.int64)
    for t in range(n):
        i = order[t]
        r = part[i]
        b = 0
        while b < used[r] and room[r, b] < lengths[i]:
            b += 1
        if b == used[r]:
            used[r] += 1
        room[r, b] -= lengths[i]
        ffd[i] = b
    counts = np.empty(k, np.int64)
    top = 1
    for r in range(k):
        top = max(top, used[r])
    for r in range(k):
        counts[r] = top if equal_counts else max(used[r], 1)
    load = np.zeros((k, top))
    room2 = np.full((k, top), cap, np.int64)
    mb = np.empty(n, np.int64)
    failed = np.zeros(k, np.bool_)
    for t in range(n):
        i = order[t]
        r = part[i]
        if failed[r]:
            continue
        best = -1
        for b in range(counts[r]):
            if room2[r, b] >= lengths[i] and (best < 0 or load[r, b] < load[r, best]):
                best = b
        if best < 0:
            failed[r] = True
            continue
        mb[i] = best
        load[r, best] += work[i]
        room2[r, best] -= lengths[i]
    for r in range(k):
        if not failed[r]:
            continue
        sizes = np.zeros(counts[r], np.int64)
        for t in range(n):
            i = order[t]
            if part[i] == r:
                mb[i] = ffd[i]
                sizes[ffd[i]] += 1
        for b in range(used[r], counts[r]):
            donor = 0
            for c in range(counts[r]):
                if sizes[c] > sizes[donor]:
                    donor = c
            if sizes[donor] < 2:
                break
            for t in range(n):  # the donor's longest item: the first of it in the longest-first order
                i = order[t]
                if part[i] == r and mb[i] == donor:
                    mb[i] = b
                    sizes[donor] -= 1
                    sizes[b] += 1
                    break
    return mb, counts


def microbatch_reference(lengths, work, part, k: int, cap: int, equal_counts: bool) -> tuple[np.ndarray, np.ndarray]:
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    rooms: list[list[int]] = [[] for _ in range(k)]
    ffd = [0] * n
    for i in order:
        r, s = int(part[i]), int(lengths[i])
        b = next((b for b, x in enumerate(rooms[r]) if x >= s), len(rooms[r]))
        if b == len(rooms[r]):
            rooms[r].append(cap)
        rooms[r][b] -= s
        ffd[i] = b
    used = [len(x) for x in rooms]
    top = max([1, *used])
    counts = [top if equal_counts else max(u, 1) for u in used]
    load = [[0.0] * c for c in counts]
    room2 = [[cap] * c for c in counts]
    mb = [0] * n
    failed = [False] * k
    for i in order:
        r, s = int(part[i]), int(lengths[i])
        if failed[r]:
            continue
        fits = [b for b in range(counts[r]) if room2[r][b] >= s]
        if not fits:
            failed[r] = True
            continue
        best = min(fits, key=lambda b: (load[r][b], b))
        mb[i] = best
        load[r][best] += float(work[i])
        room2[r][best] -= s
    for r in range(k):
        if not failed[r]:
            continue
        mine = [i for i in order if part[i] == r]
        for i in mine:
            mb[i] = ffd[i]
        for b in range(used[r], counts[r]):
            sizes = [sum(mb[i] == c for i in mine) for c in range(counts[r])]
            donor = max(range(counts[r]), key=lambda c: (sizes[c], -c))
            if sizes[donor] < 2:
                break
            mb[next(i for i in mine if mb[i] == donor)] = b
    return np.asarray(mb, dtype=np.int64), np.asarray(counts, dtype=np.int64)


# ------------------------------------------------------------------------------------------
# the whole of balance()
# ------------------------------------------------------------------------------------------


@njit(cache=True)
def balance_kernel(lengths, work, k, cap, equal_counts, rounds):
    """(rank ``[n]``, microbatch ``[n]``, counts ``[k]``, items ``[n]``, bounds ``[sum(counts) + 1]``) of
    :func:`balanced_loader.balance`: ``items[bounds[s]:bounds[s + 1]]`` are the indices (ascending) of
    slot ``s``, the rank-major, microbatch-minor numbering of all microbatches.

    Ranks: longest-processing-time (``block_place_kernel`` on one-lane blocks, heaviest first, ties
    by index) then :func:`exchange_kernel`, kept when its heaviest rank is no heavier than verl's
    partition (:func:`grouped_kk_kernel`); else that partition improved by :func:`exchange_kernel`.
    Then :func:`microbatch_kernel`.
    """
    n = work.shape[0]
    if k > 1:
        verl = grouped_kk_kernel(work, k)
        verl_load = np.zeros(k)
        for i in range(n):
            verl_load[verl[i]] += work[i]
        order = argsort_stable(-work)  # [n] heaviest first (ties: lower index)
        times = np.empty((n, 1))  # [n][1] one-lane blocks only
        for t in range(n):
            times[t, 0] = work[order[t]]
        lanes = block_place_kernel(times, np.zeros(n, np.int64), np.zeros(k), np.zeros(k, np.int64), np.inf)[1]
        start = np.empty(n, np.int64)
        for t in range(n):
            start[order[t]] = lanes[t]
        part, load, _ = exchange_kernel(work, start, k, rounds)
        if load.max() > verl_load.max():
            part = exchange_kernel(work, verl, k, rounds)[0]
    else:
        part = np.zeros(n, np.int64)
    mb, counts = microbatch_kernel(lengths, work, part, k, cap, equal_counts)
    # the items grouped by (rank, microbatch), ascending inside each: a counting sort by slot
    first = np.zeros(k + 1, np.int64)  # [k + 1] slot of each rank's microbatch 0
    for r in range(k):
        first[r + 1] = first[r] + counts[r]
    bounds = np.zeros(first[k] + 1, np.int64)  # [slots + 1]
    for i in range(n):
        bounds[first[part[i]] + mb[i] + 1] += 1
    for b in range(first[k]):
        bounds[b + 1] += bounds[b]
    fill = bounds[:-1].copy()
    items = np.empty(n, np.int64)  # [n] indices, slot by slot
    for i in range(n):
        b = first[part[i]] + mb[i]
        items[fill[b]] = i
        fill[b] += 1
    return part, mb, counts, items, bounds
