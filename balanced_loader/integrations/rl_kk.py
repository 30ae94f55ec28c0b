"""verl's equal-size Karmarkar-Karp, reproduced exactly in numba (:func:`grouped_kk_kernel`), and verl's
behaviour in plain Python (:func:`verl_kk_reference`, both of its modes; the kernel's reference and the
baseline ``tools/bench_rl_balance.py`` times).

Largest differencing into k parts started from the groups of k consecutive items of the ascending
sort: n/k states instead of n, O(n log k) merges, near-perfect balance when there are many items per
part. :func:`balanced_loader.balance` starts from this partition so that it is never worse than it.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.order import argsort_stable

__all__ = ["grouped_kk_kernel", "sort_order", "verl_kk_reference"]

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
def sort_order(keys, descending):
    """Stable argsort of non-negative float64 ``keys`` (``[n]`` indices; equal keys by index): an LSD radix
    sort on the keys' bits (their order as unsigned integers is their order as numbers), four passes of 16
    bits, O(n); a merge sort below 65,536 keys."""
    n = keys.shape[0]
    if n < 65536:
        return argsort_stable(-keys if descending else keys)
    ka = keys.view(np.uint64).copy()  # [n] the keys' bits, moved along with their indices
    if descending:
        ka = ~ka
    kb = np.empty(n, np.uint64)
    a = np.arange(n)
    b = np.empty(n, np.int64)
    count = np.empty(65537, np.int64)
    for shift in range(0, 64, 16):
        sh = np.uint64(shift)
        count[:] = 0
        for t in range(n):
            count[((ka[t] >> sh) & np.uint64(0xFFFF)) + 1] += 1
        for d in range(65536):
            count[d + 1] += count[d]
        for t in range(n):
            d = (ka[t] >> sh) & np.uint64(0xFFFF)
            p = count[d]
            kb[p] = ka[t]
            b[p] = a[t]
            count[d] = p + 1
        a, b = b, a
        ka, kb = kb, ka
    return a


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
    asc = sort_order(work, False)  # [n] ascending, ties by index: sorted((value, index))
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
        _merge_sort_sets(a, sums, cnt, heads, tails, nxt, work, k, perm, tmp)
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
