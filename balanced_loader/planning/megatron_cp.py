r"""Megatron-Core's hybrid (dynamic) context-parallel execution as a contract-1 plan, and hydra's schedule of
samples for it: the planning half of :mod:`balanced_loader.integrations.megatron` (whose docstring describes
Megatron's scheduler interface and execution model: each sample its own forward and backward on the ranks that
list it, groups of power-of-two aligned blocks, a barrier after every group but the last).

**Cost.** Time is contract 2 (:mod:`balanced_loader.cost`): a sample of ``s`` tokens on ``d`` ranks takes
``microbatch_ms + (q s^2 + l s) / d + comm(s, d)``; :func:`modeled_ms` judges any schedule, Megatron's
or ours, by turning it into a contract-1 plan (each sample its own microbatch, a barrier after each
group) and running :func:`balanced_loader.simulate.step_ms` on it.

**The plan** (:func:`plan_samples`): one group (no barrier). Every sample gets a degree from a load
target ``T`` as in :mod:`balanced_loader.planning.policies.hydra` but with Megatron's accounting (every
sample pays ``microbatch_ms`` on each of its ranks, the degrees are the allowed ones): the smallest
allowed degree at least the memory fit (``ceil(s / d) <= max_seq_len_per_rank``) whose time is at most
``T``, with ``T`` the smallest value at or above the area bound (lane time over ``N``) and the longest
sample's best time. Samples are then placed widest first, longest first, each on the aligned block of its
degree that frees up first (:func:`balanced_loader.planning.packing.block_place`; a block up to four times
wider is taken when it finishes sooner than ``T`` allows). Widest first keeps every block's ranks level,
so in Megatron's execution no rank waits for a partner: every rank is busy until its last sample.
A few targets are tried and the fastest kept; a batch with too few samples to give every rank one
falls back to a recursive split of the ranks that covers all of them; and Megatron's own algorithm (the
faithful reproduction :func:`balanced_loader.planning.policies.mcore_dcp.schedule`) is a candidate too, so
the result is never slower than Megatron's under the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, floor_level
from balanced_loader.loader_args import MAX_TOKENS
from balanced_loader.plan import Group, StepPlan

ESCALATE = 2  # a sample may take a block up to 2**ESCALATE times its target degree
RETARGETS = 3  # further targets tried above the first


def group_sizes(world_size: int) -> list[int]:
    """The CP sizes Megatron-Core can run a sample on in a DP x CP group of ``world_size`` ranks: 1, the powers
    of two it creates groups for (``create_hybrid_dp_cp_groups``: ``2 <= k < 2^floor(log2 N)``), and ``N``."""
    top = floor_level(world_size)
    return sorted({1, world_size, *(1 << i for i in range(1, top))})


def allowed_block(first: int, size: int, world_size: int) -> bool:
    """Whether ranks ``[first, first + size)`` form one of Megatron's hybrid DP x CP groups (or one rank)."""
    if size == world_size:
        return first == 0
    return size in group_sizes(world_size) and first % size == 0 and first + size <= world_size


def normalize_samples(sample_id_seqlens: Any) -> tuple[list[Any], np.ndarray]:
    """``(ids, [n] int64 lengths)`` of ``[(id, seqlen), ...]`` (ints, numpy or torch scalars)."""
    import operator

    ids, lens = [], []
    try:
        pairs = list(sample_id_seqlens)
    except TypeError:
        raise ValueError(f"sample_id_seqlens must be a list of (sample id, sequence length) pairs, got "
                         f"{type(sample_id_seqlens).__name__}") from None
    if not pairs:
        raise ValueError("sample_id_seqlens is empty: a step needs at least one sample")
    for k, pair in enumerate(pairs):
        try:
            sid, s = pair
            if isinstance(s, (bool, np.bool_, str, bytes)):
                raise TypeError
            s = operator.index(s)  # an integer (int, numpy or torch integer scalar): 1.5 or "10" is not a length
            sid = int(sid) if not isinstance(sid, (str, bytes)) else sid
        except (TypeError, ValueError):
            raise ValueError(f"sample_id_seqlens[{k}] is {pair!r}, not a (sample id, sequence length) pair of "
                             f"integers") from None
        if s > MAX_TOKENS:
            raise ValueError(f"sample {sid} has length {s}, over {MAX_TOKENS:,} tokens")
        if s <= 0:
            raise ValueError(f"sample {sid} has length {s}; every sub-sample must have tokens (Megatron's "
                             f"HybridCPDataLoaderWrapper drops empty ones)")
        ids.append(sid)
        lens.append(s)
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"sample id {dup} appears twice in sample_id_seqlens; ids must be unique")
    return ids, np.asarray(lens, dtype=np.int64)




def run_order(grp: Sequence[Sequence[Any]]) -> dict[Any, int]:
    """Microbatch index of every sample of a group when each rank runs its list in order and a sample starts
    once all its ranks reach it: ``k = 1 + max`` over its ranks of their previous sample's ``k``."""
    pos = [0] * len(grp)
    head: dict[Any, list[int]] = {}  # sample -> ranks whose next sample it is
    ready: list[Any] = []
    holders: dict[Any, int] = {}
    for lst in grp:
        for sid in lst:
            holders[sid] = holders.get(sid, 0) + 1

    def arrive(r: int) -> None:
        if pos[r] < len(grp[r]):
            sid = grp[r][pos[r]]
            head.setdefault(sid, []).append(r)
            if len(head[sid]) == holders[sid]:
                ready.append(sid)

    for r in range(len(grp)):
        arrive(r)
    last = [-1] * len(grp)
    k_of: dict[Any, int] = {}
    while ready:
        sid = ready.pop()
        rs = head.pop(sid)
        k = 1 + max(last[r] for r in rs)
        k_of[sid] = k
        for r in rs:
            last[r] = k
            pos[r] += 1
            arrive(r)
    if len(k_of) != len(holders):
        stuck = next(s for s in holders if s not in k_of)
        raise ValueError(f"the per-rank orders wait on each other in a cycle (sample {stuck} never starts): a "
                         f"deadlock in Megatron's execution")
    return k_of


def to_plan(sample_id_groups: Sequence[Sequence[Sequence[Any]]], sample_id_seqlens: Any,
            world_size: int) -> StepPlan:
    """A schedule as a contract-1 plan: each sample its own microbatch in its ranks' order, a barrier before
    the first microbatch of every group after the first (segments name samples by their position in
    ``sample_id_seqlens``)."""
    from balanced_loader.planning.policies.common import one_pool_plan

    ids, lens = normalize_samples(sample_id_seqlens)
    index = {sid: i for i, sid in enumerate(ids)}
    micro: list[list[Group]] = []
    starts: list[int] = []
    for grp in sample_id_groups:
        base = len(micro)
        starts.append(base)
        k_of = run_order(grp)
        ranks: dict[Any, list[int]] = {}
        for r, lst in enumerate(grp):
            for sid in lst:
                ranks.setdefault(sid, []).append(r)
        for sid, k in k_of.items():
            while len(micro) <= base + k:
                micro.append([])
            i = index[sid]
            micro[base + k].append(Group(lanes=tuple(ranks[sid]), segments=((i, 0, int(lens[i])),)))
    plan = one_pool_plan(0, world_size, 1, 1, tuple(tuple(m) for m in micro))
    return replace(plan, pools=(replace(plan.pools[0], barriers=tuple(starts[1:])),))


def modeled_ms(sample_id_groups: Sequence[Sequence[Sequence[Any]]], sample_id_seqlens: Any, cost: CostModel,
               world_size: int) -> float:
    """The step time of a schedule under Megatron's execution model and a contract-2 cost (module doc)."""
    from balanced_loader.simulate import step_ms

    return float(step_ms(to_plan(sample_id_groups, sample_id_seqlens, world_size), cost))


def lower_bound_ms(lengths: np.ndarray, sc: ShapeCost, world_size: int, cap: int) -> float:
    """A bound below every valid schedule under Megatron's model: the larger of the lane time (each sample at its
    cheapest allowed degree, ``microbatch_ms`` on each of its ranks) over the ranks, and the longest sample's
    best time."""
    best_lane, best_time = np.full(len(lengths), np.inf), np.full(len(lengths), np.inf)
    s = np.asarray(lengths, dtype=np.float64)
    for d in group_sizes(world_size):
        t = sc.microbatch_ms + sc.compute_ms(s) / d + sc.comm_ms(s, d)
        ok = s <= cap * d
        best_lane = np.where(ok, np.minimum(best_lane, d * t), best_lane)
        best_time = np.where(ok, np.minimum(best_time, t), best_time)
    return float(max(best_lane.sum() / world_size, best_time.max(initial=0.0)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A schedule of item indices: ``groups[j][r]`` the items rank ``r`` runs in group ``j``, in order."""

    groups: list[list[list[int]]]  # [groups][world_size][items in run order]
    modeled_ms: float  # under Megatron's execution model and the cost
    how: str  # which candidate won: "target", "cover" or "megatron"


def _levels(world_size: int) -> tuple[int, np.ndarray]:
    """``(top level, [top + 1] bool allowed)``: block levels ``2**v`` Megatron has groups for (the level of ``N``
    itself only when ``N`` is a power of two; another ``N`` is the separate whole-group degree)."""
    top = floor_level(world_size)
    sizes = set(group_sizes(world_size))
    return top, np.asarray([(1 << v) in sizes for v in range(top + 1)])


def _times(sc: ShapeCost, lengths: np.ndarray, top: int) -> np.ndarray:
    """``[n, top + 1]`` time of each sample alone on ``2**v`` ranks."""
    d = np.left_shift(1, np.arange(top + 1)).astype(np.float64)  # [levels]
    s = np.asarray(lengths, dtype=np.float64)[:, None]  # [n, 1]
    return sc.microbatch_ms + sc.compute_ms(s) / d[None, :] + sc.comm_ms(s, d[None, :])


def _target(g: np.ndarray, mem: np.ndarray, world_size: int, tries: int) -> list[float]:
    """The load target ``T*`` (module doc) and the next ``tries`` targets where some sample's degree drops.

    ``g`` ``[n, levels]`` is masked (``inf`` where a level is not allowed for a sample), ``mem`` ``[n]`` each
    sample's memory level. With ``level(T)`` the smallest allowed level whose time is at most ``T``,
    ``area(T) = sum 2**level g / N`` never grows with ``T``; ``T*`` is the smallest ``T >= area(T)`` at or above
    the longest sample's best time."""
    n, levels = g.shape
    deg = np.left_shift(1, np.arange(levels)).astype(np.float64)
    lane = g * deg[None, :]  # [n, levels] lane time
    rows = np.arange(n)
    t_min = float(np.min(g, axis=1).max()) if n else 0.0
    base = lane[rows, mem]  # [n] lane time at the memory level
    area0 = float(base.sum()) / world_size
    t_lo = max(t_min, area0)
    cand = np.flatnonzero(g[rows, mem] > t_lo)  # the only samples whose level depends on T >= t_lo
    if not len(cand):
        return [t_lo]
    gc, lc, bc = g[cand], lane[cand], base[cand]

    def area(t: float) -> float:
        fits = gc <= t
        lv = np.argmax(fits, axis=1)  # smallest level with time <= t (exists: t >= t_min)
        return area0 + float((lc[np.arange(len(cand)), lv] - bc).sum()) / world_size

    bps = np.unique(gc[np.isfinite(gc) & (gc > t_lo)])  # [b] where some level drops
    pts = np.concatenate([[t_lo], bps])
    # the first breakpoint index j at which area(pts[j]) <= pts[j + 1] (h(T) = area(T) - T only falls)
    lo, hi = 0, len(pts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if area(float(pts[mid])) <= float(pts[mid + 1]):
            hi = mid
        else:
            lo = mid + 1
    t_star = max(float(pts[lo]), area(float(pts[lo])))
    return [t_star] + [float(b) for b in pts[lo + 1:lo + 1 + tries] if b > t_star]


def _levels_at(g: np.ndarray, mem: np.ndarray, t: float) -> np.ndarray:
    """``[n]`` smallest allowed level with time <= ``t`` (the memory level when none)."""
    fits = g <= t
    return np.where(fits.any(axis=1), np.argmax(fits, axis=1), mem)


def _place(g: np.ndarray, pref: np.ndarray, world_size: int, target: float, full: np.ndarray,
           full_ms: np.ndarray) -> tuple[list[list[int]], float] | None:
    """Items onto blocks (module doc): ``(per-rank item lists, makespan)``; ``None`` when a rank gets none.

    ``full`` ``[f]`` are items that need the whole group of a world size that is not a power of two (placed
    first, on every rank, taking ``full_ms``); the others go to aligned blocks of ``2**level`` ranks."""
    from balanced_loader.planning.packing import block_place

    rest = np.setdiff1d(np.arange(len(pref)), full)
    lists: list[list[int]] = [[int(i) for i in full] for _ in range(world_size)]
    load = np.full(world_size, float(full_ms.sum()))
    nxt = np.full(world_size, len(full), dtype=np.int64)
    if len(rest):
        times = g[rest].copy()
        lv = np.arange(times.shape[1])[None, :]
        times[(lv < pref[rest][:, None]) | (lv > pref[rest][:, None] + ESCALATE)] = np.inf
        own = times[np.arange(len(rest)), pref[rest]]
        order = np.lexsort((-own, -pref[rest]))  # widest first, then longest
        idx = rest[order]
        pl = block_place(times[order], pref[idx], world_size, load, nxt, target=target)
        if (pl.level < 0).any():
            return None
        for i, lane, level in zip(idx.tolist(), pl.lane.tolist(), pl.level.tolist()):
            for r in range(lane, lane + (1 << level)):
                lists[r].append(i)
        load = pl.load
    if not all(lists):
        return None
    return lists, float(load.max())


def _cover(work: np.ndarray, mem_deg: np.ndarray, world_size: int) -> list[list[int]]:
    """Every rank busy with few samples: split the ranks recursively into Megatron's blocks; a sample whose
    memory needs more than a child block (or the largest when there are fewer samples than children) spans
    the block, the others go to the children longest first onto the least loaded, each child at least one."""
    lists: list[list[int]] = [[] for _ in range(world_size)]
    sizes = group_sizes(world_size)

    def children(first: int, size: int) -> list[tuple[int, int]]:
        out, pos = [], first
        while pos < first + size:
            k = max(c for c in sizes if c < size and pos % c == 0 and pos + c <= first + size)
            out.append((pos, k))
            pos += k
        return out

    def assign(items: list[int], first: int, size: int) -> None:
        if size == 1:
            lists[first].extend(items)
            return
        kids = children(first, size)
        widest = max(k for _, k in kids)
        span = [i for i in items if mem_deg[i] > widest]
        rest = [i for i in items if mem_deg[i] <= widest]
        if not span and len(rest) < len(kids):
            span, rest = rest[:1], rest[1:]  # too few to give every child one: the longest spans the block
        while True:
            loads = [0.0] * len(kids)
            per: list[list[int]] = [[] for _ in kids]
            for i in rest:  # longest first (items come sorted), onto the least loaded child that holds it
                c = min((c for c in range(len(kids)) if mem_deg[i] <= kids[c][1]), key=lambda c: (loads[c], c))
                per[c].append(i)
                loads[c] += work[i] / kids[c][1]
            if span or all(per):
                break
            span, rest = rest[:1], rest[1:]  # a child no sample fits: the longest spans the block instead
        for i in span:
            for r in range(first, first + size):
                lists[r].append(i)
        for (f, k), its in zip(kids, per):
            if its:
                assign(its, f, k)

    order = sorted(range(len(work)), key=lambda i: (-mem_deg[i], -work[i], i))
    if order:
        assign(order, 0, world_size)
    return lists


def plan_samples(lengths: np.ndarray, world_size: int, max_seq_len_per_rank: int, cost: CostModel, *,
                 megatron_candidate: bool = True) -> Schedule:
    """The schedule of samples of ``lengths`` ``[n]`` on ``world_size`` DP x CP ranks (module doc): the fastest
    valid candidate under :func:`modeled_ms`."""
    from balanced_loader.planning.policies.mcore_dcp import schedule as megatron_schedule

    lengths = np.asarray(lengths, dtype=np.int64)
    n, cap, sc = len(lengths), int(max_seq_len_per_rank), cost.shape(1, 1)
    if n == 0:
        return Schedule(groups=[[[] for _ in range(world_size)]], modeled_ms=0.0, how="target")
    if int(lengths.max()) > cap * world_size:
        i = int(np.argmax(lengths))
        raise ValueError(f"sample {i} has {int(lengths[i])} tokens, more than max_seq_len_per_rank {cap} x "
                         f"{world_size} DP x CP ranks hold; raise max_seq_len_per_rank or use more ranks")
    top, allowed = _levels(world_size)
    fit = np.ceil(np.log2(np.maximum(lengths / cap, 1.0))).astype(np.int64)  # [n] power-of-two memory level
    ok = allowed[None, :] & (np.arange(top + 1)[None, :] >= fit[:, None])  # [n, levels]
    full = np.flatnonzero(~ok.any(axis=1))  # only the whole group (N not a power of two) holds these
    g = np.where(ok, _times(sc, lengths, top), np.inf)  # [n, levels]
    mem = np.where(ok.any(axis=1), np.argmax(ok, axis=1), top)  # [n]
    full_ms = sc.microbatch_ms + sc.compute_ms(lengths[full].astype(np.float64)) / world_size + \
        sc.comm_ms(lengths[full].astype(np.float64), world_size)
    cands: list[Schedule] = []
    g_part = g.copy()
    g_part[full] = sc.microbatch_ms  # not placed by level: a finite time keeps the target's arithmetic sane
    mem_part = mem.copy()
    for t in [*_target(g_part, mem_part, world_size, RETARGETS), float("inf")]:
        placed = _place(g, _levels_at(g, mem, t), world_size, t, full, full_ms)
        if placed is not None:
            cands.append(Schedule(groups=[placed[0]], modeled_ms=placed[1], how="target"))
    if not cands:
        mem_deg = np.where(ok.any(axis=1), np.left_shift(1, mem), world_size)
        lists = _cover(np.asarray(sc.compute_ms(lengths.astype(np.float64))), mem_deg, world_size)
        cands.append(Schedule(groups=[lists], modeled_ms=modeled_ms([lists], _pairs(lengths), cost, world_size),
                              how="cover"))
    if megatron_candidate and world_size & (world_size - 1) == 0:  # else Megatron's groups are not its own
        rounds = megatron_schedule(lengths, world_size, cap)
        groups = []
        for rnd in rounds:
            per = [[] for _ in range(world_size)]
            for first, size, docs in rnd:
                for r in range(first, first + size):
                    per[r] = list(docs)
            groups.append(per)
        cands.append(Schedule(groups=groups, modeled_ms=modeled_ms(groups, _pairs(lengths), cost, world_size),
                              how="megatron"))
    return min(cands, key=lambda c: c.modeled_ms)


def _pairs(lengths: np.ndarray) -> list[tuple[int, int]]:
    return list(enumerate(lengths.tolist()))
