"""Karmarkar-Karp (largest differencing) into k parts: the one home of its kernels.

* :func:`kk_kernel`: k-way Karmarkar-Karp started from one state per item (the policies' ``karmarkar_karp``,
  :mod:`balanced_loader.planning.packing`).
* :func:`grouped_kk_kernel`: verl's equal-size variant, reproduced exactly (its order and ties), started from the
  groups of k consecutive items of the ascending sort: n/k states instead of n, O(n log k) merges, near-perfect
  balance when there are many items per part. :func:`balanced_loader.balance` starts from this partition so that
  it is never worse than it. :func:`verl_kk_reference` is verl's algorithm in plain Python (both of its modes;
  the kernel's reference and the baseline ``tools/bench_rl_balance.py`` times).

Both merge states the same way (a state's largest set takes the other's smallest, linked lists of items) and
share the item order (:mod:`.order`); they differ in the order of states: :func:`kk_kernel` pops the largest
spread, ties by creation (a ``(key, index)`` heap of :mod:`.heaps`), verl by the largest spread, ties by the
states' largest sets (a comparison of item lists, not a key: its own heap below, CPython's ``heapq`` steps).

Why kernels: the usual heapq implementation (verl's) copies k-lists per merge and takes
~1.5 s at n = 16k; here sets are linked lists of items, only merged states store k sums,
and freed rows are reused, so memory stays at the live states.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.heaps import pop2, push2
from balanced_loader.planning.kernels.order import argsort_nonneg, argsort_stable

__all__ = ["grouped_kk_kernel", "kk_kernel", "verl_kk_reference"]


@njit(cache=True)
def kk_kernel(work, k):
    """k-way Karmarkar-Karp (largest differencing). Returns the part of every item ``[n]``.

    Every item starts as a state of k sets (the item alone in set 0). The two states with
    the largest spread (max - min set sum; ties: lower state id, items before merged
    states in creation order) are merged: the first's sets sorted by sum descending are
    paired with the second's sorted ascending (stable sorts), and the result is pushed as
    a new state. Sets are linked lists of items; only merged states store k sums.
    """
    n = work.shape[0]
    part = np.zeros(n, np.int64)
    if n == 0 or k <= 1:
        return part
    nxt = np.full(n, -1, np.int64)  # [n] item -> next item of its set
    total = 2 * n
    slot = np.full(total, -1, np.int64)  # state -> row of sums/heads/tails (-1: singleton)
    cap = 16
    sums = np.zeros((cap, k), np.float64)
    heads = np.full((cap, k), -1, np.int64)
    tails = np.full((cap, k), -1, np.int64)
    free = np.empty(cap, np.int64)
    nfree = 0
    nrows = 0
    # states by (-spread, id) in a min-heap: the largest spread first, ties to the lower id (creation order)
    hkey = np.empty(total, np.float64)  # [heap] -spread of each entry
    hst = np.empty(total, np.int64)  # [heap] its state id
    hsize = 0
    for i in range(n):
        hsize = push2(hkey, hst, hsize, -work[i], i)
    nstates = n
    a_sum = np.empty(k, np.float64)
    b_sum = np.empty(k, np.float64)
    a_head = np.empty(k, np.int64)
    a_tail = np.empty(k, np.int64)
    b_head = np.empty(k, np.int64)
    b_tail = np.empty(k, np.int64)
    popped = np.empty(2, np.int64)
    while hsize > 1:
        for t in range(2):  # pop the two states of largest spread
            popped[t] = hst[0]
            hsize = pop2(hkey, hst, hsize)
        for t in range(2):
            st = popped[t]
            dst_sum = a_sum if t == 0 else b_sum
            dst_head = a_head if t == 0 else b_head
            dst_tail = a_tail if t == 0 else b_tail
            if slot[st] < 0:
                dst_sum[:] = 0.0
                dst_head[:] = -1
                dst_tail[:] = -1
                dst_sum[0] = work[st]
                dst_head[0] = st
                dst_tail[0] = st
            else:
                r = slot[st]
                dst_sum[:] = sums[r]
                dst_head[:] = heads[r]
                dst_tail[:] = tails[r]
                free[nfree] = r
                nfree += 1
        # why opposite orders: pairing a's largest set with b's smallest cancels the spreads
        oa = argsort_stable(-a_sum)
        ob = argsort_stable(b_sum)
        if nfree > 0:
            nfree -= 1
            r = free[nfree]
        else:
            if nrows == sums.shape[0]:
                cap2 = sums.shape[0] * 2
                ns = np.zeros((cap2, k), np.float64)
                nh = np.full((cap2, k), -1, np.int64)
                nt = np.full((cap2, k), -1, np.int64)
                ns[: sums.shape[0]] = sums
                nh[: sums.shape[0]] = heads
                nt[: sums.shape[0]] = tails
                sums, heads, tails = ns, nh, nt
                nf = np.empty(cap2, np.int64)
                nf[:nfree] = free[:nfree]
                free = nf
            r = nrows
            nrows += 1
        lo = np.inf
        hi = -np.inf
        for j in range(k):
            x = oa[j]
            y = ob[j]
            sm = a_sum[x] + b_sum[y]
            sums[r, j] = sm
            lo = min(lo, sm)
            hi = max(hi, sm)
            ha, ta, hb, tb = a_head[x], a_tail[x], b_head[y], b_tail[y]
            if ha < 0:
                heads[r, j] = hb
                tails[r, j] = tb
            elif hb < 0:
                heads[r, j] = ha
                tails[r, j] = ta
            else:
                nxt[ta] = hb
                heads[r, j] = ha
                tails[r, j] = tb
        st = nstates
        nstates += 1
        slot[st] = r
        hsize = push2(hkey, hst, hsize, -(hi - lo), st)
    st = hst[0]
    if slot[st] < 0:
        part[st] = 0
        return part
    r = slot[st]
    for j in range(k):
        it = heads[r, j]
        while it >= 0:
            part[it] = j
            it = nxt[it]
    return part


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
# and only improve on it. Its heap is its own, not one of .heaps: the order compares the states'
# largest sets (item lists), not a (key, index) pair, and it takes heapq's steps, as verl's does.


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
def _heapq_siftdown(heap, start, pos, sums, cnt, heads, nxt, work, k):
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
def _heapq_siftup(heap, end, pos, sums, cnt, heads, nxt, work, k):
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
    _heapq_siftdown(heap, start, pos, sums, cnt, heads, nxt, work, k)


@njit(cache=True)
def _sort_sets(s, sums, cnt, heads, tails, nxt, work, k):
    """Sets of state s in descending (sum, size, items) order, equal ones in place (insertion sort: O(k) when
    they are in order already, as a new state's are)."""
    for a in range(1, k):
        j = a
        while j > 0 and _set_greater(sums, cnt, heads, nxt, work, s, j, s, j - 1):
            sums[s, j], sums[s, j - 1] = sums[s, j - 1], sums[s, j]
            cnt[s, j], cnt[s, j - 1] = cnt[s, j - 1], cnt[s, j]
            heads[s, j], heads[s, j - 1] = heads[s, j - 1], heads[s, j]
            tails[s, j], tails[s, j - 1] = tails[s, j - 1], tails[s, j]
            j -= 1


@njit(cache=True)
def _merge_sort_sets(s, sums, cnt, heads, tails, nxt, work, k, perm, tmp):
    """:func:`_sort_sets` for a merged state (sets in any order): a stable merge sort of the set positions,
    O(k log k) comparisons (each O(1): two different sets differ in their first item), then one permutation."""
    for j in range(k):
        perm[j] = j
    width = 1
    while width < k:
        for lo in range(0, k, 2 * width):
            mid = min(lo + width, k)
            hi = min(lo + 2 * width, k)
            i, j, o = lo, mid, lo
            while i < mid and j < hi:
                if _set_greater(sums, cnt, heads, nxt, work, s, perm[j], s, perm[i]):  # strictly: stable
                    tmp[o] = perm[j]
                    j += 1
                else:
                    tmp[o] = perm[i]
                    i += 1
                o += 1
            while i < mid:
                tmp[o] = perm[i]
                i += 1
                o += 1
            while j < hi:
                tmp[o] = perm[j]
                j += 1
                o += 1
        for j in range(k):
            perm[j] = tmp[j]
        width *= 2
    a_sum = sums[s, :].copy()
    a_cnt = cnt[s, :].copy()
    a_head = heads[s, :].copy()
    a_tail = tails[s, :].copy()
    for j in range(k):
        sums[s, j], cnt[s, j], heads[s, j], tails[s, j] = a_sum[perm[j]], a_cnt[perm[j]], a_head[perm[j]], \
            a_tail[perm[j]]


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
    asc = argsort_nonneg(work, False)  # [n] ascending, ties by index: sorted((value, index))
    sums = np.zeros((g, k))  # [g][k] set sums, descending within a state
    cnt = np.zeros((g, k), np.int64)
    heads = np.full((g, k), -1, np.int64)
    tails = np.full((g, k), -1, np.int64)
    nxt = np.full(n, -1, np.int64)  # [n] next item of the same set, in insertion order
    heap = np.empty(g, np.int64)
    perm = np.empty(k, np.int64)  # merge sort scratch
    tmp = np.empty(k, np.int64)
    size = 0
    for s in range(g):
        r = min(k, n - s * k)  # items of this group (the last one may have fewer: its other sets stay empty)
        for j in range(r):
            # slot j takes the group's (r-1-j)-th item: descending sums, equal ones by descending index, then
            # the empty sets, which is verl's set order already (the sort below then only checks it, O(k))
            p = s * k + (r - 1 - j)
            it = asc[p]
            sums[s, j] = work[it]
            cnt[s, j] = 1
            heads[s, j] = it
            tails[s, j] = it
        _sort_sets(s, sums, cnt, heads, tails, nxt, work, k)
        heap[size] = s
        _heapq_siftdown(heap, 0, size, sums, cnt, heads, nxt, work, k)
        size += 1
    while size > 1:
        popped = np.empty(2, np.int64)
        for t in range(2):  # heapq.heappop
            size -= 1
            last = heap[size]
            if size > 0:
                popped[t] = heap[0]
                heap[0] = last
                _heapq_siftup(heap, size, 0, sums, cnt, heads, nxt, work, k)
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
        _merge_sort_sets(a, sums, cnt, heads, tails, nxt, work, k, perm, tmp)
        heap[size] = a
        _heapq_siftdown(heap, 0, size, sums, cnt, heads, nxt, work, k)
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
    it: k parts of indices, each sorted. The reference of :func:`grouped_kk_kernel` (``equal_size=True``)."""
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
