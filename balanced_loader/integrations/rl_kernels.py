"""Numba kernels of :func:`balanced_loader.balance`, each with a pure-Python reference (same ties).

* :func:`grouped_kk_kernel`: verl's Karmarkar-Karp with ``equal_size`` (largest differencing into k
  parts, started from the groups of k consecutive items of the ascending sort), with its exact
  order and ties: n/k states instead of n, O(n log k) merges, near-perfect balance when there are
  many items per part. :func:`verl_kk_reference` is verl's behaviour in plain Python (both modes).
* :func:`exchange_kernel`: moves and swaps between the heaviest rank and lighter ones until none
  lowers the heaviest load.
* :func:`microbatch_kernel`: each rank's items into microbatches under a token cap:
  first-fit-decreasing to find the counts, then (with equal counts, the largest count on every
  rank) longest first into the microbatch of least work with room.

:func:`balance_kernel` chains them (one call, no Python between the steps); the tests compare every
kernel with its ``*_reference`` on random inputs, and ``balance_kernel`` with the chain of those.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.order import argsort_stable, order_desc
from balanced_loader.planning.kernels.place import block_place_kernel

# ------------------------------------------------------------------------------------------
# grouped Karmarkar-Karp (verl's equal_size start, with its exact order and ties)
# ------------------------------------------------------------------------------------------
#
# The order verl's get_seqlen_balanced_partitions(equal_size=True) documents and its users get:
# items sorted ascending by (value, index); state s starts as the k items sorted[s*k:(s+1)*k], one
# per set; a state's sets are kept in descending (sum, size, items) order, ``items`` being the
# list of (index, value) pairs in insertion order, compared lexicographically; states wait in a
# binary heap (CPython's heapq algorithm) where a state comes first when its spread (largest -
# smallest set sum) is larger, or, at equal spread, when its largest set is larger. The two states
# popped first merge: the first's j-th set takes the second's (k-1-j)-th set's items (appended in
# order), the sets are sorted again and the state pushed back. The kernel reproduces that exactly
# (sums are exact for integer work below 2**53), so balance() can start from verl's own partition
# and only improve on it.


@njit(cache=True)
def _set_greater(sums, cnt, heads, nxt, work, a, x, b, y):
    """Set x of state a > set y of state b, by (sum, size, items)."""
    if sums[a, x] != sums[b, y]:
        return sums[a, x] > sums[b, y]
    if cnt[a, x] != cnt[b, y]:
        return cnt[a, x] > cnt[b, y]
    p, q = heads[a, x], heads[b, y]
    while p >= 0 and q >= 0:
        if p != q:
            return p > q
        p, q = nxt[p], nxt[q]
    return False  # equal item lists (both sets empty)


@njit(cache=True)
def _state_less(sums, cnt, heads, nxt, work, k, a, b):
    """State a < state b in verl's heap: the larger spread, then the larger largest set."""
    sa = sums[a, 0] - sums[a, k - 1]
    sb = sums[b, 0] - sums[b, k - 1]
    if sa != sb:
        return sa > sb
    return _set_greater(sums, cnt, heads, nxt, work, a, 0, b, 0)


@njit(cache=True)
def _sift_down(heap, start, pos, sums, cnt, heads, nxt, work, k):
    """CPython heapq._siftdown: move heap[pos] up towards ``start`` while it is less than its parent."""
    item = heap[pos]
    while pos > start:
        parent = (pos - 1) >> 1
        if _state_less(sums, cnt, heads, nxt, work, k, item, heap[parent]):
            heap[pos] = heap[parent]
            pos = parent
            continue
        break
    heap[pos] = item


@njit(cache=True)
def _sift_up(heap, end, pos, sums, cnt, heads, nxt, work, k):
    """CPython heapq._siftup: the smaller child climbs until a leaf, then the item sifts down."""
    start = pos
    item = heap[pos]
    child = 2 * pos + 1
    while child < end:
        right = child + 1
        if right < end and not _state_less(sums, cnt, heads, nxt, work, k, heap[child], heap[right]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    heap[pos] = item
    _sift_down(heap, start, pos, sums, cnt, heads, nxt, work, k)


@njit(cache=True)
def _sort_sets(s, sums, cnt, heads, tails, nxt, work, k):
    """Sets of state s in descending (sum, size, items) order, equal ones in place (insertion sort)."""
    for a in range(1, k):
        j = a
        while j > 0 and _set_greater(sums, cnt, heads, nxt, work, s, j, s, j - 1):
            sums[s, j], sums[s, j - 1] = sums[s, j - 1], sums[s, j]
            cnt[s, j], cnt[s, j - 1] = cnt[s, j - 1], cnt[s, j]
            heads[s, j], heads[s, j - 1] = heads[s, j - 1], heads[s, j]
            tails[s, j], tails[s, j - 1] = tails[s, j - 1], tails[s, j]
            j -= 1


@njit(cache=True)
def grouped_kk_kernel(work, k):
    """Part (0..k-1) of every item ``[n]`` by verl's equal-size Karmarkar-Karp (see above); each part
    gets ``n // k`` or ``n // k + 1`` items (the last group leaves sets empty when k does not divide n).

    Item lists hold indices only: at equal sums and sizes the first differing index decides, as
    (index, value) pairs with distinct indices do.
    """
    n = work.shape[0]
    part = np.zeros(n, np.int64)
    if n == 0 or k <= 1:
        return part
    g = (n + k - 1) // k
    asc = argsort_stable(work)  # [n] ascending, ties by index: sorted((value, index))
    sums = np.zeros((g, k))  # [g][k] set sums, descending within a state
    cnt = np.zeros((g, k), np.int64)
    heads = np.full((g, k), -1, np.int64)
    tails = np.full((g, k), -1, np.int64)
    nxt = np.full(n, -1, np.int64)  # [n] next item of the same set, in insertion order
    heap = np.empty(g, np.int64)
    size = 0
    for s in range(g):
        for j in range(k):
            # slot j takes the group's (k-1-j)-th item: descending sums, equal ones by descending index,
            # which is verl's set order already (the sort below then only checks it, O(k))
            p = s * k + (k - 1 - j)
            if p < n:
                it = asc[p]
                sums[s, j] = work[it]
                cnt[s, j] = 1
                heads[s, j] = it
                tails[s, j] = it
        _sort_sets(s, sums, cnt, heads, tails, nxt, work, k)
        heap[size] = s
        _sift_down(heap, 0, size, sums, cnt, heads, nxt, work, k)
        size += 1
    while size > 1:
        popped = np.empty(2, np.int64)
        for t in range(2):  # heapq.heappop
            size -= 1
            last = heap[size]
            if size > 0:
                popped[t] = heap[0]
                heap[0] = last
                _sift_up(heap, size, 0, sums, cnt, heads, nxt, work, k)
            else:
                popped[t] = last
        a, b = popped[0], popped[1]
        for j in range(k):  # why opposite orders: a's largest set with b's smallest cancels the spreads
            y = k - 1 - j
            if heads[b, y] < 0:
                continue
            if heads[a, j] < 0:
                heads[a, j] = heads[b, y]
            else:
                nxt[tails[a, j]] = heads[b, y]
            tails[a, j] = tails[b, y]
            sums[a, j] += sums[b, y]
            cnt[a, j] += cnt[b, y]
        _sort_sets(a, sums, cnt, heads, tails, nxt, work, k)
        heap[size] = a
        _sift_down(heap, 0, size, sums, cnt, heads, nxt, work, k)
        size += 1
    s = heap[0]
    for j in range(k):
        it = heads[s, j]
        while it >= 0:
            part[it] = j
            it = nxt[it]
    return part


class _VerlSet:
    """One set of a differencing state: its (index, value) items in insertion order and their sum."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.items: list[tuple[int, float]] = []
        self.total = 0.0

    def key(self) -> tuple:
        return (self.total, len(self.items), self.items)


class _VerlState:
    __slots__ = ("sets",)

    def __init__(self, sets: list[_VerlSet]) -> None:
        self.sets = sorted(sets, key=_VerlSet.key, reverse=True)

    def __lt__(self, other: _VerlState) -> bool:
        a = self.sets[0].total - self.sets[-1].total
        b = other.sets[0].total - other.sets[-1].total
        if a != b:
            return a > b
        return self.sets[0].key() > other.sets[0].key()


def verl_kk_reference(values, k: int, equal_size: bool) -> list[list[int]]:
    """verl's Karmarkar-Karp in plain Python (``heapq`` of states of k sets), as its documentation describes
    it: k parts of indices, each sorted. The reference of :func:`grouped_kk_kernel` (``equal_size=True``)
    and the baseline ``tools/bench_rl_balance.py`` times (both modes)."""
    ranked = sorted((float(v), i) for i, v in enumerate(values))
    groups = [ranked[o:o + k] for o in range(0, len(ranked), k)] if equal_size else [[x] for x in ranked]
    heap: list[_VerlState] = []
    for group in groups:
        sets = [_VerlSet() for _ in range(k)]
        for st, (v, i) in zip(sets, group):
            st.items.append((i, v))
            st.total += v
        heapq.heappush(heap, _VerlState(sets))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        for j in range(k):
            src = b.sets[k - 1 - j]
            a.sets[j].items.extend(src.items)
            a.sets[j].total += src.total
        heapq.heappush(heap, _VerlState(a.sets))
    return [sorted(i for i, _ in st.items) for st in heap[0].sets]


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
