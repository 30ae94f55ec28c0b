"""``mcore-dcp``: Megatron-Core dynamic context parallelism as its main branch schedules it.

Written from the description of ``BalancedCPScheduler`` (``hybrid_cp_schedule.py``, main
branch; papers/hydra_dcp.md section 2). All ``lanes`` of the pool form one DPxCP domain.

* Degree: memory fit, ``gpus_needed(s) = max(1, 2**ceil(log2(s / cap)))`` with the cost file's
  ``max_tokens_per_lane`` as ``--max-seqlen-per-dp-cp-rank``.
* Workload: ``s**2 / degree`` (no linear term, no communication).
* Docs are sorted longest first, then cut into *rounds* (Megatron's "groups", separated by a
  barrier). One round (``next_hdp_group``):

  1. Buckets: as many as distinct degrees; a bucket closes before the doc that would take it
     over 1.1 x (total work / buckets), or when the docs left are only enough for one per
     remaining bucket (Megatron's count test, kept as written).
  2. Repeatedly take the head doc of the first bucket that can be placed: on a new group of
     the lowest free lanes when enough lanes are free, else on the existing group of the
     same size with the lowest load (ties: the older group).
  3. Once a doc smaller (in degree) than the round's first doc was placed, the round ends as
     soon as ``max - min <= 0.05 * max`` over all lanes (free lanes count as 0).
  4. ``trim_overload``: while the slack is above 5% and no lane is empty, take the most
     recently added doc off the most loaded group if that lowers the slack.
  5. ``fill_empty_gpus``: while lanes are empty, double the oldest smallest group (its later
     neighbours shift right).

  The docs not placed (remaining buckets in order, then trimmed ones) start the next round.
* Execution: every doc is its own pass (its own microbatch in the plan), as Megatron runs
  each sub-sample as a separate forward/backward; a group's docs run in the order they
  were added; round r starts at the microbatch after the longest list of round r - 1.
* Barriers: ``hybrid_context_parallel_forward_backward`` calls ``torch.distributed.barrier`` over
  the DPxCP group after every round but the last, so the plan's pool carries a barrier before the
  first microbatch of each round r >= 1 (contract 1 ``barriers``): no lane starts round r before
  every lane has finished round r - 1.

Kept faithfully, including the quirks noted above. Differences: a doc no degree can hold
is one ``ValueError`` (Megatron would loop or assert); when a doubled group would not fit in
the empty lanes (lane counts that are not powers of two, where Megatron's shift overruns), it
grows only by the empty lanes.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import replace

import numpy as np

from balanced_loader.cost import CostModel, fit_levels, floor_level
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import (
    assemble,
    empty_plan,
    max_cp_degree,
    memory_fit_levels,
    one_pool_plan,
    pool_setup,
)

DELTA = 0.05  # balance slack
BUCKET_EPS = 1.1  # a bucket closes above 1.1 x its work target


def gpus_needed(s: int, cap: int) -> int:
    """Megatron's memory-fit degree ``max(1, 2**ceil(log2(s / cap)))``, in integers."""
    return 1 << int(fit_levels([s], cap)[0])


class _Group:
    __slots__ = ("load", "size", "docs")

    def __init__(self, size: int) -> None:
        self.size = size
        self.load = 0.0
        self.docs: list[int] = []


def _buckets(pending: list[int], need: list[int], work: list[float]) -> list[deque]:
    k = len({need[i] for i in pending})
    target = sum(work[i] for i in pending) / k
    buckets: list[deque] = []
    cur: list[int] = []
    cur_work = 0.0
    remaining_k = k
    n = len(pending)
    for pos, i in enumerate(pending):
        w = work[i]
        if cur and (cur_work + w > target * BUCKET_EPS or n - pos <= remaining_k - len(buckets)):
            buckets.append(deque(cur))
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append(i)
        cur_work += w
    if cur:
        buckets.append(deque(cur))
    return buckets


def _round(pending: list[int], need: list[int], work: list[float], lanes: int, max_degree: int
           ) -> tuple[list[_Group], list[int]]:
    """One Megatron round: its groups (in lane order) and the docs left for later rounds."""
    buckets = _buckets(pending, need, work)
    groups: list[_Group] = []
    free = lanes  # lanes never used this round: the suffix [lanes - free, lanes)
    by_size: dict[int, list[tuple[float, int]]] = {}  # size -> heap of (load, gid)
    low: list[tuple[float, int]] = []  # lazy heap of (load, gid) for the smallest group load
    max_load = 0.0
    first_need = None
    check = False
    while buckets:
        pick = None
        for b in buckets:
            if b:
                nd = need[b[0]]
                if by_size.get(nd) or free >= nd:
                    pick = b
                    break
        if pick is None:
            break
        i = pick.popleft()
        nd = need[i]
        if first_need is None:
            first_need = nd
        if free >= nd:  # a new group on the lowest free lanes (its load 0 beats any group)
            gid = len(groups)
            groups.append(_Group(nd))
            free -= nd
        else:
            _, gid = heapq.heappop(by_size[nd])
        g = groups[gid]
        g.load += work[i]
        g.docs.append(i)
        heapq.heappush(by_size.setdefault(nd, []), (g.load, gid))
        heapq.heappush(low, (g.load, gid))
        max_load = max(max_load, g.load)
        while buckets and not buckets[0]:
            buckets.pop(0)
        if nd < first_need:
            check = True
        if check and buckets:
            if free:
                lo = 0.0
            else:
                while low[0][0] != groups[low[0][1]].load:
                    heapq.heappop(low)
                lo = low[0][0]
            if max_load - lo <= DELTA * max_load:
                break
    leftovers = [i for b in buckets for i in b]
    # trim_overload
    while not free and groups:
        loads = [g.load for g in groups]
        cur_max, cur_min = max(loads), min(loads)
        slack = cur_max - cur_min
        if slack <= DELTA * cur_max or cur_min == 0:
            break
        gid = loads.index(cur_max)
        g = groups[gid]
        if len(g.docs) <= 1:
            break
        last = g.docs[-1]
        loads[gid] = g.load - work[last]
        if max(loads) - min(loads) < slack:
            g.docs.pop()
            g.load -= work[last]
            leftovers.append(last)
        else:
            break
    # fill_empty_gpus: double the smallest group while the idle lanes hold the doubling; degrees stay powers
    # of two (the groups the runtime declares), so in a world that is not a power of two some lanes may idle
    widest = 1 << floor_level(min(lanes, max_degree))
    while free and groups:
        smallest = min(g.size for g in groups)
        if 2 * smallest > widest or smallest > free:  # at the --cp cap, or too few idle lanes to double
            break
        gid = next(j for j, g in enumerate(groups) if g.size == smallest)
        groups[gid].size += smallest
        free -= smallest
    return groups, leftovers


def schedule(lengths: np.ndarray, lanes: int, cap: int, max_degree: int | None = None
             ) -> list[list[tuple[int, int, list[int]]]]:
    """Rounds of ``(first lane, size, [item indices in run order])`` for items of ``lengths``; no group
    grows past ``max_degree`` (``--cp``; default ``lanes``)."""
    ln = [int(x) for x in lengths]
    top = lanes if max_degree is None else min(lanes, max_degree)
    if top < 1:
        raise ValueError(f"mcore-dcp needs at least one lane, got lanes={lanes}, max_degree={max_degree}")
    need = np.left_shift(1, fit_levels(lengths, cap)).tolist()  # [n] gpus_needed of each item
    widest = 1 << floor_level(top)  # Megatron's degrees are powers of two
    if need and max(need) > widest:
        i = int(np.argmax(need))
        raise ValueError(f"mcore-dcp: a sequence of {ln[i]} tokens needs {need[i]} lanes of {cap} tokens, "
                         f"more than the widest power-of-two group of {top} lanes ({widest}); lower max_seq_len "
                         f"or raise the lane cap")
    work = [(s * s) / d for s, d in zip(ln, need)]
    pending = sorted(range(len(ln)), key=lambda i: -ln[i])
    rounds = []
    while pending:
        before = len(pending)
        groups, pending = _round(pending, need, work, lanes, lanes if max_degree is None else max_degree)
        if len(pending) >= before:  # a round that places nothing would repeat forever: never a hang
            raise ValueError(f"mcore-dcp: a round on {lanes} lanes placed none of {before} sequences")
        out, lane = [], 0
        for g in groups:
            out.append((lane, g.size, g.docs))
            lane += g.size
        rounds.append(out)
    return rounds


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    setup = pool_setup(items, cost, config, "mcore-dcp")
    top = max_cp_degree(config, setup.lanes, "mcore-dcp")  # cp caps the degree; cp=1: plain DP
    memory_fit_levels(items, setup.cap, floor_level(top), "mcore-dcp")
    if not len(items):
        return empty_plan(step, config, setup)
    n = len(items)
    mb = np.empty(n, dtype=np.int64)
    lane0 = np.empty(n, dtype=np.int64)
    deg = np.empty(n, dtype=np.int64)
    base = 0
    barriers: list[int] = []  # [rounds - 1] first microbatch of every round after the first
    for rnd in schedule(items.lengths, setup.lanes, setup.cap, top):
        if base:
            barriers.append(base)
        longest = 0
        for first, size, docs in rnd:
            idx = np.asarray(docs, dtype=np.int64)
            mb[idx] = base + np.arange(len(docs))
            lane0[idx] = first
            deg[idx] = size
            longest = max(longest, len(docs))
        base += longest
    micro = assemble(items, mb, lane0, deg)
    plan = one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)
    # every round fills microbatches base .. base + longest - 1, so assemble drops none and k stays put
    assert len(micro) == base
    return replace(plan, pools=(replace(plan.pools[0], barriers=tuple(barriers)),))
