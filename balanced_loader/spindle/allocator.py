"""Resource allocator (papers/spindle.md §4): a frontier's common finish time and device counts.

For a frontier (MetaOps that may run at the same time) on ``N`` devices:

1. Each MetaOp's speedup is its rate ``1 / T(n)`` at the allowed counts, interpolated
   linearly and extended by ``(0, 0)``; we take the upper concave envelope of these points
   (time-sharing between two counts is always possible, so counts under the envelope are
   never worth using, and the envelope keeps the allocation problem convex).
2. ``n(C)``: the fractional device count at which the interpolated rate equals ``1 / C``.
3. Bisection on ``C`` until ``sum n(C) = N`` gives ``C*``, the time at which every MetaOp
   finishes together: the continuous lower bound of the frontier. The last step solves the
   piecewise-linear equation exactly on the segments bisection found.
4. Discretisation: a fractional ``n`` in ``[n1, n2]`` becomes time-sharing, ``t1 = C (n2 - n) /
   (n2 - n1)`` on ``n1`` devices and the rest on ``n2``, in whole layers
   ``l1 = round(t1 / t(n1))``, ``l2 = L - l1``: at most two slices per MetaOp.

:func:`integer_allocation` is the exact one-count-per-MetaOp alternative (one wave).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from balanced_loader.spindle.graph import MetaOp

_REL = 1e-9  # relative tolerance for "at a vertex"


@dataclass(frozen=True, kw_only=True, slots=True)
class Hull:
    """Upper concave envelope of a MetaOp's rate ``1 / T(n)``; vertex 0 is ``(0, 0)``."""

    counts: tuple[int, ...]  # [num_vertices] device counts, ascending, counts[0] == 0
    rates: tuple[float, ...]  # [num_vertices] whole-MetaOp completions per ms, strictly ascending

    def devices(self, finish_ms: float) -> float:
        """Fractional devices to finish in ``finish_ms`` (inf if even the largest count is too slow)."""
        x = 1.0 / finish_ms
        r = self.rates
        if x >= r[-1]:
            return math.inf if x > r[-1] * (1 + 1e-12) else float(self.counts[-1])
        j = bisect.bisect_right(r, x) - 1
        c = self.counts
        return c[j] + (x - r[j]) * (c[j + 1] - c[j]) / (r[j + 1] - r[j])

    def segment(self, finish_ms: float) -> int:
        """Index ``j`` of the segment ``[j, j + 1]`` holding ``1 / finish_ms``."""
        x = 1.0 / finish_ms
        j = bisect.bisect_left(self.rates, x) - 1
        return min(max(j, 0), len(self.rates) - 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slice:
    """``layers`` consecutive layers of MetaOp ``op`` (graph index) on ``n`` devices."""

    op: int
    n: int
    layers: int


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontierAllocation:
    finish_ms: float  # C*: the continuous lower bound of the frontier
    devices: tuple[float, ...]  # [frontier] fractional device counts n(C*)
    slices: tuple[Slice, ...]  # at most two per MetaOp


def rate_hull(op: MetaOp) -> Hull:
    """The concave envelope of ``(0, 0)`` and ``(n, 1 / T(n))`` over the allowed counts."""
    pts: list[tuple[int, float]] = [(0, 0.0)]
    for n in op.counts:
        r = 1.0 / op.ms(n)
        if r <= pts[-1][1]:
            continue  # more devices, no faster: dominated
        while len(pts) >= 2:
            (ax, ay), (bx, by) = pts[-2], pts[-1]
            if (by - ay) * (n - ax) <= (r - ay) * (bx - ax):  # b on or under the chord a -> new point
                pts.pop()
            else:
                break
        pts.append((n, r))
    return Hull(counts=tuple(p[0] for p in pts), rates=tuple(p[1] for p in pts))


def finish_time(hulls: Sequence[Hull], gpus: int) -> tuple[float, list[float]]:
    """``C*`` with ``sum n_i(C*) = gpus`` (or the slowest MetaOp's best time if devices are left over)."""
    lo = max(1.0 / h.rates[-1] for h in hulls)
    needs = [h.devices(lo) for h in hulls]
    if sum(needs) <= gpus * (1 + 1e-12):
        return lo, needs
    hi = max(lo, sum(h.counts[1] / h.rates[1] for h in hulls))  # device-time on the smallest counts
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if sum(h.devices(mid) for h in hulls) > gpus:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    c = _exact(hulls, gpus, hi)
    return c, [h.devices(c) for h in hulls]


def _exact(hulls: Sequence[Hull], gpus: int, c: float) -> float:
    """Solve ``sum n_i = gpus`` exactly on the segments that hold ``1 / c``; ``c`` if it leaves them."""
    segs = [h.segment(c) for h in hulls]
    slope = [(h.counts[j + 1] - h.counts[j]) / (h.rates[j + 1] - h.rates[j]) for h, j in zip(hulls, segs)]
    base = sum(h.counts[j] - h.rates[j] * s for h, j, s in zip(hulls, segs, slope))
    x = (gpus - base) / sum(slope)
    ok = x > 0 and all(h.rates[j] * (1 - 1e-9) <= x <= h.rates[j + 1] * (1 + 1e-9) for h, j in zip(hulls, segs))
    return 1.0 / x if ok else c


def discretise(op_index: int, op: MetaOp, hull: Hull, devices: float, finish_ms: float) -> list[Slice]:
    """Time-sharing between the two envelope counts around ``devices``, in whole layers."""
    counts = hull.counts
    j = min(max(bisect.bisect_right(counts, devices) - 1, 0), len(counts) - 2)
    n1, n2 = counts[j], counts[j + 1]
    if abs(devices - n2) <= _REL * n2 or n1 == 0:
        return [Slice(op=op_index, n=n2, layers=op.layers)]
    if abs(devices - n1) <= _REL * n1:
        return [Slice(op=op_index, n=n1, layers=op.layers)]
    t1 = finish_ms * (n2 - devices) / (n2 - n1)
    l1 = min(max(math.floor(t1 / op.layer_ms(n1) + 0.5), 0), op.layers)
    out = [Slice(op=op_index, n=n1, layers=l1), Slice(op=op_index, n=n2, layers=op.layers - l1)]
    return [s for s in out if s.layers > 0]


def allocate(ops: Sequence[MetaOp], indices: Sequence[int], gpus: int) -> FrontierAllocation:
    """Bisection and discretisation for one frontier (``indices`` are the graph indices of ``ops``)."""
    hulls = [rate_hull(op) for op in ops]
    c, needs = finish_time(hulls, gpus)
    slices: list[Slice] = []
    for i, op, h, n in zip(indices, ops, hulls, needs):
        slices.extend(discretise(i, op, h, n, c))
    return FrontierAllocation(finish_ms=c, devices=tuple(needs), slices=tuple(slices))


def integer_allocation(ops: Sequence[MetaOp], gpus: int) -> tuple[float, list[int]] | None:
    """One allowed count per MetaOp, ``sum <= gpus``, minimising the slowest ``T_i(n_i)`` (exact).

    Returns ``(makespan, counts)``, or None when even the smallest counts do not fit.
    """
    times = [[-op.ms(n) for n in op.counts] for op in ops]  # ascending (T is non-increasing in n)
    if sum(op.counts[0] for op in ops) > gpus:
        return None

    def needs(c: float) -> list[int]:
        return [op.counts[min(bisect.bisect_left(t, -c * (1 + 1e-12)), len(t) - 1)] for op, t in zip(ops, times)]

    cands = sorted({-x for t in times for x in t})
    lo, hi = 0, len(cands) - 1  # cands[hi] (the slowest smallest-count time) is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(needs(cands[mid])) <= gpus:
            hi = mid
        else:
            lo = mid + 1
    counts = needs(cands[lo])
    return max(op.ms(n) for op, n in zip(ops, counts)), counts
