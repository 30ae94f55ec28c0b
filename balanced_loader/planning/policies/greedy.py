"""``greedy``: a simple load-balanced policy on one pool of shape ``(config.tp or 1, config.pp or 1)``.

Each sequence gets its memory-fit power-of-two degree. Sequences that need several lanes
go first, longest first, onto the aligned lane block with the smallest current load; the
rest are placed longest-processing-time first onto the least-loaded lane and packed
first-fit into that lane's microbatches under the token cap.
"""

from __future__ import annotations

import heapq

import numpy as np

from balanced_loader.cost import CostModel, allowed_degrees
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import (
    MicrobatchBuilder,
    check_fits,
    max_cp_degree,
    one_pool_plan,
    pool_setup,
)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    setup = pool_setup(items, cost, config, "greedy")
    sc, lanes = setup.shape, setup.lanes
    top = max_cp_degree(config, lanes, "greedy")  # cp caps the degree; cp=1: plain DP
    degrees = [d for d in allowed_degrees(lanes) if d <= top]
    cap = sc.max_tokens_per_lane
    mbs = MicrobatchBuilder(lanes)
    load = np.zeros(lanes, dtype=np.float64)  # [lanes] ms
    order = np.argsort(-items.lengths, kind="stable")
    short: list[int] = []
    check_fits(items, cap, degrees[-1], "greedy")
    for i in order:
        s = int(items.lengths[i])
        d = next(x for x in degrees if s <= cap * x)
        if d == 1:
            short.append(int(i))
            continue
        blocks = load[: lanes // d * d].reshape(-1, d).max(axis=1)  # [lanes // d] aligned blocks
        b = int(np.argmin(blocks))
        block = list(range(b * d, (b + 1) * d))
        mbs.add(block, [items.segment(i)])
        load[block] = blocks[b] + float(sc.segment_ms(s, d)) + sc.microbatch_ms
    # LPT of short sequences onto lanes, then first-fit packing per lane under the cap.
    heap = [(float(load[lane]), lane) for lane in range(lanes)]
    heapq.heapify(heap)
    per_lane: list[list[int]] = [[] for _ in range(lanes)]
    for i in short:
        t, lane = heapq.heappop(heap)
        per_lane[lane].append(i)
        heapq.heappush(heap, (t + float(sc.compute_ms(int(items.lengths[i]))), lane))
    for lane, idx in enumerate(per_lane):
        bins: list[list[int]] = []
        room: list[int] = []
        for i in idx:  # already longest first
            s = int(items.lengths[i])
            for b, r in enumerate(room):
                if s <= r:
                    bins[b].append(i)
                    room[b] -= s
                    break
            else:
                bins.append([i])
                room.append(cap - s)
        for b in bins:
            mbs.add([lane], [items.segment(i) for i in b])
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, mbs.build())
