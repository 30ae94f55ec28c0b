"""``greedy``: a simple load-balanced policy on one pool of shape ``(config.tp or 1, config.pp or 1)``.

Each sequence gets its memory-fit power-of-two degree. Sequences that need several lanes
go first, longest first, onto the aligned lane block with the smallest current load; the
rest are placed longest-processing-time first onto the least-loaded lane and packed
first-fit into that lane's microbatches under the token cap.
"""

from __future__ import annotations

import heapq

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, allowed_degrees
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import (
    assemble,
    check_fits,
    max_cp_degree,
    one_pool_plan,
    pool_setup,
)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    setup = pool_setup(items, cost, config, "greedy")
    top = max_cp_degree(config, setup.lanes, "greedy")  # cp caps the degree; cp=1: plain DP
    degrees = [d for d in allowed_degrees(setup.lanes) if d <= top]
    check_fits(items, setup.cap, degrees[-1], "greedy")
    if not len(items):
        return one_pool_plan(step, config.world_size, setup.tp, setup.pp, ())
    micro = assemble(items, *greedy_arrays(items.lengths, setup.shape, setup.lanes, degrees))
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)


def greedy_arrays(lengths: np.ndarray, sc: ShapeCost, lanes: int, degrees: list[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy plan (module docstring) as per-item ``(microbatch, first lane, degree)`` ``[n]`` each."""
    ln = np.asarray(lengths, dtype=np.int64)
    n = len(ln)
    cap = sc.max_tokens_per_lane
    mb = np.empty(n, dtype=np.int64)
    lane0 = np.empty(n, dtype=np.int64)
    deg = np.ones(n, dtype=np.int64)
    next_k = np.zeros(lanes, dtype=np.int64)  # [lanes] a group goes one past its lanes' latest microbatch
    load = np.zeros(lanes, dtype=np.float64)  # [lanes] ms
    order = np.argsort(-ln, kind="stable")
    short: list[int] = []
    for i in order.tolist():
        s = int(ln[i])
        d = next(x for x in degrees if s <= cap * x)
        if d == 1:
            short.append(i)
            continue
        blocks = load[: lanes // d * d].reshape(-1, d).max(axis=1)  # [lanes // d] aligned blocks
        b = int(np.argmin(blocks))
        mb[i], lane0[i], deg[i] = int(next_k[b * d:(b + 1) * d].max()), b * d, d
        next_k[b * d:(b + 1) * d] = mb[i] + 1
        load[b * d:(b + 1) * d] = blocks[b] + float(sc.segment_ms(s, d)) + sc.microbatch_ms
    # LPT of short sequences onto lanes, then first-fit packing per lane under the cap.
    heap = [(float(load[lane]), lane) for lane in range(lanes)]
    heapq.heapify(heap)
    per_lane: list[list[int]] = [[] for _ in range(lanes)]
    for i in short:
        t, lane = heapq.heappop(heap)
        per_lane[lane].append(i)
        heapq.heappush(heap, (t + float(sc.compute_ms(int(ln[i]))), lane))
    for lane, idx in enumerate(per_lane):
        room: list[int] = []
        for i in idx:  # already longest first
            s = int(ln[i])
            for b, r in enumerate(room):
                if s <= r:
                    room[b] -= s
                    break
            else:
                b = len(room)
                room.append(cap - s)
            mb[i], lane0[i] = next_k[lane] + b, lane
    return mb, lane0, deg
