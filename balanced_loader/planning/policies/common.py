"""Helpers shared by the policies: one pool's setup, building groups and microbatches lane by lane.

* :func:`pool_setup`: the one pool's shape, lanes and cost coefficients from the config.
* :class:`MicrobatchBuilder`: groups into microbatches in the contract-2 execution order.
* :func:`memory_fit_levels`: each item's memory-fit power-of-two degree (as a level).
* :func:`assemble`: per-item (microbatch, first lane, degree) arrays -> contract-1 microbatches.
* :func:`deal_bins`: bins dealt to groups in order with the same microbatch count everywhere.
* :func:`static_plan`: a static trainer (one fixed CP/SP degree, packed bins dealt to groups).
* :func:`longest_on`, :func:`one_pool_layout`: what the loader and runtime ask a policy before planning
  (:func:`balanced_loader.planning.longest_segment`, :func:`~balanced_loader.planning.fixed_pools`).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, allowed_degrees, fit_levels, pow2_divisor
from balanced_loader.plan import (
    BatchItems,
    Group,
    Pool,
    SegmentColumns,
    StepPlan,
    column_groups,
    single_pool_ranks,
)
from balanced_loader.planning.config import PlanConfig


class MicrobatchBuilder:
    """Places groups so that the groups of one microbatch use disjoint lanes.

    A group goes into the first microbatch index after every one of its lanes' earlier
    groups (``k = max(next_k[lanes])``), which is exactly the contract-2 execution order.
    """

    def __init__(self, num_lanes: int) -> None:
        self.next_k = np.zeros(num_lanes, dtype=np.int64)  # [num_lanes]
        self.microbatches: list[list[Group]] = []  # [num_microbatches][groups]

    def add(self, lanes: Sequence[int], segments: Sequence[tuple[int, int, int]], k: int | None = None) -> int:
        lanes = tuple(int(x) for x in lanes)
        kk = int(self.next_k[list(lanes)].max()) if k is None else k
        assert k is None or kk >= int(self.next_k[list(lanes)].max())
        while len(self.microbatches) <= kk:
            self.microbatches.append([])
        self.microbatches[kk].append(Group(lanes=lanes, segments=tuple(segments)))
        self.next_k[list(lanes)] = kk + 1
        return kk

    def build(self) -> tuple[tuple[Group, ...], ...]:
        return tuple(tuple(mb) for mb in self.microbatches if mb)


def one_pool_plan(step: int, world_size: int, tp: int, pp: int,
                  microbatches: tuple[tuple[Group, ...], ...]) -> StepPlan:
    """A plan with a single pool of shape (tp, pp) covering the whole world."""
    pool = Pool(tp=tp, pp=pp, ranks=single_pool_ranks(world_size, tp, pp), microbatches=microbatches)
    return StepPlan(step=step, world_size=world_size, pools=(pool,))


def check_fits(items: BatchItems, cap: int, max_degree: int, policy: str, *, what: str = "largest degree",
               fix: str = "use more lanes or a shape with a larger max_tokens_per_lane") -> None:
    """One clear error naming the longest item when no group of ``max_degree`` lanes holds it."""
    if len(items) and int(items.lengths.max()) > cap * max_degree:
        i = int(np.argmax(items.lengths))
        raise ValueError(f"policy '{policy}': doc {int(items.doc_ids[i])} ({int(items.lengths[i])} tokens) does not "
                         f"fit: max_tokens_per_lane {cap} x {what} {max_degree} = {cap * max_degree} tokens; split "
                         f"long docs (--max-seq-len N, or the loader's max_seq_len with long_docs='split') or {fix}")


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
    from balanced_loader.planning.kernels import order_by_pair  # numba: loaded when a policy runs

    n = len(items)
    if n == 0:
        return ()
    mb = np.ascontiguousarray(mb, dtype=np.int64)
    lane0 = np.ascontiguousarray(lane0, dtype=np.int64)
    order = order_by_pair(mb, lane0)  # [n] by (microbatch, first lane), ties in item order
    m_s = mb[order]
    l_s = lane0[order]
    new = np.ones(n, dtype=bool)  # [n] item starts a group
    new[1:] = (m_s[1:] != m_s[:-1]) | (l_s[1:] != l_s[:-1])
    first = np.flatnonzero(new)  # [G] first item of each group
    bounds = np.append(first, n).tolist()  # [G + 1]
    g_mb = m_s[first]  # [G] microbatch of each group (non-decreasing)
    m_bounds = [0, *(np.flatnonzero(g_mb[1:] != g_mb[:-1]) + 1).tolist(), len(first)]  # [M + 1] into groups
    g_lane = l_s[first].tolist()  # [G]
    g_deg = np.asarray(degree, dtype=np.int64)[order[first]]  # [G]
    # the segments stay arrays in group order: a group makes its tuples when first read (ColumnGroup)
    starts = items.starts[order] if items.starts.any() else items.starts  # all zero: any order is the same
    cols = SegmentColumns(items.doc_ids[order], starts, items.lengths[order])
    paused = gc.isenabled()
    gc.disable()  # only acyclic objects are built here; collections would scan them for nothing
    try:
        one = [(x,) for x in range(max(g_lane) + 1)]  # one shared tuple per lane for one-lane groups
        lanes = list(map(one.__getitem__, g_lane))
        wide = np.flatnonzero(g_deg > 1)  # [w] groups of several lanes
        for j, d in zip(wide.tolist(), g_deg[wide].tolist()):
            lanes[j] = tuple(range(g_lane[j], g_lane[j] + d))
        groups = column_groups(lanes, bounds, cols)
        return tuple(tuple(groups[a:b]) for a, b in zip(m_bounds[:-1], m_bounds[1:]))
    finally:
        if paused:
            gc.enable()


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
    return min(1 << int(fit_levels([longest], cap)[0]), pow2_divisor(lanes))


def static_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int, *, policy: str,
                algorithm: str) -> StepPlan:
    """A static trainer: one fixed CP/SP degree for every doc, docs packed into bins of
    ``degree * max_tokens_per_lane`` tokens, bins dealt to the CP/SP groups in order."""
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
    micro = assemble(items, *static_arrays(items.lengths, lanes, cap, cp, algorithm))
    return one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)


def static_arrays(lengths: np.ndarray, lanes: int, cap: int, cp: int, algorithm: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A static trainer's plan (:func:`static_plan`) as per-item ``(microbatch, first lane, degree)`` ``[n]``
    each: docs packed into bins of ``cp * cap`` tokens, bins dealt to the ``lanes // cp`` groups in order."""
    from balanced_loader.planning.packing import pack

    bins = pack(lengths, cap * cp, algorithm)
    mb, grp = deal_bins(bins, int(bins.max()) + 1, lanes // cp)
    return mb, grp * cp, np.full(len(lengths), cp, dtype=np.int64)


# ---- what a policy tells the loader and the runtime before it plans ----------------------------


def longest_on(pools: Iterable[tuple[ShapeCost, int]], cp: int | None, *, fixed_degree: bool = False) -> int:
    """The longest segment some group of these ``(shape, lanes)`` pools holds: lane cap x the largest
    degree (``cp`` when set; else the largest power of two dividing the lanes for a ``fixed_degree``
    policy, the largest aligned power-of-two block otherwise); 0 when no pool is usable."""
    best = 0
    for sc, lanes in pools:
        if not sc.usable or lanes < 1:
            continue
        if cp is not None:
            degree = min(cp, lanes)
        elif fixed_degree:
            degree = pow2_divisor(lanes)  # static trainers split the lanes into equal groups
        else:
            degree = max(allowed_degrees(lanes))
        best = max(best, sc.max_tokens_per_lane * degree)
    return best


def one_pool_longest_segment(cost: CostModel, config: PlanConfig, *, fixed_degree: bool = False) -> int:
    """:func:`longest_on` the one pool of shape ``(tp or 1, pp or 1)`` over the whole world."""
    sc = cost.shape(config.tp or 1, config.pp or 1)
    return longest_on([(sc, config.world_size // sc.gpus)], config.cp, fixed_degree=fixed_degree)


def one_pool_layout(config: PlanConfig) -> tuple[Pool, ...]:
    """The one pool of shape ``(tp or 1, pp or 1)`` over the whole world (no microbatches)."""
    tp, pp = config.tp or 1, config.pp or 1
    return (Pool(tp=tp, pp=pp, ranks=single_pool_ranks(config.world_size, tp, pp), microbatches=()),)


def max_cp_degree(config: PlanConfig, lanes: int, policy: str) -> int:
    """The largest CP/SP group a dynamic-degree policy may form: ``config.cp`` (a power of two, at
    most ``lanes``) when set, else ``lanes``. ``cp=1`` is plain data parallelism: one lane per group."""
    cp = config.cp
    if cp is None:
        return lanes
    if cp & (cp - 1) or cp > lanes:
        raise ValueError(f"policy '{policy}': --cp {cp} must be a power of two of at most the {lanes} lanes "
                         f"per stage (it caps the CP degree on aligned lane blocks)")
    return cp


def sp_degrees(config: PlanConfig, lanes: int, min_degree: int, policy: str) -> list[int]:
    """The SP degrees a per-microbatch SP policy may use: aligned powers of two from ``min_degree`` up to
    ``--cp`` (or the pool's lanes); one line when none is left."""
    top = max_cp_degree(config, lanes, policy)  # cp caps the SP degree; cp=1: plain DP
    degrees = [d for d in allowed_degrees(lanes, min_degree=min_degree) if d <= top]
    if not degrees:
        raise ValueError(f"policy '{policy}': min_degree {min_degree} exceeds the largest allowed degree {top} "
                         f"(the pool's {lanes} lanes, --cp)")
    return degrees


def refuse_flags(config: PlanConfig, policy: str, flags: Sequence[str], why: str, *, cp1_ok: bool = False) -> None:
    """One clear error when a flag the policy cannot honour is set (never silently ignored).
    ``cp1_ok``: the policy's groups are single lanes anyway, so ``cp=1`` holds."""
    for flag in flags:
        v = getattr(config, flag)
        if v is not None and not (cp1_ok and flag == "cp" and v == 1):
            raise ValueError(f"policy '{policy}' cannot honour --{flag} {v}: {why}")
