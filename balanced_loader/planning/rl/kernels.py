"""Numba kernels of :func:`balanced_loader.balance`, each with a pure-Python reference (same ties).

* :func:`~balanced_loader.planning.kernels.karmarkar_karp.grouped_kk_kernel` (beside the other Karmarkar-Karp
  kernel): verl's equal-size Karmarkar-Karp, exactly.
* :func:`exchange_kernel`: moves and swaps between the heaviest rank and lighter ones until none
  lowers the heaviest load.
* :func:`microbatch_kernel`: each rank's items into microbatches under a token cap:
  first-fit-decreasing to find the counts, then (with equal counts, the largest count on every
  rank) longest first into the microbatch of least work with room.
* :func:`lpt_kernel`: heaviest first onto the least loaded rank (the exchanges' first start).

:func:`balance_kernel` chains them (one call, no Python between the steps); the tests compare every
kernel with its ``*_reference`` on random inputs, and ``balance_kernel`` with the chain of those.

**Cost.** Near-linear in the rollouts and the ranks, so 10^7 rollouts or 10^5 ranks plan in
seconds (``docs/results/reliability3.md``): binary heaps of (load, rank) instead of scans over the
ranks (LPT, and each exchange round's heaviest and next lightest rank); each rank's members in a
growable flat pool (memory ``O(n + rounds)``, never ``ranks x (items + rounds)``); first-fit as
a descent of a max segment tree over a rank's bins; "least work with room" as a heap of the bins
with room for the current item (items come longest first, so a bin with room stays eligible) and
a heap by room of the others. Every choice and tie is the reference's.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.heaps import heap_pop, heap_push, pop2, push2, sift_down2
from balanced_loader.planning.kernels.karmarkar_karp import grouped_kk_kernel
from balanced_loader.planning.kernels.order import argsort_nonneg, order_desc

SCAN_RANKS = 256  # up to this many ranks an exchange round scans them (heaps beyond: O(log k) a step)

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
def _lower_bound(ws, m, want):
    """First position of the ascending ``ws[:m]`` with a value >= ``want`` (``m`` when none)."""
    lo, hi = 0, m
    while lo < hi:
        mid = (lo + hi) // 2
        if ws[mid] < want:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _best_exchange(items_h, wh, js, ws, gap):
    """(score, i, j) of the best move (j = -1) or swap; score = |d - gap/2|, inf when none. ``items_h`` (ascending)
    and ``wh``: the heavy rank's items and their works; ``js`` and ``ws``: the light rank's items sorted by work
    (ties by item) and their works (contiguous: the binary searches read no scattered memory)."""
    half = gap / 2.0
    best = np.inf
    bi = -1
    bj = -1
    for t in range(items_h.shape[0]):  # moves (items_h ascending: the first of equal scores is the lowest i)
        d = wh[t]
        if 0.0 < d < gap:
            s = abs(d - half)
            if s < best:
                best, bi, bj = s, items_h[t], -1
    m = js.shape[0]
    for t in range(items_h.shape[0]):  # swaps: for item i, the j of l with w_j nearest w_i - gap/2
        i = items_h[t]
        lo = _lower_bound(ws, m, wh[t] - half)  # first position with work >= want
        below = lo - 1
        # why: equal works sort by index, and a tie goes to the lower j: take the first of the run below
        if below > 0 and ws[below - 1] == ws[below]:
            below = _lower_bound(ws, below, ws[below])
        for p in (below, lo):
            if p < 0 or p >= m:
                continue
            j = js[p]
            d = wh[t] - ws[p]
            if 0.0 < d < gap:
                s = abs(d - half)
                if s < best or (s == best and bj >= 0 and (i < bi or (i == bi and j < bj))):
                    best, bi, bj = s, i, j
    return best, bi, bj


@njit(cache=True)
def _drop(pool, mstart, mcount, r, item):
    """Remove ``item`` from rank ``r``'s member list, keeping the list ascending."""
    a = mstart[r]
    c = mcount[r]
    p = 0
    while pool[a + p] != item:
        p += 1
    for q in range(p, c - 1):
        pool[a + q] = pool[a + q + 1]
    mcount[r] = c - 1


@njit(cache=True)
def _add(pool, end, mstart, mcap, mcount, r, item):
    """Insert ``item`` into rank ``r``'s ascending member list; a full list moves to the pool's end with twice
    the room (the pool doubles when that runs out). Returns ``(pool, end)``."""
    c = mcount[r]
    if c == mcap[r]:
        want = 2 * mcap[r] + 4
        if end + want > pool.shape[0]:
            bigger = np.empty(max(2 * pool.shape[0], end + want), np.int64)
            bigger[:end] = pool[:end]
            pool = bigger
        pool[end:end + c] = pool[mstart[r]:mstart[r] + c]
        mstart[r], mcap[r] = end, want
        end += want
    a = mstart[r]
    p = c
    while p > 0 and pool[a + p - 1] > item:
        pool[a + p] = pool[a + p - 1]
        p -= 1
    pool[a + p] = item
    mcount[r] = c + 1
    return pool, end


@njit(cache=True)
def exchange_kernel(work, part, k, max_rounds):
    """Moves and swaps that lower the heaviest of ``k`` ranks; returns (part ``[n]``, load ``[k]``, rounds)."""
    n = work.shape[0]
    part = part.copy()
    load = np.zeros(k)
    mcount = np.zeros(k, np.int64)
    for i in range(n):
        load[part[i]] += work[i]
        mcount[part[i]] += 1
    # each rank's members, ascending, in a flat pool (a round looks at two ranks' items, O(n / k) each)
    mcap = mcount + 2
    mstart = np.zeros(k, np.int64)
    for r in range(1, k):
        mstart[r] = mstart[r - 1] + mcap[r - 1]
    end = mstart[k - 1] + mcap[k - 1] if k > 0 else 0
    pool = np.empty(max(end, 1), np.int64)
    fill = mstart.copy()
    for i in range(n):
        r = part[i]
        pool[fill[r]] = i
        fill[r] += 1
    # the heaviest rank and the lighter ones in ascending order: scans over the ranks when they are few (cheaper
    # than heaps there), else heaps of (load, rank) with a version per rank (an entry whose version is old is
    # stale): the heaviest (key -load: ties to the lower index) and the lightest (key load)
    scan = k <= SCAN_RANKS
    ver = np.zeros(k, np.int64)
    room = 1 if scan else k + 2 * max(max_rounds, 0) + 2
    xk, xi, xv = np.empty(room), np.empty(room, np.int64), np.empty(room, np.int64)
    nk_, ni, nv = np.empty(room), np.empty(room, np.int64), np.empty(room, np.int64)
    xs = 0
    ns = 0
    if not scan:
        for r in range(k):
            xs = heap_push(xk, xi, xv, xs, -load[r], r, 0)
            ns = heap_push(nk_, ni, nv, ns, load[r], r, 0)
    tried = np.zeros(k if scan else 1, np.bool_)
    held_k = np.empty(1 if scan else k)  # entries popped from the light heap during a round, pushed back after it
    held_i = np.empty(1 if scan else k, np.int64)
    held_v = np.empty(1 if scan else k, np.int64)
    wl = np.empty(max(n, 1))
    js = np.empty(max(n, 1), np.int64)
    ws = np.empty(max(n, 1))
    rounds = 0
    while rounds < max_rounds:
        if scan:
            h = 0
            for r in range(1, k):
                if load[r] > load[h]:
                    h = r
            tried[:] = False
            tried[h] = True
        else:
            while xv[0] != ver[xi[0]]:
                xs = heap_pop(xk, xi, xv, xs)
            h = xi[0]
        items_h = pool[mstart[h]:mstart[h] + mcount[h]].copy()
        wh = np.empty(items_h.shape[0])
        for t in range(items_h.shape[0]):
            wh[t] = work[items_h[t]]
        done = False
        nh = 0
        while True:
            # the next lightest rank (ties: lower index); usually the first one takes an exchange
            if scan:
                lr = -1
                for r in range(k):
                    if not tried[r] and (lr < 0 or load[r] < load[lr]):
                        lr = r
                if lr < 0:
                    break
                tried[lr] = True
            else:
                if ns == 0:
                    break
                ek, ei, ev = nk_[0], ni[0], nv[0]
                ns = heap_pop(nk_, ni, nv, ns)
                if ev != ver[ei]:
                    continue
                held_k[nh], held_i[nh], held_v[nh] = ek, ei, ev
                nh += 1
                lr = ei
                if lr == h:
                    continue
            if not load[lr] < load[h]:
                break
            gap = load[h] - load[lr]
            nl = mcount[lr]
            items_l = pool[mstart[lr]:mstart[lr] + nl]
            for p in range(nl):
                wl[p] = work[items_l[p]]
            sorted_l = argsort_nonneg(wl[:nl], False)  # ascending, ties by position (= by item: the list is ascending)
            for p in range(nl):
                js[p] = items_l[sorted_l[p]]
                ws[p] = wl[sorted_l[p]]
            _, bi, bj = _best_exchange(items_h, wh, js[:nl], ws[:nl], gap)
            if bi < 0:
                continue
            d = work[bi] - (work[bj] if bj >= 0 else 0.0)
            part[bi] = lr
            _drop(pool, mstart, mcount, h, bi)
            pool, end = _add(pool, end, mstart, mcap, mcount, lr, bi)
            if bj >= 0:
                part[bj] = h
                _drop(pool, mstart, mcount, lr, bj)
                pool, end = _add(pool, end, mstart, mcap, mcount, h, bj)
            load[h] -= d
            load[lr] += d
            if not scan:
                for r in (h, lr):
                    ver[r] += 1
                    xs = heap_push(xk, xi, xv, xs, -load[r], r, ver[r])
                    ns = heap_push(nk_, ni, nv, ns, load[r], r, ver[r])
            done = True
            break
        for t in range(nh):  # the rest keep their place (those of h and lr are stale now)
            if held_v[t] == ver[held_i[t]]:
                ns = heap_push(nk_, ni, nv, ns, held_k[t], held_i[t], held_v[t])
        rounds += 1
        if not done:
            break
        if not scan and (xs > room - 4 or ns > room - 4):  # compact: rebuild both heaps from the current loads
            xs = 0
            ns = 0
            for r in range(k):
                ver[r] += 1
                xs = heap_push(xk, xi, xv, xs, -load[r], r, ver[r])
                ns = heap_push(nk_, ni, nv, ns, load[r], r, ver[r])
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
    has two or more. (How it is fast: the module docstring; ranks are independent, so each is done
    whole before the next, its tree and heaps warm in the cache.)
    """
    n = lengths.shape[0]
    order = order_desc(lengths)  # [n]
    # each rank's items in the longest-first order, rank after rank (a counting sort by rank)
    rstart = np.zeros(k + 1, np.int64)
    for i in range(n):
        rstart[part[i] + 1] += 1
    for r in range(k):
        rstart[r + 1] += rstart[r]
    seq = np.empty(n, np.int64)
    fill = rstart[:-1].copy()
    for t in range(n):
        i = order[t]
        seq[fill[part[i]]] = i
        fill[part[i]] += 1
    # first fit: a max segment tree over the rank's bins (a new bin has room cap, so the leftmost bin with
    # room is an open one or the first unopened); First Fit leaves at most one bin half full or less, so a
    # rank of T tokens opens at most 2 T / cap + 1 bins: the tree needs no more leaves
    ffd = np.empty(n, np.int64)
    used = np.zeros(k, np.int64)
    tree = np.empty(2, np.int64)
    for r in range(k):
        a, b = rstart[r], rstart[r + 1]
        if a == b:
            continue
        tokens = 0
        for t in range(a, b):
            tokens += lengths[seq[t]]
        bins = min(b - a, 2 * ((tokens + cap - 1) // cap) + 1)
        sz = 1
        while sz < bins:
            sz *= 2
        if tree.shape[0] < 2 * sz:
            tree = np.empty(2 * sz, np.int64)
        tree[:2 * sz] = cap
        for t in range(a, b):
            i = seq[t]
            s = lengths[i]
            node = 1
            while node < sz:  # the leftmost child with room (branch-free: the direction is unpredictable)
                node = 2 * node + (tree[2 * node] < s)
            tree[node] -= s
            ffd[i] = node - sz
            node >>= 1
            while node >= 1:  # up while the maximum changes
                v = max(tree[2 * node], tree[2 * node + 1])
                if tree[node] == v:
                    break
                tree[node] = v
                node >>= 1
            if ffd[i] + 1 > used[r]:
                used[r] = ffd[i] + 1
    counts = np.empty(k, np.int64)
    top = 1
    for r in range(k):
        top = max(top, used[r])
    for r in range(k):
        counts[r] = top if equal_counts else max(used[r], 1)
    # least work with room: a min-heap (load, bin) of the bins with room for the current item and a heap
    # (-room, bin) of the others (items come longest first, so a bin with room keeps it for the next)
    width = 1
    for r in range(k):
        width = max(width, counts[r])
    load = np.empty(width)
    room = np.empty(width, np.int64)
    ehk, ehi = np.empty(width), np.empty(width, np.int64)
    ihk, ihi = np.empty(width), np.empty(width, np.int64)
    mb = np.empty(n, np.int64)
    failed = np.zeros(k, np.bool_)
    for r in range(k):
        c = counts[r]
        for b in range(c):  # every bin empty: load 0, in index order (already a heap)
            load[b], room[b] = 0.0, cap
            ehk[b], ehi[b] = 0.0, b
        esz, isz = c, 0
        for t in range(rstart[r], rstart[r + 1]):
            i = seq[t]
            s = lengths[i]
            while isz > 0 and -ihk[0] >= s:  # bins with room again for this (shorter) item
                b = ihi[0]
                isz = pop2(ihk, ihi, isz)
                esz = push2(ehk, ehi, esz, load[b], b)
            if esz == 0:
                failed[r] = True
                break
            best = ehi[0]
            mb[i] = best
            load[best] += work[i]
            room[best] -= s
            if room[best] >= s:  # still eligible: its key grew, sift it down from the top
                sift_down2(ehk, ehi, esz, 0, load[best], best)
            else:
                esz = pop2(ehk, ehi, esz)
                isz = push2(ihk, ihi, isz, -float(room[best]), best)
    if failed.any():
        coff = np.zeros(k + 1, np.int64)
        for r in range(k):
            coff[r + 1] = coff[r] + counts[r]
        _fill_failed(lengths, part, order, ffd, used, counts, coff, failed, mb)
    return mb, counts


@njit(cache=True)
def _fill_failed(lengths, part, order, ffd, used, counts, coff, failed, mb):
    """The fallback of :func:`microbatch_kernel` for the ranks in ``failed``: FFD bins, then each empty bin
    takes the longest item of the bin with the most items (ties: lower index) while that has two or more.
    Per bin its items longest first (a bucket list), the bins by (most items, lower index) in a heap."""
    n = lengths.shape[0]
    slots = coff[-1]
    sizes = np.zeros(slots, np.int64)
    for t in range(n):
        i = order[t]
        r = part[i]
        if failed[r]:
            mb[i] = ffd[i]
            sizes[coff[r] + ffd[i]] += 1
    start = np.zeros(slots + 1, np.int64)  # bucket of each bin: its items in the longest-first order
    for b in range(slots):
        start[b + 1] = start[b] + sizes[b]
    items = np.empty(start[slots], np.int64)
    fill = start[:-1].copy()
    for t in range(n):
        i = order[t]
        r = part[i]
        if failed[r]:
            items[fill[coff[r] + ffd[i]]] = i
            fill[coff[r] + ffd[i]] += 1
    head = start[:-1].copy()
    for r in range(failed.shape[0]):
        if not failed[r]:
            continue
        o, c = coff[r], counts[r]
        hk, hi, hv = np.empty(c + used[r] + 1), np.empty(c + used[r] + 1, np.int64), \
            np.empty(c + used[r] + 1, np.int64)
        size = 0
        ver = np.zeros(c, np.int64)
        for b in range(used[r]):
            size = heap_push(hk, hi, hv, size, -float(sizes[o + b]), b, 0)
        for b in range(used[r], c):
            while size > 0 and hv[0] != ver[hi[0]]:
                size = heap_pop(hk, hi, hv, size)
            if size == 0:
                break
            donor = hi[0]
            if sizes[o + donor] < 2:
                break
            i = items[head[o + donor]]  # the donor's longest item
            head[o + donor] += 1
            mb[i] = b
            sizes[o + donor] -= 1
            sizes[o + b] += 1
            ver[donor] += 1
            size = heap_push(hk, hi, hv, size, -float(sizes[o + donor]), donor, ver[donor])


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
def lpt_kernel(work, k):
    """Rank of every item ``[n]``: heaviest first (ties: lower index) onto the least loaded of ``k`` ranks (ties:
    lower index), as ``planning.packing.lpt`` on one-lane blocks; a heap of (load, rank), O(n log k)."""
    n = work.shape[0]
    order = argsort_nonneg(work, True)  # [n] heaviest first, ties by index
    ws = np.empty(n)  # [n] the works in that order (one gather, then the loop reads in sequence)
    for t in range(n):
        ws[t] = work[order[t]]
    hk, hi = np.zeros(k), np.arange(k)  # all loads 0, in index order: a heap
    lane = np.empty(n, np.int64)
    for t in range(n):
        r = hi[0]
        lane[t] = r
        sift_down2(hk, hi, k, 0, hk[0] + ws[t], r)  # the least loaded rank's load grew: a replace-top
    out = np.empty(n, np.int64)
    for t in range(n):
        out[order[t]] = lane[t]
    return out


@njit(cache=True)
def balance_kernel(lengths, work, k, cap, equal_counts, rounds):
    """(rank ``[n]``, microbatch ``[n]``, counts ``[k]``, items ``[n]``, bounds ``[sum(counts) + 1]``) of
    :func:`balanced_loader.balance`: ``items[bounds[s]:bounds[s + 1]]`` are the indices (ascending) of
    slot ``s``, the rank-major, microbatch-minor numbering of all microbatches.

    Ranks: longest-processing-time (:func:`lpt_kernel`, heaviest first, ties by index) then
    :func:`exchange_kernel`, kept when its heaviest rank is no heavier than verl's partition
    (:func:`grouped_kk_kernel`); else that partition improved by :func:`exchange_kernel`.
    Then :func:`microbatch_kernel`.
    """
    n = work.shape[0]
    if k > 1:
        verl = grouped_kk_kernel(work, k)
        verl_load = np.zeros(k)
        for i in range(n):
            verl_load[verl[i]] += work[i]
        start = lpt_kernel(work, k)
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
