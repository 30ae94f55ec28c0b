"""Items across groups of lanes that are not alike (speed groups): longest-processing-time by estimated finish.

Group ``g`` has ``lanes[g]`` lanes; item ``i`` would add ``area[i, g]`` lane-milliseconds to it and
needs at least ``crit[i, g]`` milliseconds on its own (its group time at its memory-fit degree);
``allowed[i, g]`` says whether ``g`` can hold it at all. A group's estimated finish is
``max(sum area / lanes, max crit)``. Items, in the given order (largest first), each go to the
allowed group whose finish after adding them is smallest (ties: the lower group).

Why a kernel: a step at 2,048 lanes has ~100k items and the loop is per item over a few groups.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def split_kernel(order, area, crit, allowed, lanes):
    """``[n]`` group of every item (-1 where no group is allowed); see the module docstring."""
    n, k = area.shape
    out = np.full(n, -1, np.int64)
    load = np.zeros(k)  # [k] lane-ms so far
    top = np.zeros(k)  # [k] largest crit so far
    for j in range(n):
        i = order[j]
        best = -1
        best_t = np.inf
        for g in range(k):
            if not allowed[i, g]:
                continue
            t = max((load[g] + area[i, g]) / lanes[g], max(top[g], crit[i, g]))
            if t < best_t:
                best_t = t
                best = g
        if best < 0:
            continue
        out[i] = best
        load[best] += area[i, best]
        top[best] = max(top[best], crit[i, best])
    return out


def split_reference(order, area, crit, allowed, lanes) -> np.ndarray:
    """Pure-Python reference of :func:`split_kernel` (same ties)."""
    n, k = area.shape
    out = [-1] * n
    load = [0.0] * k
    top = [0.0] * k
    for i in [int(x) for x in order]:
        cands = [(max((load[g] + area[i, g]) / lanes[g], max(top[g], crit[i, g])), g) for g in range(k)
                 if allowed[i, g]]
        if not cands:
            continue
        _, best = min(cands)
        out[i] = best
        load[best] += area[i, best]
        top[best] = max(top[best], crit[i, best])
    return np.asarray(out, dtype=np.int64)
