"""Contract-2 step time of a one-pool plan given per item, before any contract-1 object exists.

A policy that builds several candidate plans (hydra's portfolio) compares them by the contract-2 model and
assembles only the winner. A candidate is per item: microbatch ``mb``, first lane ``lane0``, degree
``deg`` (the items with one ``(mb, lane0)`` form one group on lanes ``lane0 .. lane0 + deg - 1``, as
:func:`balanced_loader.planning.policies.common.assemble` builds it) and ``seg``, the time the item adds
to its group (``ShapeCost.segment_ms`` at its degree). Groups run in (microbatch, first lane) order, which
is the execution order of the assembled pool; the lane recurrence is the one of
:func:`balanced_loader.simulate.lane_schedule`. The pure-Python reference is
:func:`items_step_ms_reference` (below).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balanced_loader.planning.kernels.order import order_by_pair


@njit(cache=True)
def items_step_kernel(mb, lane0, deg, seg, beta, pp, num_lanes):
    """``(step ms, finish [num_lanes])`` of the items' plan (module docstring); all inputs ``[n]`` but the
    scalars. Finish times are one stage's share (contract 2), the step adds pipeline fill and drain."""
    n = mb.shape[0]
    finish = np.zeros(num_lanes, np.float64)
    if n == 0:
        return 0.0, finish
    order = order_by_pair(mb, lane0)
    gmax = 0.0
    i = 0
    while i < n:
        a = order[i]
        m = mb[a]
        first = lane0[a]
        d = deg[a]
        t = beta
        j = i
        while j < n and mb[order[j]] == m and lane0[order[j]] == first:
            t += seg[order[j]]
            j += 1
        start = 0.0
        for x in range(first, first + d):
            if finish[x] > start:
                start = finish[x]
        for x in range(first, first + d):
            finish[x] = start + t / pp
        if t > gmax:
            gmax = t
        i = j
    return finish.max() + (pp - 1) * gmax / pp, finish


def items_step_ms_reference(mb, lane0, deg, seg, beta: float, pp: int, num_lanes: int) -> float:
    """Pure-Python twin of :func:`items_step_kernel`: the items with
    one ``(mb, lane0)`` are a group on lanes ``lane0 .. lane0 + deg - 1`` taking ``beta`` plus their ``seg``;
    groups run in (microbatch, first lane) order, each once all its lanes are free."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(mb)):
        groups.setdefault((int(mb[i]), int(lane0[i])), []).append(i)
    finish = [0.0] * num_lanes
    gmax = 0.0
    for (_, first), members in sorted(groups.items()):
        t = beta + sum(float(seg[i]) for i in members)
        lanes = range(first, first + int(deg[members[0]]))
        start = max(finish[x] for x in lanes)
        for x in lanes:
            finish[x] = start + t / pp
        gmax = max(gmax, t)
    return max(finish) + (pp - 1) * gmax / pp if groups else 0.0
