"""First-fit and best-fit decreasing over segment trees (the kernels behind ``pack``).

* :func:`ffd_kernel`: a max segment tree over the bins' rooms; the first bin with room is
  found by walking down, left child first, in O(log B).
* :func:`bfd_kernel`: an OR segment tree over *room values* (one leaf per possible room, set
  while some open bin has that room) plus a stack of bins per value, so the smallest room
  that fits is the first set leaf at or right of the item's length: O(log capacity).

Both place a run of equal lengths into the chosen bin at once (as many copies as fit). That
is exactly what placing them one by one would do: the bins before the chosen one still do
not fit, and the chosen one stays the first (or best) fit while it has room. On real corpora
(many repeated short lengths) this is most of the speed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.order import order_desc

# ---- segment trees: leaf i at ``tree[size + i]``, node k's children at 2k and 2k + 1 ----------


@njit(cache=True)
def first_fit_leaf(tree, size, s):
    """The leftmost leaf of a max tree holding at least ``s`` (the root must hold it)."""
    node = 1
    while node < size:  # why left first: the leftmost leaf with room >= s is the lowest-numbered bin that fits
        node *= 2
        if tree[node] < s:
            node += 1
    return node - size


@njit(cache=True)
def max_tree_set(tree, size, leaf, value):
    """Set a leaf of a max tree and update its ancestors (stops where nothing changes)."""
    node = size + leaf
    tree[node] = value
    node //= 2
    while node >= 1:
        m = max(tree[2 * node], tree[2 * node + 1])
        if tree[node] == m:
            break
        tree[node] = m
        node //= 2


@njit(cache=True)
def min_tree_set(tree, size, leaf, value):
    """Set a leaf of a min tree and update its ancestors (stops where nothing changes)."""
    node = size + leaf
    tree[node] = value
    node //= 2
    while node >= 1:
        m = min(tree[2 * node], tree[2 * node + 1])
        if tree[node] == m:
            break
        tree[node] = m
        node //= 2


@njit(cache=True)
def ffd_kernel(lengths, capacity):
    """First-fit-decreasing. Returns (bin of every item ``[n]``, number of bins).

    Bins are numbered in opening order. Items go longest first (ties: lower index first)
    into the lowest-numbered bin with room. A max segment tree over the bins' rooms finds
    that bin in O(log B); unopened bins are leaves with the full capacity.
    """
    n = lengths.shape[0]
    bins = np.empty(n, np.int64)
    if n == 0:
        return bins, 0
    order = order_desc(lengths)
    total = lengths.sum()
    bound = min(n, 2 * total // capacity + 2)  # any-fit: at most one bin is half full or less
    size = 1
    while size < bound:
        size *= 2
    tree = np.full(2 * size, capacity, np.int64)  # [2 * size] max room below each node
    nbins = 0
    i = 0
    while i < n:
        s = lengths[order[i]]
        j = i + 1  # [i, j): the run of items of length s (equal-run trick, see the module docstring)
        while j < n and lengths[order[j]] == s:
            j += 1
        while i < j:
            b = first_fit_leaf(tree, size, s)
            room = tree[size + b]
            k = min(j - i, room // s)
            for t in range(i, i + k):
                bins[order[t]] = b
            i += k
            max_tree_set(tree, size, b, room - k * s)
            if b >= nbins:
                nbins = b + 1
    return bins, nbins


@njit(cache=True)
def _first_set_from(tree, size, v):
    """Smallest leaf index >= v whose flag is set in an OR-tree of ``size`` leaves, or -1."""
    if v >= size:
        return -1
    node = size + v
    if tree[node]:
        return v
    # climb until a right sibling holds a set leaf, then descend to its leftmost set leaf
    while node > 1:
        if node % 2 == 0 and tree[node + 1]:
            node += 1
            while node < size:
                node *= 2
                if not tree[node]:
                    node += 1
            return node - size
        node //= 2
    return -1


@njit(cache=True)
def or_tree_set(tree, size, v, flag):
    """Set leaf ``v`` of an OR segment tree to ``flag`` and update its ancestors (stops where nothing changes)."""
    node = size + v
    tree[node] = flag
    node //= 2
    while node >= 1:
        m = tree[2 * node] | tree[2 * node + 1]
        if tree[node] == m:
            break
        tree[node] = m
        node //= 2


@njit(cache=True)
def bfd_kernel(lengths, capacity):
    """Best-fit-decreasing. Returns (bin of every item ``[n]``, number of bins).

    Items go longest first (ties: lower index first) into the open bin with the smallest
    room that still fits; among bins with equal room, the one whose room changed last. A
    new bin opens only when no open bin fits. The search is over room *values*: an OR
    segment tree over ``0..capacity-1`` flags the values some open bin has, and each value
    keeps a stack of its bins (top = changed last), so one placement is O(log capacity).
    """
    n = lengths.shape[0]
    bins = np.empty(n, np.int64)
    if n == 0:
        return bins, 0
    order = order_desc(lengths)
    size = 1
    while size < capacity:
        size *= 2
    tree = np.zeros(2 * size, np.uint8)  # [2 * size] OR of "some open bin has this room"
    head = np.full(capacity, -1, np.int32)  # [capacity] room value -> bin on top of its stack
    nxt = np.empty(n, np.int32)  # [n] bin -> next bin in the same stack
    nbins = 0
    i = 0
    while i < n:
        s = lengths[order[i]]
        j = i + 1
        while j < n and lengths[order[j]] == s:
            j += 1
        while i < j:
            # why room values: the best fit is the smallest room >= s, i.e. the first set leaf from s
            v = _first_set_from(tree, size, s) if s < capacity else -1
            if v < 0 or v >= capacity:
                b = nbins
                nbins += 1
                room = capacity
            else:
                b = head[v]
                head[v] = nxt[b]
                if head[v] < 0:
                    or_tree_set(tree, size, v, 0)
                room = v
            k = min(j - i, room // s)
            for t in range(i, i + k):
                bins[order[t]] = b
            i += k
            room -= k * s
            if room > 0:
                nxt[b] = head[room]
                if head[room] < 0:
                    or_tree_set(tree, size, room, 1)
                head[room] = b
    return bins, nbins
