"""k-way Karmarkar-Karp (largest differencing) on workloads.

Why a kernel: the usual heapq implementation (verl's) copies k-lists per merge and takes
~1.5 s at n = 16k; here sets are linked lists of items, only merged states store k sums,
and freed rows are reused, so memory stays at the live states.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.order import argsort_stable


@njit(cache=True)
def _kk_less(spread, sid, a, b):
    """Heap order: larger spread first, then the lower state id."""
    return spread[a] > spread[b] or (spread[a] == spread[b] and sid[a] < sid[b])


@njit(cache=True)
def _kk_push(heap, hsize, st, spread, sid):
    """Sift state ``st`` up from position ``hsize`` (the caller grows the heap by one)."""
    pos = hsize
    while pos > 0:
        parent = (pos - 1) // 2
        if _kk_less(spread, sid, st, heap[parent]):
            heap[pos] = heap[parent]
            pos = parent
        else:
            break
    heap[pos] = st


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
    spread = np.zeros(total, np.float64)  # state -> max - min of its set sums
    sid = np.arange(total)  # state -> id (creation order)
    slot = np.full(total, -1, np.int64)  # state -> row of sums/heads/tails (-1: singleton)
    cap = 16
    sums = np.zeros((cap, k), np.float64)
    heads = np.full((cap, k), -1, np.int64)
    tails = np.full((cap, k), -1, np.int64)
    free = np.empty(cap, np.int64)
    nfree = 0
    nrows = 0
    heap = np.empty(total, np.int64)
    hsize = 0
    for i in range(n):
        spread[i] = work[i]
        _kk_push(heap, hsize, i, spread, sid)
        hsize += 1
    nstates = n
    a_sum = np.empty(k, np.float64)
    b_sum = np.empty(k, np.float64)
    a_head = np.empty(k, np.int64)
    a_tail = np.empty(k, np.int64)
    b_head = np.empty(k, np.int64)
    b_tail = np.empty(k, np.int64)
    popped = np.empty(2, np.int64)
    while hsize > 1:
        for t in range(2):  # pop the two states of largest spread (sift-down of the last entry)
            popped[t] = heap[0]
            hsize -= 1
            last = heap[hsize]
            pos = 0
            while True:
                c = 2 * pos + 1
                if c >= hsize:
                    break
                if c + 1 < hsize and _kk_less(spread, sid, heap[c + 1], heap[c]):
                    c += 1
                if _kk_less(spread, sid, heap[c], last):
                    heap[pos] = heap[c]
                    pos = c
                else:
                    break
            if hsize > 0:
                heap[pos] = last
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
        spread[st] = hi - lo
        _kk_push(heap, hsize, st, spread, sid)
        hsize += 1
    st = heap[0]
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
