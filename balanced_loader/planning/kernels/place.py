"""Placement kernels into a fixed set of bins or lanes (cost-aware packing, LPT on blocks, passes).

* :func:`cost_pack_kernel`: items in the given order into a fixed number of bins under a
  token cap, each to the bin with the smallest cost load that still has room.
* :func:`block_place_kernel`: longest-processing-time placement of items that each take an
  aligned block of ``2**level`` lanes, through one lazy (versioned) min-heap of blocks per
  block size; optionally load-driven larger blocks when a target would be exceeded.
* :func:`fill_passes_kernel`: single-lane items onto the least-loaded lane, packed into
  per-lane passes under a token cap; opening a pass costs ``beta``.

Why trees and lazy heaps: a linear scan over bins or lanes per item is O(n * lanes), which
at 2,048 lanes and ~100k docs per step is seconds; these keep each item at O(log lanes).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _min_load_with_room(mroom, mload, size, s, stack, bound_load, bound_leaf):
    """Leaf with the smallest (load, index) among leaves with room >= s that beats
    (``bound_load``, ``bound_leaf``); ``bound_leaf`` when none does (pass inf, -1 for no bound).

    ``mroom`` / ``mload`` are a (max room, min load) segment tree of ``size`` leaves.
    Best-first search: the child with the smaller load is explored first; nodes without
    room, with a larger load than the best so far, or with the same load but only leaves
    right of it, are pruned.
    """
    best = bound_leaf
    best_load = bound_load
    stack[0] = 1
    top = 1
    while top > 0:
        top -= 1
        node = stack[top]
        if mroom[node] < s:
            continue
        ml = mload[node]
        if ml > best_load:
            continue
        if ml == best_load:
            lo = node
            while lo < size:
                lo *= 2
            if lo - size > best:
                continue
        if node >= size:
            best = node - size
            best_load = ml
            continue
        left = 2 * node
        if mload[left + 1] < mload[left]:
            stack[top] = left
            stack[top + 1] = left + 1
        else:
            stack[top] = left + 1
            stack[top + 1] = left
        top += 2
    return best


@njit(cache=True)
def _set_leaf(mroom, mload, size, leaf, room, load):
    node = size + leaf
    mroom[node] = room
    mload[node] = load
    node //= 2
    while node >= 1:
        r = max(mroom[2 * node], mroom[2 * node + 1])
        m = min(mload[2 * node], mload[2 * node + 1])
        if r == mroom[node] and m == mload[node]:
            break
        mroom[node] = r
        mload[node] = m
        node //= 2


@njit(cache=True)
def cost_pack_kernel(tokens, work, load0, room0):
    """Items in the given order into ``len(load0)`` bins; returns (bin ``[n]``, load, room).

    Each item goes to the bin with the smallest load (sum of ``work``) among the bins whose
    token room is at least its tokens; ties go to the lower bin index; -1 when no bin has
    room. A segment tree keeps (largest room, smallest load) per node; the search descends
    left first and prunes nodes without room or without a lower load than the best so far.
    """
    n = tokens.shape[0]
    nb = load0.shape[0]
    out = np.full(n, -1, np.int64)
    load = load0.copy()
    room = room0.copy()
    if nb == 0:
        return out, load, room
    size = 1
    while size < nb:
        size *= 2
    mroom = np.full(2 * size, -1, np.int64)  # [2 * size] max room below each node
    mload = np.full(2 * size, np.inf)  # [2 * size] min load below each node
    for b in range(nb):
        mroom[size + b] = room[b]
        mload[size + b] = load[b]
    for node in range(size - 1, 0, -1):
        mroom[node] = max(mroom[2 * node], mroom[2 * node + 1])
        mload[node] = min(mload[2 * node], mload[2 * node + 1])
    stack = np.empty(64, np.int64)
    for i in range(n):
        # why two keys per node: room prunes bins that cannot take the item, load orders the rest
        s = tokens[i]
        best = _min_load_with_room(mroom, mload, size, s, stack, np.inf, -1)
        if best < 0:
            continue
        out[i] = best
        load[best] += work[i]
        room[best] -= s
        _set_leaf(mroom, mload, size, best, room[best], load[best])
    return out, load, room


# ------------------------------------------------------------------------------------------
# block placement with lazy (versioned) heaps
# ------------------------------------------------------------------------------------------


@njit(cache=True)
def _heap_push(keys, blks, vers, base, sizes, lv, key, blk, ver):
    """Push (key, blk, ver) onto heap ``lv``, stored at ``base[lv]:`` of the flat arrays."""
    off = base[lv]
    pos = sizes[lv]
    sizes[lv] += 1
    while pos > 0:
        parent = (pos - 1) // 2
        q = off + parent
        if key < keys[q] or (key == keys[q] and blk < blks[q]):
            keys[off + pos] = keys[q]
            blks[off + pos] = blks[q]
            vers[off + pos] = vers[q]
            pos = parent
        else:
            break
    keys[off + pos] = key
    blks[off + pos] = blk
    vers[off + pos] = ver


@njit(cache=True)
def _heap_pop(keys, blks, vers, base, sizes, lv):
    """Remove the top of heap ``lv``."""
    off = base[lv]
    sizes[lv] -= 1
    last = sizes[lv]
    if last == 0:
        return
    key, blk, ver = keys[off + last], blks[off + last], vers[off + last]
    pos = 0
    while True:
        c = 2 * pos + 1
        if c >= last:
            break
        if c + 1 < last and (keys[off + c + 1] < keys[off + c]
                             or (keys[off + c + 1] == keys[off + c] and blks[off + c + 1] < blks[off + c])):
            c += 1
        if keys[off + c] < key or (keys[off + c] == key and blks[off + c] < blk):
            keys[off + pos] = keys[off + c]
            blks[off + pos] = blks[off + c]
            vers[off + pos] = vers[off + c]
            pos = c
        else:
            break
    keys[off + pos] = key
    blks[off + pos] = blk
    vers[off + pos] = ver


@njit(cache=True)
def block_place_kernel(times, pref, load0, next_k0, target, smallest=False):
    """Place items on aligned lane blocks, in the given order.

    ``times[i, v]`` is item i's time on a block of ``2**v`` lanes (``inf``: not allowed);
    ``pref[i]`` its preferred level. An item goes to the block of its preferred size with
    the smallest start (the largest lane load in the block; ties: the lower block), unless
    start + time exceeds ``target``: then every allowed level from ``pref`` up is tried and
    the one finishing first wins (ties: the smaller level); with ``smallest``, the smallest level
    that finishes by ``target`` wins instead (the one finishing first when none does). All lanes of the block then
    finish at start + time, and the item's microbatch is one past the latest microbatch
    of any of its lanes. Returns (level ``[n]``, first lane ``[n]``, start ``[n]``,
    microbatch ``[n]``, lane loads ``[num_lanes]``, next microbatch per lane); level -1
    when no allowed block exists.

    A max segment tree over the lanes holds each aligned block's start at one node. One
    min-heap per block size holds (start, block, version) entries; placing an item bumps
    the version of every node it changes and pushes a fresh entry, and stale entries are
    dropped when they reach the top. Cost: O(sum of block sizes * log lanes).
    """
    n, nlev = times.shape
    num_lanes = load0.shape[0]
    size = 1
    logp = 0
    while size < num_lanes:
        size *= 2
        logp += 1
    levels = logp + 1
    tree = np.full(2 * size, np.inf)  # [2 * size] lanes past num_lanes never start
    for lane in range(num_lanes):
        tree[size + lane] = load0[lane]
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    version = np.zeros(2 * size, np.int64)
    # heap capacity per level: its blocks, plus per item 2**(v' - v) subtree pushes if it can
    # take a level v' >= v, else at most one ancestor push
    cap = np.empty(levels, np.int64)
    for lv in range(levels):
        cap[lv] = size >> lv
    for i in range(n):
        top = -1
        for lv in range(min(nlev, levels)):
            if times[i, lv] < np.inf:
                top = lv
        for lv in range(levels):
            cap[lv] += (1 << (top - lv)) if top >= lv else 1
    base = np.zeros(levels + 1, np.int64)
    for lv in range(levels):
        base[lv + 1] = base[lv] + cap[lv]
    keys = np.empty(base[levels], np.float64)
    blks = np.empty(base[levels], np.int64)
    vers = np.empty(base[levels], np.int64)
    sizes = np.zeros(levels, np.int64)
    for lv in range(levels):
        first = size >> lv
        for b in range(first):
            _heap_push(keys, blks, vers, base, sizes, lv, tree[first + b], b, 0)
    next_k = next_k0.copy()
    out_lv = np.full(n, -1, np.int64)
    out_lane = np.full(n, -1, np.int64)
    out_start = np.zeros(n, np.float64)
    out_k = np.full(n, -1, np.int64)
    for i in range(n):
        best_lv = -1
        best_fin = np.inf
        p = pref[i]
        for lv in range(p, min(nlev, levels)):
            if not times[i, lv] < np.inf:
                continue
            first = size >> lv
            off = base[lv]
            # lazy heap: entries are never updated in place; an entry whose version is older than
            # its node's was superseded by a later push, so it is dropped when it reaches the top
            while sizes[lv] > 0 and vers[off] != version[first + blks[off]]:  # drop stale tops
                _heap_pop(keys, blks, vers, base, sizes, lv)
            if sizes[lv] == 0 or not keys[off] < np.inf:
                continue
            fin = keys[off] + times[i, lv]
            if (lv == p or smallest) and fin <= target:
                best_lv = lv
                break
            if fin < best_fin:
                best_fin = fin
                best_lv = lv
        if best_lv < 0:
            continue
        lv = best_lv
        first = size >> lv
        b = blks[base[lv]]
        start = keys[base[lv]]
        _heap_pop(keys, blks, vers, base, sizes, lv)
        fin = start + times[i, lv]
        width = 1 << lv
        lane0 = b * width
        k = 0
        for lane in range(lane0, lane0 + width):
            k = max(k, next_k[lane])
        for lane in range(lane0, lane0 + width):
            next_k[lane] = k + 1
        out_lv[i] = lv
        out_lane[i] = lane0
        out_start[i] = start
        out_k[i] = k
        for sub in range(lv, -1, -1):  # the block's subtree: every node becomes fin
            cnt = 1 << (lv - sub)
            first_sub = size >> sub
            for node in range(first_sub + b * cnt, first_sub + (b + 1) * cnt):
                tree[node] = fin
                version[node] += 1
                _heap_push(keys, blks, vers, base, sizes, sub, fin, node - first_sub, version[node])
        node = (first + b) // 2  # ancestors: recompute the max while it changes
        up = lv + 1
        while node >= 1:
            m = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == m:
                break
            tree[node] = m
            version[node] += 1
            _heap_push(keys, blks, vers, base, sizes, up, m, node - (size >> up), version[node])
            node //= 2
            up += 1
    load = tree[size:size + num_lanes].copy()
    return out_lv, out_lane, out_start, out_k, load, next_k


# ------------------------------------------------------------------------------------------
# single-lane items into per-lane passes
# ------------------------------------------------------------------------------------------


@njit(cache=True)
def min8_build(values):
    """An 8-ary min tree over ``values`` (``[m]``): ``(tree, inner)``; the children of node v are
    ``8v + 1 .. 8v + 8`` and leaf i is node ``inner + i`` (padding leaves are inf)."""
    leaves = 1
    inner = 0  # internal nodes above the leaves: (8^h - 1) / 7
    while leaves < values.shape[0]:
        inner += leaves
        leaves *= 8
    tree = np.full(inner + leaves, np.inf)
    for i in range(values.shape[0]):
        tree[inner + i] = values[i]
    for node in range(inner - 1, -1, -1):
        m = tree[8 * node + 1]
        for c in range(8 * node + 2, 8 * node + 9):
            m = min(m, tree[c])
        tree[node] = m
    return tree, inner


@njit(cache=True)
def min8_set(tree, inner, leaf, value):
    """Set a leaf of an 8-ary min tree and update its ancestors (stops where nothing changes)."""
    node = inner + leaf
    tree[node] = value
    while node > 0:
        parent = (node - 1) >> 3
        c0 = 8 * parent + 1
        m = tree[c0]
        for c in range(c0 + 1, c0 + 8):
            m = min(m, tree[c])
        if tree[parent] == m:
            break
        tree[parent] = m
        node = parent


@njit(cache=True)
def min8_leftmost(tree, inner):
    """The leftmost leaf holding the tree's minimum."""
    node = 0
    while node < inner:
        v = tree[node]
        node = 8 * node + 1
        while tree[node] != v:
            node += 1
    return node - inner


@njit(cache=True)
def fill_passes_kernel(tokens, work, load0, cap, beta):
    """Single-lane items (in the given order) onto lanes, packed into passes of ``cap`` tokens.

    A lane's cost for an item is its load, plus ``beta`` when none of its passes has room
    (a new pass opens). The item goes to the lane with the smallest cost (ties: the lower
    lane); inside the lane to the pass with the least room that fits (ties: the lower
    pass), or a new pass. Returns (lane ``[n]``, pass ``[n]``, passes per lane
    ``[num_lanes]``, lane loads ``[num_lanes]``).

    An 8-ary min tree over the lanes holds each lane's cost: its load, or load + beta once
    the lane is found without room (it is *retired* into a max-heap keyed by its largest
    room, and woken when an item small enough comes). The leftmost minimum of the tree is
    the answer once it is retired or has room, so each item costs O(log lanes) amortized.
    """
    n = tokens.shape[0]
    nl = load0.shape[0]
    load = load0.copy()
    out_lane = np.full(n, -1, np.int64)
    out_pass = np.full(n, -1, np.int64)
    npass = np.zeros(nl, np.int64)
    rooms = np.zeros((nl, 8), np.int64)  # [num_lanes, max passes] token room per pass
    maxroom = np.full(nl, -1, np.int64)  # [num_lanes] largest pass room (-1: no pass yet)
    retired = np.zeros(nl, np.bool_)
    rver = np.zeros(nl, np.int64)  # retirement version: heap entries of older ones are stale
    tree, inner = min8_build(load)  # [nodes] min cost below each node; why 8-ary: one cache line per level
    wk = np.empty(n + nl, np.int64)  # wake heap (max-heap by room): room, lane, version
    wl = np.empty(n + nl, np.int64)
    wv = np.empty(n + nl, np.int64)
    wsize = 0
    for i in range(n):
        s = tokens[i]
        # why retire/wake: a lane without room for s costs load + beta; rather than rescanning
        # every lane per item, it is parked in a max-heap by its largest pass room and only
        # woken (back to cost = load) when an item small enough for that room arrives
        while wsize > 0 and wk[0] >= s:  # wake the retired lanes that now have room
            lane, ver = wl[0], wv[0]
            wsize -= 1
            key, lk, vk = wk[wsize], wl[wsize], wv[wsize]
            pos = 0
            while True:
                c = 2 * pos + 1
                if c >= wsize:
                    break
                if c + 1 < wsize and wk[c + 1] > wk[c]:
                    c += 1
                if wk[c] > key:
                    wk[pos], wl[pos], wv[pos] = wk[c], wl[c], wv[c]
                    pos = c
                else:
                    break
            if wsize > 0:
                wk[pos], wl[pos], wv[pos] = key, lk, vk
            if retired[lane] and rver[lane] == ver:
                retired[lane] = False
                min8_set(tree, inner, lane, load[lane])
        while True:
            best = min8_leftmost(tree, inner)  # the leftmost cheapest lane
            if retired[best] or maxroom[best] >= s:
                break
            retired[best] = True  # no room: it costs load + beta until woken
            rver[best] += 1
            pos = wsize
            wsize += 1
            while pos > 0:
                parent = (pos - 1) // 2
                if wk[parent] < maxroom[best]:
                    wk[pos], wl[pos], wv[pos] = wk[parent], wl[parent], wv[parent]
                    pos = parent
                else:
                    break
            wk[pos], wl[pos], wv[pos] = maxroom[best], best, rver[best]
            min8_set(tree, inner, best, load[best] + beta)
        bp = -1
        for p in range(npass[best]):
            r = rooms[best, p]
            if r >= s and (bp < 0 or r < rooms[best, bp]):
                bp = p
        if bp < 0:
            if npass[best] == rooms.shape[1]:
                grown = np.zeros((nl, rooms.shape[1] * 2), np.int64)
                grown[:, : rooms.shape[1]] = rooms
                rooms = grown
            bp = npass[best]
            npass[best] += 1
            rooms[best, bp] = cap
            load[best] += beta
        rooms[best, bp] -= s
        load[best] += work[i]
        out_lane[i] = best
        out_pass[i] = bp
        mr = -1
        for p in range(npass[best]):
            mr = max(mr, rooms[best, p])
        maxroom[best] = mr
        if retired[best]:
            retired[best] = False
            rver[best] += 1
        min8_set(tree, inner, best, load[best])
    return out_lane, out_pass, npass, load


# ------------------------------------------------------------------------------------------
# groups filled to a time target
# ------------------------------------------------------------------------------------------


@njit(cache=True)
def target_groups_kernel(tokens, seg, fit, beta, cap, target):
    """Items (longest first) into groups of their own level, each filled to ``target`` ms.

    ``seg[i, v]`` is the time item i adds to a group of ``2**v`` lanes, ``fit[i]`` its memory-fit level. The
    first item left opens a group at the smallest level from its fit whose time ``beta + seg`` is at most
    ``target`` (else its fastest level); every later item left joins while the group's tokens stay within
    ``cap * 2**v`` and its time within ``target``. Returns (group of each item ``[n]``, level ``[groups]``,
    time ``[groups]``)."""
    n, nlev = seg.shape
    group = np.full(n, -1, np.int64)
    levels = np.empty(n, np.int64)
    times = np.empty(n, np.float64)
    ng = 0
    for a in range(n):
        if group[a] >= 0:
            continue
        v = -1
        best = np.inf
        bv = fit[a]
        for lv in range(fit[a], nlev):
            t = beta + seg[a, lv]
            if t <= target:
                v = lv
                break
            if t < best:
                best = t
                bv = lv
        if v < 0:
            v = bv
        group[a] = ng
        t = beta + seg[a, v]
        tok = tokens[a]
        room = cap << v
        for b in range(a + 1, n):
            if group[b] < 0 and tok + tokens[b] <= room and t + seg[b, v] <= target:
                group[b] = ng
                t += seg[b, v]
                tok += tokens[b]
        levels[ng] = v
        times[ng] = t
        ng += 1
    return group, levels[:ng].copy(), times[:ng].copy()


def target_groups_reference(tokens, seg, fit, beta: float, cap: int, target: float):
    """Pure-Python twin of :func:`target_groups_kernel`."""
    n, nlev = seg.shape
    group = [-1] * n
    levels, times = [], []
    for a in range(n):
        if group[a] >= 0:
            continue
        fits = [lv for lv in range(int(fit[a]), nlev) if beta + seg[a, lv] <= target]
        v = fits[0] if fits else min(range(int(fit[a]), nlev), key=lambda lv: (beta + seg[a, lv], lv))
        group[a] = len(levels)
        t, tok = beta + float(seg[a, v]), int(tokens[a])
        for b in range(a + 1, n):
            if group[b] < 0 and tok + int(tokens[b]) <= cap << v and t + seg[b, v] <= target:
                group[b] = len(levels)
                t += float(seg[b, v])
                tok += int(tokens[b])
        levels.append(v)
        times.append(t)
    return np.asarray(group, dtype=np.int64), np.asarray(levels, dtype=np.int64), np.asarray(times)
