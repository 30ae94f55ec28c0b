"""Helpers shared by the planning-core policies (maxlen, static-sp, token-kk, mcore-dcp, hydra).

* :func:`pool_setup`: the one pool's shape, lanes and cost coefficients from the config.
* :func:`memory_fit_levels`: each item's memory-fit power-of-two degree (as a level).
* :func:`assemble`: per-item (microbatch, first lane, degree) arrays -> contract-1 microbatches.
* :func:`deal_bins`: bins dealt to groups in order with the same microbatch count everywhere.
"""

from __future__ import annotations

import gc
import heapq
from dataclasses import dataclass

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, fit_levels
from balanced_loader.plan import BatchItems, Group, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.common import check_fits, one_pool_plan


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolSetup:
    tp: int
    pp: int
    lanes: int
    shape: ShapeCost

    @property
    def cap(self) -> int:
        return self.shape.max_tokens_per_lane


def pool_setup(items: BatchItems, cost: CostModel, config: PlanConfig, policy: str) -> PoolSetup:
    """Shape ``(config.tp or 1, config.pp or 1)`` from the cost file, its lanes, and checked items."""
    tp, pp = config.tp or 1, config.pp or 1
    if config.world_size % (tp * pp):
        raise ValueError(f"world_size {config.world_size} is not divisible by tp*pp = {tp * pp}")
    sc = cost.shape(tp, pp)
    if not sc.usable:
        raise ValueError(f"policy '{policy}': shape tp={tp}, pp={pp} is marked unusable in the cost file "
                         f"(max_tokens_per_lane: 0); choose --tp/--pp of a usable entry under 'strategies'")
    if len(items) and int(items.lengths.min()) <= 0:
        i = int(np.argmin(items.lengths))
        raise ValueError(f"lengths must be positive: doc {int(items.doc_ids[i])} has length "
                         f"{int(items.lengths[i])}")
    return PoolSetup(tp=tp, pp=pp, lanes=config.world_size // (tp * pp), shape=sc)


def max_level(num_lanes: int) -> int:
    """Largest level v with 2**v <= num_lanes (aligned power-of-two blocks)."""
    return int(num_lanes).bit_length() - 1


def level_of_degree(d: int) -> int:
    return int(d).bit_length() - 1


def memory_fit_levels(items: BatchItems, cap: int, top_level: int, policy: str) -> np.ndarray:
    """``[n]`` smallest level v with ``2**v * cap >= length``; one error naming the longest doc when it
    does not fit even at ``2**top_level`` lanes."""
    check_fits(items, cap, 1 << top_level, policy)
    return fit_levels(items.lengths, cap)


def assemble(items: BatchItems, mb: np.ndarray, lane0: np.ndarray, degree: np.ndarray
             ) -> tuple[tuple[Group, ...], ...]:
    """Contract-1 microbatches from per-item ``mb`` / ``lane0`` / ``degree`` (``[n]`` each).

    Items with the same (microbatch, first lane) form one group of lanes
    ``lane0 .. lane0 + degree - 1``, segments in item order. Empty microbatch indices are
    dropped (that does not change any lane's execution order).
    """
    n = len(items)
    if n == 0:
        return ()
    mb = np.asarray(mb, dtype=np.int64)
    lane0 = np.asarray(lane0, dtype=np.int64)
    order = np.lexsort((np.arange(n), lane0, mb))
    m_s = mb[order]
    l_s = lane0[order]
    d_s = np.asarray(degree, dtype=np.int64)[order]
    cut = np.flatnonzero((m_s[1:] != m_s[:-1]) | (l_s[1:] != l_s[:-1])) + 1
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), n]
    paused = gc.isenabled()
    gc.disable()  # only acyclic tuples are built here; collections would scan them for nothing
    try:
        segs = list(zip(items.doc_ids[order].tolist(), items.starts[order].tolist(),
                        items.lengths[order].tolist()))
        m_l, l_l, d_l = m_s.tolist(), l_s.tolist(), d_s.tolist()
        out: dict[int, list[Group]] = {}
        for a, b in zip(starts, ends):
            first, d = l_l[a], d_l[a]
            lanes = (first,) if d == 1 else tuple(range(first, first + d))
            g = Group(lanes=lanes, segments=tuple(segs[a:b]))
            grp = out.get(m_l[a])
            if grp is None:
                out[m_l[a]] = [g]
            else:
                grp.append(g)
    finally:
        if paused:
            gc.enable()
    return tuple(tuple(out[k]) for k in sorted(out))


def empty_plan(step: int, config: PlanConfig, setup: PoolSetup) -> StepPlan:
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, ())


def deal_bins(bins: np.ndarray, num_bins: int, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal bins to groups in order: bin b -> group b % G, microbatch b // G.

    Static trainers run the same number of microbatches on every data-parallel replica.
    When the bin count is not a multiple of G, the bins holding the most docs are split in
    two (alternate docs) until it is, or no bin has two docs left. Returns per-item
    ``(microbatch [n], group [n])``.
    """
    n = len(bins)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    want = -(-num_bins // num_groups) * num_groups
    new_bin = np.asarray(bins, dtype=np.int64).copy()
    if want > num_bins:
        members: list[list[int]] = [[] for _ in range(num_bins)]
        for i, b in enumerate(new_bin.tolist()):
            members[b].append(i)
        heap = [(-len(m), b) for b, m in enumerate(members) if len(m) > 1]
        heapq.heapify(heap)
        nb = num_bins
        while nb < want and heap:
            _, b = heapq.heappop(heap)
            docs = members[b]
            keep, move = docs[0::2], docs[1::2]
            members[b] = keep
            members.append(move)
            new_bin[move] = nb
            for bb in (b, nb):
                if len(members[bb]) > 1:
                    heapq.heappush(heap, (-len(members[bb]), bb))
            nb += 1
    return new_bin // num_groups, new_bin % num_groups


def fixed_degree(items: BatchItems, lanes: int, cap: int) -> int:
    """Smallest power of two dividing ``lanes`` whose lanes hold the longest item (else the largest)."""
    longest = int(items.lengths.max()) if len(items) else 1
    cp = 1
    while cp * cap < longest and lanes % (2 * cp) == 0:
        cp *= 2
    return cp


def static_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int, *, policy: str,
                algorithm: str) -> StepPlan:
    """A static trainer: one fixed CP/SP degree for every doc, docs packed into bins of
    ``degree * max_tokens_per_lane`` tokens, bins dealt to the CP/SP groups in order."""
    from balanced_loader.planning.packing import pack

    setup = pool_setup(items, cost, config, policy)
    lanes, cap = setup.lanes, setup.cap
    if config.cp is not None:
        cp = config.cp
    else:
        cp = fixed_degree(items, lanes, cap)
    if cp > lanes or lanes % cp:
        raise ValueError(f"policy '{policy}': cp {cp} must divide the {lanes} lanes per stage "
                         f"(world_size / (tp*pp)); choose --cp among the divisors of {lanes}")
    check_fits(items, cap, cp, policy, what="cp", fix="raise --cp")
    if not len(items):
        return empty_plan(step, config, setup)
    groups = lanes // cp
    bins = pack(items.lengths, cap * cp, algorithm)
    mb, grp = deal_bins(bins, int(bins.max()) + 1, groups)
    micro = assemble(items, mb, grp * cp, np.full(len(items), cp, dtype=np.int64))
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)
