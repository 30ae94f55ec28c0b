"""Binary min-heaps in plain arrays for numba kernels (:func:`balanced_loader.balance`'s in
:mod:`balanced_loader.planning.rl.kernels`, :func:`~.karmarkar_karp.kk_kernel`'s states): entries ordered by
``(key, index)``, so a tie goes to the lower index exactly as the kernels' references break it.

* ``heap_push`` / ``heap_pop``: entries ``(key, index, version)`` in three arrays; a version lets a caller
  leave an entry in place when its rank changes and skip it as stale when it reaches the top.
* ``push2`` / ``pop2`` / ``sift_down2``: ``(key, index)`` only, with a replace-top (``sift_down2`` at 0)
  for a bin whose load grew.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def heap_less(hk, hi, x, y):
    return hk[x] < hk[y] or (hk[x] == hk[y] and hi[x] < hi[y])


@njit(cache=True)
def _swap(hk, hi, hv, a, b):
    """Swap entries ``a`` and ``b`` of the heap's three arrays."""
    hk[a], hk[b] = hk[b], hk[a]
    hi[a], hi[b] = hi[b], hi[a]
    hv[a], hv[b] = hv[b], hv[a]


@njit(cache=True)
def heap_push(hk, hi, hv, size, key, idx, ver):
    """Push (key, idx, ver) on the min-heap ``hk/hi/hv[:size]`` (ordered by (key, idx)); returns the new size."""
    pos = size
    hk[pos], hi[pos], hv[pos] = key, idx, ver
    while pos > 0:
        parent = (pos - 1) >> 1
        if heap_less(hk, hi, pos, parent):
            _swap(hk, hi, hv, pos, parent)
            pos = parent
        else:
            break
    return size + 1


@njit(cache=True)
def heap_pop(hk, hi, hv, size):
    """Remove the top of the min-heap (its entry is moved to index ``size - 1``); returns the new size."""
    size -= 1
    _swap(hk, hi, hv, 0, size)
    pos = 0
    while True:
        c = 2 * pos + 1
        if c >= size:
            break
        if c + 1 < size and heap_less(hk, hi, c + 1, c):
            c += 1
        if heap_less(hk, hi, c, pos):
            _swap(hk, hi, hv, pos, c)
            pos = c
        else:
            break
    return size


@njit(cache=True)
def sift_down2(hk, hi, size, pos, key, idx):
    """Put (key, idx) at ``pos`` of the min-heap ``hk/hi[:size]`` (ordered by (key, idx)) and sift it down:
    a pop when ``pos`` was the last entry's new home, a replace-top when the top's key grew."""
    while True:
        c = 2 * pos + 1
        if c >= size:
            break
        if c + 1 < size and (hk[c + 1] < hk[c] or (hk[c + 1] == hk[c] and hi[c + 1] < hi[c])):
            c += 1
        if hk[c] < key or (hk[c] == key and hi[c] < idx):
            hk[pos], hi[pos] = hk[c], hi[c]
            pos = c
        else:
            break
    hk[pos], hi[pos] = key, idx


@njit(cache=True)
def push2(hk, hi, size, key, idx):
    """Push (key, idx) on the min-heap ``hk/hi[:size]``; returns the new size."""
    pos = size
    while pos > 0:
        parent = (pos - 1) >> 1
        if key < hk[parent] or (key == hk[parent] and idx < hi[parent]):
            hk[pos], hi[pos] = hk[parent], hi[parent]
            pos = parent
        else:
            break
    hk[pos], hi[pos] = key, idx
    return size + 1


@njit(cache=True)
def pop2(hk, hi, size):
    """Remove the top of the min-heap ``hk/hi[:size]``; returns the new size."""
    size -= 1
    if size > 0:
        sift_down2(hk, hi, size, 0, hk[size], hi[size])
    return size
