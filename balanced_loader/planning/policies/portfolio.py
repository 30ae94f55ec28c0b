r"""hydra's portfolio: where one placement cannot cover every regime, several plans are built and the fastest
by the contract-2 model is kept (:func:`best_plan`).

Why a portfolio (the regime sweep of ``tools/sweep_planner.py``): hydra's load-target placement is within
0.5% of the lower bound where docs are many per lane and the fixed cost per pass is small (Wikipedia on
GPU presets), but it loses to simpler plans where

* **the fixed cost per pass dominates** (``microbatch_ms`` the work of thousands of tokens): a wide doc that
  runs alone on ``d`` lanes pays ``microbatch_ms`` on each of them for a group that is part empty, where a
  static packer shares it among the docs of a full bin. Co-packing short docs into the room of wide groups
  costs their CP communication (``B s / bw(d)`` lane-ms) and saves their share of a pass
  (``microbatch_ms s / cap``), so it pays exactly where ``B / bw(d) < microbatch_ms / cap``
  (:func:`copack_levels`); there, wide docs packed together into bins of ``D`` lanes fill their groups
  better still (:func:`wide_bins`), and where wide docs have several widths, the narrow ones packed
  together while the widest run alone (:func:`mixed_bins`).
* **docs per lane are few** (fewer than :data:`SPARSE` on average: small worlds, long contexts): the
  granularity of groups and passes leaves the load target far off, and balancing the docs over groups of
  one degree (verl's Karmarkar-Karp, bins by longest-processing-time) is often closer.

The candidates, each a per-item ``(microbatch, first lane, degree)`` plan on aligned power-of-two blocks
within the ``cp`` limit: hydra's own placement (always), its co-packed variant, wide bins and mixed
bins (where co-packing pays), and where docs are few per lane or co-packing pays, one plan per degree by bins and by
Karmarkar-Karp and the plans of the simpler policies (``maxlen``, ``static-sp``, ``token-kk``,
``batch-ada``, ``greedy``). Each is timed by :func:`balanced_loader.planning.kernels.evaluate.items_step_kernel`
(no contract-1 object is built before the winner is known); ties keep the earlier candidate. The gates are
properties of the batch and the cost model, never of the clock, so the plan stays a pure function of its
inputs; the extra candidates cost O(n log n) each and run only where hydra's placement misses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from balanced_loader.cost import ShapeCost, fit_levels
from balanced_loader.planning.packing import BFD_MAX_CAPACITY, block_place, cost_pack, fill_passes, pack

SPARSE = 16  # docs per lane below which the single-degree plans join the portfolio
MAX_ITEMS = 1 << 15  # ... and at most this many items (the simpler policies' plans are O(n log n) in Python)
MAX_KK_GROUPS = 64  # Karmarkar-Karp plans only up to this many groups (O(n k) per plan)
MAX_BLASTER = 1024  # FlexSP's blaster on larger batches too where docs need 8 lanes or more (BLASTER_LEVEL)
BLASTER_LEVEL = 3
MAX_COSTLY = 512  # the simpler policies' plans and FlexSP's blaster (Python loops, O(n^2)) up to this many items
KK_LEVELS = 3  # Karmarkar-Karp plans at 2, 4, 8 times the memory-fit degree of the longest item
STOP = 0.002  # the portfolio stops once a plan is this close to the floor (Evaluator.floor_ms)
ESCALATE_SLACK = (0.01, 0.04, 0.1)  # targets above the load target: escalation keeps blocks small
TARGET_SLACK = (0.0, 0.05, 0.1, 0.2)  # groups filled to these margins above a floor or target
MISSED = 0.01  # hydra's placement this far above its load target: placements without escalation join

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # per item: microbatch, first lane, degree ([n] each)


class Evaluator:
    """Contract-2 step time of per-item plans of one batch on one pool (``lanes`` lanes of shape ``sc``)."""

    def __init__(self, lengths: np.ndarray, sc: ShapeCost, lanes: int, pp: int) -> None:
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # [n]
        self.s = self.lengths.astype(np.float64)  # [n]
        self.work = np.asarray(sc.compute_ms(self.s), dtype=np.float64)  # [n] ms on one lane
        self.sc, self.lanes, self.pp = sc, lanes, pp
        top = lanes.bit_length()
        deg = np.left_shift(1, np.arange(top)).astype(np.float64)  # [levels]
        # ms per token per lane of CP communication on 2**v lanes (0 on one lane)
        self.comm = np.where(deg > 1, sc.comm_bytes_per_token / deg / (sc.bandwidths(deg) * 1e6), 0.0)

    def floor_ms(self, top: int, idx: np.ndarray | None = None) -> float:
        """A lower bound of every plan of power-of-two groups up to ``2**top`` lanes (pp = 1) of the items ``idx``
        (default all): the area (each item at its least lane-time plus ``microbatch_ms`` per ``cap`` tokens, over
        the lanes) and the longest item's least group time
        (:func:`balanced_loader.planning.solvers.bound.step_lower_bound`'s first two terms)."""
        cap = self.sc.max_tokens_per_lane
        s = self.s if idx is None else self.s[idx]
        deg = np.left_shift(1, np.arange(top + 1)).astype(np.float64)  # [levels]
        seg = self.seg_table(top, idx)  # [n, levels]
        area = float(((deg[None, :] * seg).min(axis=1) + self.sc.microbatch_ms * s / cap).sum()) / self.lanes
        return max(area, float(self.sc.microbatch_ms + seg.min(axis=1).max()))

    def seg_table(self, top: int, idx: np.ndarray | None = None) -> np.ndarray:
        """``[n, top + 1]`` each item's segment ms (:meth:`seg`) on ``2**v`` lanes, ``inf`` where it does not fit
        (``s > 2**v * cap``), for the items ``idx`` (default all)."""
        s, work = (self.s, self.work) if idx is None else (self.s[idx], self.work[idx])
        deg = np.left_shift(1, np.arange(top + 1)).astype(np.float64)  # [levels]
        seg = work[:, None] / deg[None, :] + self.comm[None, :top + 1] * s[:, None]  # [n, levels]
        seg[s[:, None] > self.sc.max_tokens_per_lane * deg[None, :]] = np.inf  # memory
        return seg

    def seg(self, deg: np.ndarray) -> np.ndarray:
        """``[n]`` the time each item adds to a group of its degree (``ShapeCost.segment_ms``)."""
        lv = np.log2(deg).astype(np.int64)
        return self.work / deg + self.comm[lv] * self.s

    def ms(self, plan: Arrays) -> float:
        from balanced_loader.planning.kernels.evaluate import items_step_kernel

        mb, lane0, deg = (np.ascontiguousarray(a, dtype=np.int64) for a in plan)
        return float(items_step_kernel(mb, lane0, deg, self.seg(deg), float(self.sc.microbatch_ms), self.pp,
                                       self.lanes)[0])


def copack_levels(sc: ShapeCost, top: int) -> np.ndarray:
    """``[top + 1]`` bool: levels ``v >= 1`` where a short doc co-packed into a group of ``2**v`` lanes costs
    less CP communication (``B / bw``, lane-ms per token) than its share of a pass (``microbatch_ms / cap``)."""
    deg = np.left_shift(1, np.arange(top + 1)).astype(np.float64)
    lane_ms = np.where(deg > 1, sc.comm_bytes_per_token / (sc.bandwidths(deg) * 1e6), np.inf)  # [levels]
    return lane_ms < sc.microbatch_ms / sc.max_tokens_per_lane


def _group_table(ev: Evaluator, lengths: np.ndarray, extra: np.ndarray, levels: np.ndarray, top: int) -> np.ndarray:
    """``[w, top + 1]`` each wide group's time at its own level only (``inf`` elsewhere): ``microbatch_ms`` +
    its doc's segment + ``extra`` (what co-packed docs add)."""
    s = lengths.astype(np.float64)
    deg = np.left_shift(1, levels).astype(np.float64)
    own = ev.sc.microbatch_ms + np.asarray(ev.sc.compute_ms(s)) / deg + ev.comm[levels] * s + extra
    table = np.full((len(lengths), top + 1), np.inf)
    table[np.arange(len(lengths)), levels] = own
    return table


def _place_jobs(table: np.ndarray, levels: np.ndarray, lanes: int, load=None, next_k=None):
    """Jobs (groups of their own level) widest first, then longest, onto the aligned block that starts first."""
    own = table[np.arange(len(levels)), levels]
    order = np.lexsort((-own, -levels))
    pl = block_place(table[order], levels[order], lanes, load, next_k)
    mb = np.empty(len(levels), np.int64)
    lane0 = np.empty(len(levels), np.int64)
    mb[order], lane0[order] = pl.microbatch, pl.lane
    return mb, lane0, pl.load, pl.next_microbatch


def copack_place(ev: Evaluator, levels: np.ndarray, desc: np.ndarray, top: int) -> Arrays:
    """hydra's placement at ``levels`` with short docs first co-packed into the room of wide groups (longest
    first into the group with the least added work that holds it, at the levels of :func:`copack_levels`);
    wide groups by longest-processing-time on their blocks, the rest into passes (``fill_passes``)."""
    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    n = len(ln)
    cap = sc.max_tokens_per_lane
    mb = np.zeros(n, np.int64)
    lane0 = np.zeros(n, np.int64)
    deg = np.left_shift(1, levels).astype(np.int64)
    wide = np.flatnonzero(levels > 0)
    short = desc[levels[desc] == 0]  # one-lane items, longest first
    host = np.full(n, -1, np.int64)  # [n] the wide item whose group a short item joins
    load = np.zeros(lanes)
    next_k = np.zeros(lanes, np.int64)
    if len(wide):
        room = deg[wide] * cap - ln[wide]
        room[~copack_levels(sc, top)[levels[wide]]] = 0
        if len(short) and room.any():
            cp = cost_pack(ln[short], ev.work[short], len(wide), cap, load=np.zeros(len(wide)), room=room)
            ok = cp.bins >= 0
            host[short[ok]] = wide[cp.bins[ok]]
        joined = np.flatnonzero(host >= 0)
        slot = np.full(n, -1, np.int64)
        slot[wide] = np.arange(len(wide))
        added = np.bincount(slot[host[joined]], minlength=len(wide),
                            weights=ev.work[joined] / deg[host[joined]] + ev.comm[levels[host[joined]]] * ev.s[joined])
        table = _group_table(ev, ln[wide], added, levels[wide], top)
        mb[wide], lane0[wide], load, next_k = _place_jobs(table, levels[wide], lanes)
        mb[joined], lane0[joined], deg[joined] = mb[host[joined]], lane0[host[joined]], deg[host[joined]]
        short = short[host[short] < 0]
    if len(short):
        fp = fill_passes(ln[short], ev.work[short], load, cap, sc.microbatch_ms)
        mb[short] = next_k[fp.lane] + fp.pass_
        lane0[short] = fp.lane
    return mb, lane0, deg


def block_first(ev: Evaluator, levels: np.ndarray, target: float, desc: np.ndarray, top: int, *, share: float = np.inf,
                escalate: int = 2, longest_first: bool = False) -> Arrays:
    """hydra's placement with other choices: the wide items, and the one-lane ones whose group takes at least
    ``share`` of the target, on blocks (widest then longest first, or ``longest_first``), each on the block of its
    level that starts first, or where that would end after ``target``, on the smallest block up to
    ``2**escalate`` times larger that ends by it (else the one that finishes first); the rest into passes.

    Where equal long docs do not divide among the lanes (26 on 8 lanes), ``share`` lets the last ones run on 2 or
    4 lanes instead of a third pass on two lanes; ``escalate=0`` keeps every item on its own level, which
    fragments the blocks less when wide docs of many widths are few per lane."""
    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    n = len(ln)
    big = np.flatnonzero((levels > 0) | (sc.microbatch_ms + ev.work >= share * target))
    mb = np.zeros(n, np.int64)
    lane0 = np.zeros(n, np.int64)
    deg = np.ones(n, np.int64)
    load = np.zeros(lanes)
    next_k = np.zeros(lanes, np.int64)
    if len(big):
        lv = levels[big]
        vv = np.arange(top + 1)[None, :]
        table = (sc.microbatch_ms + ev.work[big][:, None] / (1 << vv) + ev.comm[:top + 1][None, :] * ev.s[big][:, None])
        table[(vv < lv[:, None]) | (vv > lv[:, None] + escalate)] = np.inf
        mine = table[np.arange(len(big)), lv]
        order = np.argsort(-mine, kind="stable") if longest_first else np.lexsort((-mine, -lv))
        pl = block_place(table[order], lv[order], lanes, load, next_k, target=target, smallest=True)
        idx = big[order]
        mb[idx], lane0[idx], deg[idx] = pl.microbatch, pl.lane, np.left_shift(1, pl.level)
        load, next_k = pl.load, pl.next_microbatch
    short = desc[np.isin(desc, big, invert=True)]
    if len(short):
        fp = fill_passes(ln[short], ev.work[short], load, sc.max_tokens_per_lane, sc.microbatch_ms)
        mb[short] = next_k[fp.lane] + fp.pass_
        lane0[short] = fp.lane
    return mb, lane0, deg


def tail_groups(ev: Evaluator, levels: np.ndarray, desc: np.ndarray, keep: int, level: float, top: int) -> Arrays:
    """The ``keep`` longest items by hydra's placement (wide ones on blocks, one-lane ones into passes), the rest
    (the tail, where one doc per lane is too coarse to balance) packed into bins of ``2**level`` lanes that run
    after them, longest-processing-time onto the blocks that are free first; ``level < 0``: the tail in groups
    of several widths filled to ``-level`` times its own floor (:func:`target_bins`)."""
    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    n = len(ln)
    head, tail = desc[:keep], desc[keep:]
    mb = np.zeros(n, np.int64)
    lane0 = np.zeros(n, np.int64)
    deg = np.ones(n, np.int64)
    load = np.zeros(lanes)
    next_k = np.zeros(lanes, np.int64)
    wide = head[levels[head] > 0]
    if len(wide):
        table = _group_table(ev, ln[wide], np.zeros(len(wide)), levels[wide], top)
        mb[wide], lane0[wide], load, next_k = _place_jobs(table, levels[wide], lanes)
        deg[wide] = np.left_shift(1, levels[wide])
    short = head[levels[head] == 0]
    if len(short):
        fp = fill_passes(ln[short], ev.work[short], load, sc.max_tokens_per_lane, sc.microbatch_ms)
        mb[short] = next_k[fp.lane] + fp.pass_
        lane0[short] = fp.lane
        load = fp.load
        np.maximum.at(next_k, fp.lane, next_k[fp.lane] + fp.pass_ + 1)
    if len(tail) and level < 0:  # the tail in groups filled to ``-level`` x its own floor (target_bins)
        t_tail = ev.floor_ms(top, tail) * -level  # a group's own time, the tail starts after the head
        t_mb, t_lane, t_deg = target_bins(ev, tail, t_tail, top, fit_levels(ln, sc.max_tokens_per_lane), load, next_k)
        mb[tail], lane0[tail], deg[tail] = t_mb[tail], t_lane[tail], t_deg[tail]
    elif len(tail):
        d = 1 << level
        cap = d * sc.max_tokens_per_lane
        bins = pack(ln[tail], cap, "bfd" if cap <= BFD_MAX_CAPACITY else "ffd", repair=False)
        times = sc.microbatch_ms + np.bincount(bins, weights=ev.work[tail] / d + ev.comm[level] * ev.s[tail])
        table = np.full((len(times), top + 1), np.inf)
        table[:, level] = times
        jm, jl, _, _ = _place_jobs(table, np.full(len(times), level, np.int64), lanes, load, next_k)
        mb[tail], lane0[tail], deg[tail] = jm[bins], jl[bins], d
    return mb, lane0, deg


def wide_bins(ev: Evaluator, levels: np.ndarray, level: int, desc: np.ndarray, top: int) -> Arrays | None:
    """Wide items packed together first-fit-decreasing into bins of ``2**level`` lanes, short items co-packed
    into their room where that pays, the rest into one-lane bins; every bin a group, longest-processing-time
    onto blocks. ``None`` when some wide item needs more than ``2**level`` lanes."""
    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    cap = sc.max_tokens_per_lane
    d = 1 << level
    wide = np.flatnonzero(levels > 0)
    if not len(wide) or int(ln[wide].max()) > d * cap:
        return None
    n = len(ln)
    wb = pack(ln[wide], d * cap, "ffd", repair=False)  # [w] bin of each wide item
    nw = int(wb.max()) + 1
    bin_of = np.full(n, -1, np.int64)
    bin_of[wide] = wb
    seg_d = ev.work / d + ev.comm[level] * ev.s  # [n] each item's time in a group of d lanes
    short = desc[levels[desc] == 0]
    if len(short) and copack_levels(sc, top)[level]:
        room = d * cap - np.bincount(wb, weights=ln[wide], minlength=nw).astype(np.int64)
        busy = np.bincount(wb, weights=seg_d[wide], minlength=nw)
        cp = cost_pack(ln[short], seg_d[short], nw, cap, load=busy, room=room)
        ok = cp.bins >= 0
        bin_of[short[ok]] = cp.bins[ok]
        short = short[~ok]
    in_wide = np.flatnonzero(bin_of >= 0)
    times = sc.microbatch_ms + np.bincount(bin_of[in_wide], weights=seg_d[in_wide], minlength=nw)  # [nw]
    lv = np.full(nw, level, np.int64)
    if len(short):
        sb = pack(ln[short], cap, "ffd", repair=False)
        bin_of[short] = nw + sb
        times = np.concatenate([times, sc.microbatch_ms + np.bincount(sb, weights=ev.work[short])])
        lv = np.concatenate([lv, np.zeros(int(sb.max()) + 1, np.int64)])
    table = np.full((len(times), top + 1), np.inf)
    table[np.arange(len(times)), lv] = times
    jm, jl, _, _ = _place_jobs(table, lv, lanes)
    return jm[bin_of], jl[bin_of], np.left_shift(1, lv[bin_of])


def mixed_bins(ev: Evaluator, levels: np.ndarray, level: int, desc: np.ndarray, top: int) -> Arrays | None:
    """Wide items of at most ``2**level`` lanes packed together first-fit-decreasing into bins of that many lanes,
    short items co-packed into their room (least busy bin first), the wider items alone on blocks of their own
    level; every bin and wide item a group, longest-processing-time onto blocks, the short items left into passes.

    Where docs just above the lane cap are many (a 4K doc alone on 2 lanes of 2.9K leaves a third of its
    group empty, ``microbatch_ms`` paid on both lanes), bins of 2 or 4 lanes fill that room with their
    neighbours as FlexSP's MILP does (llama3-8b on H100, man pages at 32K: 2.5% faster than the load-target
    placement, 1.2% faster than FlexSP's). ``None`` when no wide item fits ``2**level`` lanes."""
    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    cap = sc.max_tokens_per_lane
    d = 1 << level
    n = len(ln)
    binned = np.flatnonzero((levels > 0) & (levels <= level))
    if not len(binned):
        return None
    alone = np.flatnonzero(levels > level)
    wb = pack(ln[binned], d * cap, "ffd", repair=False)  # [b] bin of each binned item
    nw = int(wb.max()) + 1
    seg_d = ev.work / d + ev.comm[level] * ev.s  # [n] each item's time in a group of d lanes
    busy = np.bincount(wb, weights=seg_d[binned], minlength=nw)  # [nw]
    bin_of = np.full(n, -1, np.int64)  # [n] the group of each item (-1: into passes)
    bin_of[binned] = len(alone) + wb
    short = desc[levels[desc] == 0]
    if len(short):
        room = d * cap - np.bincount(wb, weights=ln[binned], minlength=nw).astype(np.int64)
        cp = cost_pack(ln[short], seg_d[short], nw, cap, load=busy, room=room)
        ok = cp.bins >= 0
        bin_of[short[ok]] = len(alone) + cp.bins[ok]
        busy = cp.load
        short = short[~ok]
    bin_of[alone] = np.arange(len(alone))
    lv_alone = levels[alone]
    times = np.concatenate([sc.microbatch_ms + ev.work[alone] / np.left_shift(1, lv_alone) + ev.comm[lv_alone]
                            * ev.s[alone], sc.microbatch_ms + busy])  # [groups]
    lv = np.concatenate([lv_alone, np.full(nw, level, np.int64)])
    table = np.full((len(times), top + 1), np.inf)
    table[np.arange(len(times)), lv] = times
    jm, jl, load, next_k = _place_jobs(table, lv, lanes)
    mb, lane0, deg = np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n, np.int64)
    grouped = np.flatnonzero(bin_of >= 0)
    g = bin_of[grouped]
    mb[grouped], lane0[grouped], deg[grouped] = jm[g], jl[g], np.left_shift(1, lv[g])
    if len(short):
        fp = fill_passes(ln[short], ev.work[short], load, cap, sc.microbatch_ms)
        mb[short] = next_k[fp.lane] + fp.pass_
        lane0[short] = fp.lane
    return mb, lane0, deg


def level_bins(ev: Evaluator, level: int, top: int) -> Arrays | None:
    """Every item on ``2**level`` lanes: bins of ``2**level * cap`` tokens (best fit decreasing), each a group,
    longest-processing-time onto the aligned blocks. ``None`` when an item does not fit."""
    d = 1 << level
    cap = ev.sc.max_tokens_per_lane
    if int(ev.lengths.max()) > d * cap:
        return None
    bins = pack(ev.lengths, d * cap, "bfd" if d * cap <= BFD_MAX_CAPACITY else "ffd", repair=False)
    seg = ev.seg(np.full(len(bins), d, np.int64))
    times = ev.sc.microbatch_ms + np.bincount(bins, weights=seg)
    table = np.full((len(times), top + 1), np.inf)
    table[:, level] = times
    jm, jl, _, _ = _place_jobs(table, np.full(len(times), level, np.int64), ev.lanes)
    return jm[bins], jl[bins], np.full(len(bins), d, np.int64)


POLISH_MOVES = 256  # moves of the tail polish per plan
POLISH_ITEMS = 1024  # ... on at most this many tail docs


def polish(ev: Evaluator, plan: Arrays) -> Arrays:
    """The one-lane passes that end each lane of ``plan`` rebalanced by
    :func:`balanced_loader.planning.kernels.polish.polish_tail_kernel` (moves and swaps of docs between those
    passes, or a new pass on the lane that finishes first): never a later finish for any lane it changes."""
    from balanced_loader.planning.kernels.evaluate import items_step_kernel
    from balanced_loader.planning.kernels.polish import polish_tail_kernel

    if ev.pp != 1:  # pipeline fill and drain would depend on the passes' times too
        return plan
    mb, lane0, deg = (np.ascontiguousarray(a, dtype=np.int64) for a in plan)
    lanes = ev.lanes
    last_wide = _lane_max(mb, lane0, deg, np.flatnonzero(deg > 1), lanes, -1)  # [lanes] latest wide microbatch
    tail = np.flatnonzero((deg == 1) & (mb > last_wide[lane0]))  # [t] one-lane items after every wide group
    if not 2 <= len(tail) <= POLISH_ITEMS:  # each move scans the tail: O(tail) per doc of the last lane
        return plan
    head = np.setdiff1d(np.arange(len(mb)), tail)
    _, base = items_step_kernel(mb[head], lane0[head], deg[head], ev.seg(deg)[head], float(ev.sc.microbatch_ms), 1,
                                lanes)
    pass_id = np.unique(mb[tail] * lanes + lane0[tail], return_inverse=True)[1].astype(np.int64)
    new_lane, new_pass = polish_tail_kernel(ev.lengths[tail], ev.work[tail], lane0[tail], pass_id, base,
                                            float(ev.sc.microbatch_ms), int(ev.sc.max_tokens_per_lane), POLISH_MOVES)
    # each lane's tail passes run after everything else on it (first[l]: one past its latest other group), in order
    first = _lane_max(mb, lane0, deg, head, lanes, -1) + 1  # [lanes]
    # a tail item's microbatch: first[lane] + the rank of its pass among its new lane's distinct passes
    span = int(new_pass.max()) + 1
    keys, inv = np.unique(new_lane * span + new_pass, return_inverse=True)  # sorted by lane, then pass
    key_lane = keys // span
    rank = np.arange(len(keys)) - np.searchsorted(key_lane, key_lane, side="left")  # [distinct passes]
    out_mb, out_lane = mb.copy(), lane0.copy()
    out_mb[tail] = first[new_lane] + rank[inv.reshape(-1)]
    out_lane[tail] = new_lane
    return out_mb, out_lane, deg


GROUP_POLISH_ITEMS = 4096  # the group polish only on batches of at most this many items (O(n) scans per move)
GROUP_POLISH_VISITS = 1 << 24  # lanes its step evaluations visit in all (each visits every group's lanes)


def polish_groups(ev: Evaluator, plan: Arrays) -> Arrays:
    """``plan`` after :func:`balanced_loader.planning.kernels.polish.polish_groups_kernel`: docs of the groups
    on the lane that finishes last moved into, or swapped with docs of, other groups (wide ones too, each doc at
    its new group's degree) while the step time falls; blocks and the groups' order unchanged. Why: the
    candidates balance work per lane by one rule each (bins, Karmarkar-Karp, a load target) and end a few tenths
    of a percent above what moving a doc between two of their groups reaches (the sweep's llama3 cells, where
    nearly every doc is wide and the tail polish has no one-lane passes to move)."""
    from balanced_loader.planning.kernels.polish import polish_groups_kernel

    n = len(ev.lengths)
    if ev.pp != 1 or not 2 <= n <= GROUP_POLISH_ITEMS:  # pipeline fill and drain depend on the passes' times too
        return plan
    mb, lane0, deg = (np.ascontiguousarray(a, dtype=np.int64) for a in plan)
    keys, group = np.unique(mb * ev.lanes + lane0, return_inverse=True)  # groups in contract-2 order
    gdeg = np.ones(len(keys), np.int64)
    gdeg[group] = deg
    levels = np.log2(gdeg).astype(np.int64)
    seg = ev.seg_table(int(levels.max()))  # [n, levels] ms
    got = polish_groups_kernel(keys % ev.lanes, gdeg, levels, group.reshape(-1).astype(np.int64), ev.lengths, seg,
                               float(ev.sc.microbatch_ms), int(ev.sc.max_tokens_per_lane), ev.lanes,
                               GROUP_POLISH_VISITS)
    return keys[got] // ev.lanes, keys[got] % ev.lanes, gdeg[got]


def _lane_max(mb: np.ndarray, lane0: np.ndarray, deg: np.ndarray, idx: np.ndarray, lanes: int, empty: int
              ) -> np.ndarray:
    """``[lanes]`` the latest microbatch of the items ``idx`` on each lane (``empty`` where none), each item on the
    lanes ``lane0 .. lane0 + deg - 1``; one row per distinct group, so O(groups' lanes), not O(items' lanes)."""
    out = np.full(lanes, empty, np.int64)
    if not len(idx):
        return out
    groups = np.unique(np.stack([lane0[idx], deg[idx], mb[idx]], axis=1), axis=0)  # [g, 3] lane0, degree, mb
    width = groups[:, 1]
    lane = np.repeat(groups[:, 0], width) + (np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width))
    np.maximum.at(out, lane, np.repeat(groups[:, 2], width))
    return out


def wanted(n: int, sc: ShapeCost, lanes: int, top: int, levels: np.ndarray, target: float, own_ms: float) -> bool:
    """Whether :func:`candidates` yields anything for this batch (the gates of the module docstring), checked
    before any of its tables is built: hydra's own placement stands alone where it is in its regime."""
    wide = bool((levels > 0).any())
    pays = bool(copack_levels(sc, top).any())
    return ((own_ms > target * (1 + MISSED) and wide) or (pays and wide)
            or ((n < SPARSE * lanes or pays) and n <= MAX_ITEMS))


def balanced_groups(ev: Evaluator, level: int, desc: np.ndarray) -> Arrays | None:
    """Every item on ``2**level`` lanes, the groups balanced by longest-processing-time on their work (verl's
    plan with LPT for Karmarkar-Karp: as good with many items per group, O(n log groups)); each group's items
    then into its fewest microbatches under ``2**level * cap`` tokens that balance them. ``None`` when an item
    does not fit."""
    d = 1 << level
    cap = d * ev.sc.max_tokens_per_lane
    ln = ev.lengths
    if int(ln.max()) > cap or ev.lanes % d:
        return None
    groups = ev.lanes // d
    seg = ev.work / d + ev.comm[level] * ev.s  # [n]
    part = np.empty(len(ln), np.int64)
    part[desc] = cost_pack(ln[desc], seg[desc], groups, int(ln.sum()) + 1).bins
    members = [desc[part[desc] == g] for g in range(groups)]  # [groups] items longest first
    m = max(-(-int(ln[idx].sum()) // cap) for idx in members)
    mb = np.zeros(len(ln), np.int64)
    for idx in members:
        k = m
        while len(idx):
            got = cost_pack(ln[idx], seg[idx], k, cap).bins
            if (got >= 0).all():
                mb[idx] = got
                break
            k += 1
    return mb, part * d, np.full(len(ln), d, np.int64)


def target_bins(ev: Evaluator, desc: np.ndarray, target: float, top: int, fit: np.ndarray, load=None, next_k=None
                ) -> Arrays:
    """Groups filled to a time target, each of its own degree, then longest-processing-time onto blocks (after
    ``load`` / ``next_k`` when given): the longest item of ``desc`` (a subset of the items, longest first) left
    opens a group at the smallest degree (from its memory fit) whose group ends within ``target``, and the
    longest items left that still fit it (tokens and time) join. Where docs are fewer than the lanes, groups of
    several widths each about ``target`` long balance like FlexSP's MILP, which one-doc-per-group placements and
    single-degree plans do not. Returns the arrays of every item (those outside ``desc`` zero)."""
    from balanced_loader.planning.kernels.place import target_groups_kernel

    sc, ln = ev.sc, ev.lengths
    n = len(ln)
    deg_t = np.left_shift(1, np.arange(top + 1))
    seg = ev.work[desc, None] / deg_t[None, :] + ev.comm[None, :top + 1] * ev.s[desc, None]  # [k, levels]
    job_of, lv, job_ms = target_groups_kernel(ln[desc], seg, np.ascontiguousarray(fit[desc], dtype=np.int64),
                                              float(sc.microbatch_ms), int(sc.max_tokens_per_lane), float(target))
    table = np.full((len(lv), top + 1), np.inf)
    table[np.arange(len(lv)), lv] = job_ms
    jm, jl, _, _ = _place_jobs(table, lv, ev.lanes, load, next_k)
    mb, lane0, deg = np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n, np.int64)
    mb[desc], lane0[desc], deg[desc] = jm[job_of], jl[job_of], np.left_shift(1, lv[job_of])
    return mb, lane0, deg


def blaster(ev: Evaluator, top: int) -> Arrays:
    """FlexSP's plan without its MILPs (:func:`balanced_loader.planning.solvers.sp_plan.plan_microbatches` with no
    solve): the batch longest first in contiguous chunks of least largest token sum, each chunk a microbatch of
    groups of its own best single degree, groups on the aligned blocks free first. Where long docs are few per
    lane it mixes degrees across microbatches better than one placement of every doc at its own degree."""
    from balanced_loader.planning.solvers.sp_plan import FlexSPOptions, plan_microbatches

    opts = FlexSPOptions(min_degree=1, num_m=2, node_limit=1, rel_gap=0.0, buckets=1, max_solves=0, exact_vars=0,
                         bisect_steps=0, bisect_tol=0.0, time_limit_s=1.0)
    mbs, placed, _ = plan_microbatches(ev.lengths, ev.sc, ev.lanes, opts, ev.pp, 1 << top)
    n = len(ev.lengths)
    mb, lane0, deg = np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n, np.int64)
    for k, (groups, lanes_of) in enumerate(zip(mbs, placed)):
        for g, lanes in zip(groups, lanes_of):
            idx = list(g.docs)
            mb[idx], lane0[idx], deg[idx] = k, lanes[0], len(lanes)
    return mb, lane0, deg


def candidates(ev: Evaluator, levels: np.ndarray, desc: np.ndarray, top: int, fit_level: int, target: float,
               own_ms: float) -> Iterator[tuple[str, Callable[[], Arrays | None]]]:
    """The portfolio's further candidates (module docstring), lazily: ``(name, build)``. ``levels`` ``[n]`` are
    hydra's degrees (as levels) of the batch, ``fit_level`` the memory-fit level of its longest item, ``top``
    the largest level allowed (the ``cp`` limit), ``target`` hydra's load target and ``own_ms`` the time of its
    placement (ms)."""
    from balanced_loader.planning.policies.batch_ada import batch_ada_arrays
    from balanced_loader.planning.policies.common import static_arrays
    from balanced_loader.planning.policies.greedy import greedy_arrays
    from balanced_loader.planning.policies.token_kk import kk_arrays

    sc, lanes, ln = ev.sc, ev.lanes, ev.lengths
    cap = sc.max_tokens_per_lane
    pays = copack_levels(sc, top)
    sparse = len(ln) < SPARSE * lanes and len(ln) <= MAX_ITEMS
    wide = bool((levels > 0).any())
    # cheapest first (block placements, packings), then the simpler policies' plans, Karmarkar-Karp and FlexSP's
    # blaster last: the caller stops once a plan is within STOP of the floor
    if own_ms > target * (1 + MISSED) and wide:
        # the escalation to larger blocks overshoots where wide docs of many widths are few per lane
        yield "no escalation", lambda: block_first(ev, levels, target, desc, top, escalate=0)
        yield "no escalation, longest first", lambda: block_first(ev, levels, target, desc, top, escalate=0,
                                                                  longest_first=True)
        # the load target is a lane-time bound the granularity of wide docs keeps out of reach; just above it,
        # the last ones take the smallest larger block that still ends in time instead of the widest
        for slack in ESCALATE_SLACK:
            if target * (1 + slack) < own_ms:
                yield f"escalation to {1 + slack:g} T", lambda slack=slack: block_first(
                    ev, levels, target * (1 + slack), desc, top)
    if pays.any() and wide:
        yield "co-pack", lambda: copack_place(ev, levels, desc, top)
        for v in range(max(1, int(levels.max())), top + 1):
            if pays[v]:
                yield f"wide bins d={1 << v}", lambda v=v: wide_bins(ev, levels, v, desc, top)
        for v in range(1, int(levels.max()) + 1):
            if pays[v] and len(ln) <= MAX_ITEMS:  # tens of ms each on 200K docs (16K lanes)
                yield f"mixed bins d={1 << v}", lambda v=v: mixed_bins(ev, levels, v, desc, top)
    if not (sparse or pays.any()) or len(ln) > MAX_ITEMS:
        return
    if sparse:
        for share in (0.25, 0.125):
            yield f"one-lane docs >= {share:g} T on blocks", lambda share=share: block_first(
                ev, levels, target, desc, top, share=share)
        tail_level = max(fit_level, int(levels.max()))
        rounds = len(ln) // lanes * lanes  # the items of whole rounds of one per lane, longest first
        widest = int(levels[desc[0]])  # ... and of whole rounds of the longest docs' blocks
        run = int(np.argmin(levels[desc] == widest)) if (levels[desc] != widest).any() else len(ln)
        blocks_run = run // (lanes >> widest) * (lanes >> widest)
        keeps = {len(ln) - lanes, rounds, rounds - lanes, blocks_run}
        for keep in sorted(k for k in keeps if 0 <= k < len(ln)):
            for v in range(max(1, tail_level), top + 1)[-2:]:
                yield f"tail of {len(ln) - keep} in groups d={1 << v}", lambda keep=keep, v=v: tail_groups(
                    ev, levels, desc, keep, v, top)
            if keep in (rounds, blocks_run):
                for slack in TARGET_SLACK[1:]:
                    yield (f"tail of {len(ln) - keep} in groups to {1 + slack:g} its floor",
                           lambda keep=keep, slack=slack: tail_groups(ev, levels, desc, keep, -(1 + slack), top))
        for v in range(fit_level, min(top, fit_level + KK_LEVELS - 1) + 1):
            yield f"bins d={1 << v}", lambda v=v: level_bins(ev, v, top)
    if sparse:
        for v in range(fit_level, min(top, fit_level + KK_LEVELS) + 1):
            if lanes % (1 << v) or lanes >> v > MAX_KK_GROUPS:
                continue
            if len(ln) > MAX_COSTLY:  # Karmarkar-Karp is O(n groups): the longest-processing-time variant
                yield f"balanced groups d={1 << v}", lambda v=v: balanced_groups(ev, v, desc)
            elif v != fit_level:
                yield f"karmarkar-karp d={1 << v}", lambda v=v: kk_arrays(ln, sc, lanes, 1 << v)
    if sparse and int(levels.max()) >= BLASTER_LEVEL and len(ln) <= MAX_BLASTER:
        # long docs of many widths, few per lane: FlexSP's chunks of one degree each mix the widths best
        yield "flexsp blaster", lambda: blaster(ev, top)
    if len(ln) > MAX_COSTLY:
        return
    if sparse:
        fit = fit_levels(ln, cap)
        for slack in TARGET_SLACK:
            yield f"groups to {1 + slack:g} T", lambda slack=slack: target_bins(ev, desc, target * (1 + slack), top,
                                                                               fit)
    # the simpler policies' own plans and FlexSP's blaster cost milliseconds each (Python loops, one packing per
    # degree, Karmarkar-Karp over many groups): only on small batches, where they are cheap and win most often
    degrees = [1 << v for v in range(top + 1)]
    fixed = 1 << fit_level  # the static trainers' degree (lanes are powers of two here: it divides them)
    if fit_level <= top and lanes % fixed == 0:
        yield "maxlen", lambda: static_arrays(ln, lanes, cap, fixed, "ffd")
        yield "static-sp", lambda: static_arrays(ln, lanes, cap, fixed, "bfd")
    yield "batch-ada", lambda: batch_ada_arrays(ln, sc, lanes, degrees, ev.pp)
    if fit_level <= top and lanes % fixed == 0:
        yield "token-kk", lambda: kk_arrays(ln, sc, lanes, fixed)
    yield "greedy", lambda: greedy_arrays(ln, sc, lanes, degrees)
    if sparse and wide and int(levels.max()) < BLASTER_LEVEL:
        yield "flexsp blaster", lambda: blaster(ev, top)
