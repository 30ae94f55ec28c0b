"""Sorting kernels: a stable merge-sort argsort (and its O(n) radix form for non-negative floats) and the
longest-first order every packer starts from.

Why not ``np.argsort``: numba's ``argsort(kind="mergesort")`` is not available on every
version, and the packers need a *stable* descending order (ties: lower index first) that
matches the pure-Python references exactly. Lengths are usually small integers, so
:func:`order_desc` uses a counting sort, O(n + max length), ~5x faster than a comparison sort.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def argsort_stable(keys):
    """Stable ascending argsort (bottom-up merge sort): ``[n]`` indices."""
    n = keys.shape[0]
    a = np.arange(n)
    b = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if keys[a[j]] < keys[a[i]]:
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < hi:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    return a


@njit(cache=True)
def argsort_nonneg(keys, descending):
    """:func:`argsort_stable` of ``keys`` (``descending``: of ``-keys``) for non-negative float64 ``keys``, the
    same order (``[n]`` indices, equal keys by index; a test checks it on many ties), O(n) for large n: an LSD
    radix sort on the keys' bits (a non-negative float's bits, read as an unsigned integer, order like the
    number), four passes of 16 bits; the merge sort below 65,536 keys, where it is faster."""
    n = keys.shape[0]
    if n < 65536:
        return argsort_stable(-keys if descending else keys)
    ka = keys.view(np.uint64).copy()  # [n] the keys' bits, moved along with their indices
    if descending:
        ka = ~ka  # why: the complement reverses the order, and the sort stays stable (ties by index)
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
def order_desc(lengths):
    """Stable order of ``lengths`` (int64, >= 0), longest first: ``[n]`` indices.

    A counting sort when the largest length is small next to n, else a merge sort."""
    n = lengths.shape[0]
    if n == 0:
        return np.empty(0, np.int64)
    maxval = lengths.max()
    if maxval > 4 * n + 65536:
        return argsort_stable(-lengths)
    start = np.zeros(maxval + 1, np.int64)  # [maxval + 1] counts, then write positions
    for i in range(n):
        start[lengths[i]] += 1
    acc = 0
    for v in range(maxval, -1, -1):
        c = start[v]
        start[v] = acc
        acc += c
    order = np.empty(n, np.int64)
    for i in range(n):
        v = lengths[i]
        order[start[v]] = i
        start[v] += 1
    return order


@njit(cache=True)
def _stable_by(keys, order):
    """``order`` re-sorted stably by ``keys[order]`` (ascending): a counting sort over the key range
    when it is small next to n, else a merge sort."""
    n = order.shape[0]
    if n == 0:
        return order.copy()
    k = keys[order]  # [n]
    lo = k.min()
    span = k.max() - lo
    if span > 4 * n + 65536:
        return order[argsort_stable(k)]
    start = np.zeros(span + 2, np.int64)  # [span + 2] counts, then write positions
    for i in range(n):
        start[k[i] - lo + 1] += 1
    for v in range(1, span + 2):
        start[v] += start[v - 1]
    out = np.empty(n, np.int64)
    for i in range(n):
        v = k[i] - lo
        out[start[v]] = order[i]
        start[v] += 1
    return out


@njit(cache=True)
def order_by_pair(major, minor):
    """Stable order by ``(major, minor)`` ascending, ties by index: ``[n]`` indices (the same as
    ``np.lexsort((minor, major))``). Two counting-sort passes (least significant key first), so
    O(n + key ranges) for the small integer keys of plans (microbatch, lane)."""
    return _stable_by(major, _stable_by(minor, np.arange(major.shape[0])))
