"""Repair pass after FFD/BFD: empty the loosest bins by swapping their items into the others.

FFD's weak case is a corpus with many items above half the capacity: each of those opens
its own bin, and the mid-size items left over do not fill the other bins tightly. One
round of :func:`repair_round`:

1. the ``pool_bins`` bins with the most room (among bins without an item over half the
   capacity, whose big item would need a bin of its own again) are emptied into a *pool*;
2. the loosest other bins (``SWAP_BINS_PER_POOLED`` per pooled bin, most room first) trade
   with the pool, repeating while the bin gets fuller: zero for one (an empty slot takes the
   largest pool item that fits), one for one (item ``x`` for the largest pool item in
   ``(x, x + room]``), one for two (``x`` for the largest pool item that fits and then the
   largest that still fits, if together they beat ``x``), two for one (``x, y`` for the
   largest pool item in ``(x + y, x + y + room]``, in bins of few items). Every trade makes
   the bin fuller and leaves the pool smaller items, which pack tighter;
3. the pool goes back first-fit-decreasing, into the kept bins' rooms first, then new bins.

A round is kept only if it used fewer bins. Why a pool indexed by item *size*: an OR
segment tree over ``0..capacity`` flags the sizes present and a stack of items per size
holds them, so "the largest pool item of at most v" is O(log capacity), and a round is
O(n + capacity + swaps * log capacity).

:func:`repair_round_reference` is the pure-Python reference of :func:`repair_round` (linear
scans, the same moves, orders and pool stacks); the tests compare them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.fit import first_fit_leaf, max_tree_set, or_tree_set
from balanced_loader.planning.kernels.order import order_desc

TWO_FOR_ONE_MAX_ITEMS = 8  # pairs are tried in bins of at most this many items (O(m^2) per bin)
SWAP_BINS_PER_POOLED = 32  # kept bins offered swaps per pooled bin (the loosest; the rest are near full)
EXTRA_SLOTS = 2  # a bin may gain this many items in one round (zero-for-one and one-for-two moves)


@njit(cache=True)
def _last_set_upto(tree, size, v):
    """Largest leaf index <= v whose flag is set, or -1."""
    if v < 0:
        return -1
    if v >= size:
        v = size - 1
    node = size + v
    if tree[node]:
        return v
    # climb until a left sibling holds a set leaf, then descend to its rightmost set leaf
    while node > 1:
        if node % 2 == 1 and tree[node - 1]:
            node -= 1
            while node < size:
                node = 2 * node + 1
                if not tree[node]:
                    node -= 1
            return node - size
        node //= 2
    return -1


@njit(cache=True)
def _pool_push(tree, size, head, nxt, lengths, item):
    s = lengths[item]
    nxt[item] = head[s]
    if head[s] < 0:
        or_tree_set(tree, size, s, 1)
    head[s] = item


@njit(cache=True)
def _pool_pop(tree, size, head, nxt, s):
    item = head[s]
    head[s] = nxt[item]
    if head[s] < 0:
        or_tree_set(tree, size, s, 0)
    return item


@njit(cache=True)
def repair_round(lengths, bins, nbins, capacity, pool_bins):
    """One round (see the module docstring). Returns (bins ``[n]``, number of bins), the input
    unchanged unless the round saved a bin. Bins are renumbered: kept bins in their old order,
    then the new ones."""
    n = lengths.shape[0]
    if nbins < 2 or pool_bins < 1:
        return bins, nbins
    fill = np.zeros(nbins, np.int64)  # [nbins]
    count = np.zeros(nbins + 1, np.int64)  # [nbins + 1] items per bin, then CSR starts
    for i in range(n):
        fill[bins[i]] += lengths[i]
        count[bins[i] + 1] += 1
    for b in range(nbins):
        count[b + 1] += EXTRA_SLOTS
    key = capacity + 1 - fill  # [nbins] pooling order: most room first, bins holding an item over capacity/2 last
    for i in range(n):
        if 2 * lengths[i] > capacity:
            key[bins[i]] = 0  # its big item would need a bin of its own again
    by_room = order_desc(key)  # [nbins] (ties: lower bin; a counting sort, keys are at most capacity + 1)
    k = min(pool_bins, nbins - 1)
    pooled = np.zeros(nbins, np.bool_)
    for t in range(k):
        pooled[by_room[t]] = True
    start = np.cumsum(count)  # [nbins + 1] CSR offsets of each bin's slots
    slot = np.full(start[nbins], -1, np.int64)  # [slots] item in each slot of a bin; -1: empty
    pos = start[:-1].copy()
    for i in range(n):
        slot[pos[bins[i]]] = i
        pos[bins[i]] += 1
    size = 1
    while size <= capacity:
        size *= 2
    tree = np.zeros(2 * size, np.uint8)  # [2 * size] OR of "the pool has an item of this size"
    head = np.full(capacity + 1, -1, np.int64)  # [capacity + 1] size -> pool item on top of its stack
    nxt = np.full(n, -1, np.int64)  # [n] pool item -> next pool item of the same size
    for i in range(n):
        if pooled[bins[i]]:
            _pool_push(tree, size, head, nxt, lengths, i)
    room = capacity - fill  # [nbins]
    swap_order = order_desc(room)  # [nbins] every bin, most room first (ties: lower bin)
    offered = 0
    for t in range(nbins):  # the loosest kept bins, big items or not, most room first
        b = swap_order[t]
        if pooled[b]:
            continue
        if room[b] == 0 or offered == SWAP_BINS_PER_POOLED * k:
            break
        offered += 1
        lo, hi = start[b], start[b + 1]
        improved = True
        while improved and room[b] > 0:
            improved = False
            for u in range(lo, hi):  # one for one
                x = slot[u]
                if x < 0:
                    continue
                q = _last_set_upto(tree, size, lengths[x] + room[b])
                if q > lengths[x]:
                    item = _pool_pop(tree, size, head, nxt, q)
                    _pool_push(tree, size, head, nxt, lengths, x)
                    room[b] -= q - lengths[x]
                    slot[u] = item
                    improved = True
                    if room[b] == 0:
                        break
            for u in range(lo, hi):  # zero for one (an empty slot takes the largest pool item that fits)
                if room[b] == 0:
                    break
                if slot[u] < 0:
                    q = _last_set_upto(tree, size, room[b])
                    if q <= 0:
                        break
                    slot[u] = _pool_pop(tree, size, head, nxt, q)
                    room[b] -= q
                    improved = True
            for u in range(lo, hi):  # one for two (greedy pair: the largest item, then the largest that fits)
                x = slot[u]
                if x < 0 or room[b] == 0:
                    continue
                free = -1
                for w in range(lo, hi):
                    if slot[w] < 0:
                        free = w
                        break
                if free < 0:
                    break
                total = lengths[x] + room[b]
                a = _last_set_upto(tree, size, total)
                if a <= 0:
                    continue
                first = _pool_pop(tree, size, head, nxt, a)
                c = _last_set_upto(tree, size, total - a)
                if c <= 0 or a + c <= lengths[x]:
                    _pool_push(tree, size, head, nxt, lengths, first)  # back on top: the pool is as before
                    continue
                second = _pool_pop(tree, size, head, nxt, c)
                _pool_push(tree, size, head, nxt, lengths, x)
                room[b] -= a + c - lengths[x]
                slot[u] = first
                slot[free] = second
                improved = True
            if room[b] == 0 or hi - lo > TWO_FOR_ONE_MAX_ITEMS + EXTRA_SLOTS:
                continue
            for u in range(lo, hi):  # two for one
                x = slot[u]
                if x < 0:
                    continue
                for w in range(u + 1, hi):
                    y = slot[w]
                    if y < 0:
                        continue
                    pair = lengths[x] + lengths[y]
                    q = _last_set_upto(tree, size, pair + room[b])
                    if q > pair:
                        item = _pool_pop(tree, size, head, nxt, q)
                        _pool_push(tree, size, head, nxt, lengths, x)
                        _pool_push(tree, size, head, nxt, lengths, y)
                        room[b] -= q - pair
                        slot[u] = item
                        slot[w] = -1
                        x = item
                        improved = True
                        if room[b] == 0:
                            break
                if room[b] == 0:
                    break
    # the pool back, first-fit-decreasing: kept bins (old order) then new bins, over a max tree of rooms
    kept = nbins - k
    npool = 0
    for s in range(capacity, 0, -1):
        it = head[s]
        while it >= 0:
            npool += 1
            it = nxt[it]
    pool = np.empty(npool, np.int64)  # [npool] pool items, longest first (ties: stack order)
    p = 0
    for s in range(capacity, 0, -1):
        it = head[s]
        while it >= 0:
            pool[p] = it
            p += 1
            it = nxt[it]
    new_id = np.empty(nbins, np.int64)  # [nbins] old bin -> new number (kept bins only)
    c = 0
    for b in range(nbins):
        if not pooled[b]:
            new_id[b] = c
            c += 1
    leaves = kept + npool
    tsize = 1
    while tsize < leaves:
        tsize *= 2
    mroom = np.full(2 * tsize, capacity, np.int64)  # [2 * tsize] max room below each node
    for b in range(nbins):
        if not pooled[b]:
            mroom[tsize + new_id[b]] = room[b]
    for node in range(tsize - 1, 0, -1):
        mroom[node] = max(mroom[2 * node], mroom[2 * node + 1])
    out = np.empty(n, np.int64)  # [n] every item is in exactly one kept slot or in the pool
    used = kept
    for b in range(nbins):
        if pooled[b]:
            continue
        for u in range(start[b], start[b + 1]):
            if slot[u] >= 0:
                out[slot[u]] = new_id[b]
    for t in range(npool):
        it = pool[t]
        s = lengths[it]
        b = first_fit_leaf(mroom, tsize, s)  # the first bin that fits
        out[it] = b
        if b + 1 > used:
            used = b + 1
        max_tree_set(mroom, tsize, b, mroom[tsize + b] - s)
    if used < nbins:
        return out, used
    return bins, nbins


@njit(cache=True)
def repair_kernel(lengths, bins, nbins, capacity, target, pool_bins, rounds):
    """Up to ``rounds`` repair rounds of ``pool_bins`` pooled bins each, while above ``target``
    bins and while each round saves a bin. Returns (bins ``[n]``, number of bins)."""
    for _ in range(rounds):
        if nbins <= target:
            break
        nb_bins, nb = repair_round(lengths, bins, nbins, capacity, pool_bins)
        if nb >= nbins:
            break
        bins, nbins = nb_bins, nb
    return bins, nbins


def repair_round_reference(lengths, bins, num_bins: int, capacity: int, pool_bins: int) -> tuple[np.ndarray, int]:
    """Linear-scan reference of ``repair_round`` (same moves, orders and pool stacks)."""
    n = len(lengths)
    size = [int(x) for x in lengths]
    if num_bins < 2 or pool_bins < 1:
        return np.asarray(bins, dtype=np.int64), num_bins
    fill = [0] * num_bins
    for i in range(n):
        fill[bins[i]] += size[i]
    has_big = {int(bins[i]) for i in range(n) if 2 * size[i] > capacity}
    key = [0 if b in has_big else capacity + 1 - fill[b] for b in range(num_bins)]
    by_room = sorted(range(num_bins), key=lambda b: (-key[b], b))
    k = min(pool_bins, num_bins - 1)
    pooled = set(by_room[:k])
    slots: list[list[int]] = [[] for _ in range(num_bins)]
    for i in range(n):
        slots[bins[i]].append(i)
    for sl in slots:
        sl.extend([-1] * EXTRA_SLOTS)
    pool: dict[int, list[int]] = {}  # size -> stack of items (top last)
    for i in range(n):
        if bins[i] in pooled:
            pool.setdefault(size[i], []).append(i)

    def largest_upto(v: int) -> int:
        return max((s for s, st in pool.items() if st and s <= v), default=-1)

    def pop(s: int) -> int:
        return pool[s].pop()

    def push(i: int) -> None:
        pool.setdefault(size[i], []).append(i)

    room = [capacity - f for f in fill]
    kept_by_room = [b for b in sorted(range(num_bins), key=lambda b: (-room[b], b)) if b not in pooled]
    for b in kept_by_room[:SWAP_BINS_PER_POOLED * k]:
        if room[b] == 0:
            break
        sl = slots[b]
        improved = True
        while improved and room[b] > 0:
            improved = False
            for u, x in enumerate(sl):  # one for one
                if x < 0:
                    continue
                q = largest_upto(size[x] + room[b])
                if q > size[x]:
                    sl[u] = pop(q)
                    push(x)
                    room[b] -= q - size[x]
                    improved = True
                    if room[b] == 0:
                        break
            for u in range(len(sl)):  # zero for one
                if room[b] == 0:
                    break
                if sl[u] < 0:
                    q = largest_upto(room[b])
                    if q <= 0:
                        break
                    sl[u] = pop(q)
                    room[b] -= q
                    improved = True
            for u in range(len(sl)):  # one for two
                x = sl[u]
                if x < 0 or room[b] == 0:
                    continue
                free = next((w for w in range(len(sl)) if sl[w] < 0), -1)
                if free < 0:
                    break
                total = size[x] + room[b]
                a = largest_upto(total)
                if a <= 0:
                    continue
                first = pop(a)
                c = largest_upto(total - a)
                if c <= 0 or a + c <= size[x]:
                    push(first)
                    continue
                second = pop(c)
                push(x)
                room[b] -= a + c - size[x]
                sl[u], sl[free] = first, second
                improved = True
            if room[b] == 0 or len(sl) > TWO_FOR_ONE_MAX_ITEMS + EXTRA_SLOTS:
                continue
            for u in range(len(sl)):  # two for one
                x = sl[u]
                if x < 0:
                    continue
                for w in range(u + 1, len(sl)):
                    y = sl[w]
                    if y < 0:
                        continue
                    pair = size[x] + size[y]
                    q = largest_upto(pair + room[b])
                    if q > pair:
                        item = pop(q)
                        push(x)
                        push(y)
                        room[b] -= q - pair
                        sl[u], sl[w] = item, -1
                        x = item
                        improved = True
                        if room[b] == 0:
                            break
                if room[b] == 0:
                    break
    kept = [b for b in range(num_bins) if b not in pooled]
    out = np.empty(n, dtype=np.int64)
    rooms = []
    for new, b in enumerate(kept):
        rooms.append(room[b])
        for x in slots[b]:
            if x >= 0:
                out[x] = new
    for s in sorted(pool, reverse=True):
        for it in reversed(pool[s]):  # top of the stack first
            j = next((j for j, r in enumerate(rooms) if r >= s), -1)  # first fit
            if j < 0:
                rooms.append(capacity)
                j = len(rooms) - 1
            rooms[j] -= s
            out[it] = j
    if len(rooms) < num_bins:
        return out, len(rooms)
    return np.asarray(bins, dtype=np.int64), num_bins
