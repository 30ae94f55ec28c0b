"""Slices as runs of flat coordinates and the bucketed exchanges between them and the shards.

A working parameter is one (pool, stage, tp index) slice of a full parameter; in flat
coordinates (:class:`~parallel_runtime.training.layout.FlatLayout`) it is a list of *runs*
(the whole parameter when replicated inside its TP group, else the strided blocks of its
``narrow`` along the TP dim), in the slice's own element order. An :class:`ExchangePlan` cuts
the shard-relative space into windows; a :class:`Bucket` is the same window ``[a, b)`` of
every shard at once (so all owners send in every collective), resolved once into this rank's
parts and, as an owner, every rank's parts inside its shard. :func:`take` and :func:`put` copy
runs out of and into flat buffers with strided views (no index tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from parallel_runtime.training.layout import FlatLayout


def _param_runs(layout: FlatLayout, p: int, tp_index: int, tp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat starts and lengths (``[k] int64`` each) of parameter ``p``'s TP slice, in the slice's element order."""
    spec = layout.specs[p]
    off = layout.offsets[p]
    if spec.tp_dim is None or tp_size == 1:
        return np.array([off], dtype=np.int64), np.array([spec.numel], dtype=np.int64)
    # narrow(d, i * n / t, n / t) of a row-major tensor: one run per index of the leading dims
    d = spec.tp_dim
    n, inner, outer = spec.shape[d], math.prod(spec.shape[d + 1:]), math.prod(spec.shape[:d])
    run = n // tp_size * inner
    starts = off + np.arange(outer, dtype=np.int64) * (n * inner) + tp_index * run
    return starts, np.full(outer, run, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Runs:
    """Runs ``[start, end)`` of flat coordinates sorted by start (stable), with the running max
    of their ends (a sorted key even where runs overlap) and, for a rank's own runs, the index
    of the local parameter and the run's offset in its flat view."""

    start: np.ndarray  # [k] int64
    end: np.ndarray  # [k] int64
    reach: np.ndarray  # [k] int64
    param: np.ndarray | None = None  # [k] int64
    local: np.ndarray | None = None  # [k] int64

    def clip(self, lows: np.ndarray, highs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The runs' parts inside each window ``[lows[w], highs[w])`` (windows ascending, disjoint), in run
        order: starts, ends, run indices and window indices (``[m] int64`` each)."""
        i0 = np.searchsorted(self.reach, lows, "right")  # first run that may reach into the window
        i1 = np.maximum(np.searchsorted(self.start, highs, "left"), i0)
        cnt = i1 - i0
        w = np.repeat(np.arange(len(lows), dtype=np.int64), cnt)
        idx = np.arange(int(cnt.sum()), dtype=np.int64) + np.repeat(i0 - (np.cumsum(cnt) - cnt), cnt)
        s, e = np.maximum(self.start[idx], lows[w]), np.minimum(self.end[idx], highs[w])
        keep = e > s
        return s[keep], e[keep], idx[keep], w[keep]


def _runs(layout: FlatLayout, rows: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """The runs of the slices ``rows`` (``[n, 3]``: parameter, tp index, tp size) of parameters that
    overlap ``[lo, hi)``, sorted by start (stable): starts, ends, row indices, offsets in the slices."""
    offs = np.asarray(layout.offsets, dtype=np.int64)
    inside = np.flatnonzero((offs[rows[:, 0] + 1] > lo) & (offs[rows[:, 0]] < hi))
    z = [np.zeros(0, dtype=np.int64)]
    starts, lens, params, locs = list(z), list(z), list(z), list(z)
    for j in inside.tolist():
        s, n = _param_runs(layout, *rows[j].tolist())
        starts.append(s)
        lens.append(n)
        params.append(np.full(len(s), j, dtype=np.int64))
        locs.append(np.cumsum(n) - n)
    start, n = np.concatenate(starts), np.concatenate(lens)
    order = np.argsort(start, kind="stable")
    return start[order], start[order] + n[order], np.concatenate(params)[order], np.concatenate(locs)[order]


def own_runs(layout: FlatLayout, rows: np.ndarray) -> Runs:
    """This rank's runs, in flat coordinates, with local parameter and offset."""
    start, end, param, local = _runs(layout, rows, 0, layout.padded)
    return Runs(start, end, np.maximum.accumulate(end) if len(end) else end, param, local)


def their_runs(layout: FlatLayout, every: list[np.ndarray], rank: int) -> Runs:
    """Every rank q's runs inside shard ``rank``, at ``q * shard_size + (flat - lo)``: ascending in (q, start),
    so one sorted search finds each rank's parts of a window. Clipped after sorting (clipping is
    monotone), so an owner lists the parts of a window in the same order as their holder."""
    size = layout.shard_size
    lo = rank * size
    starts, ends = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for q, rows in enumerate(every):
        start, end, _, _ = _runs(layout, rows, lo, lo + size)
        s, e = np.maximum(start, lo), np.minimum(end, lo + size)
        keep = e > s
        starts.append(s[keep] - lo + q * size)
        ends.append(e[keep] - lo + q * size)
    start, end = np.concatenate(starts), np.concatenate(ends)
    return Runs(start, end, np.maximum.accumulate(end) if len(end) else end)


def _cell_loads(s: np.ndarray, e: np.ndarray, cell: int, size: int) -> np.ndarray:
    """Elements of the runs ``[s, e)`` (any order, may overlap) in each cell ``[k cell, (k+1) cell)``
    of ``[0, size)``."""
    x = np.minimum(np.arange(-(-size // cell) + 1, dtype=np.int64) * cell, size)  # [cells + 1] boundaries
    ss, ee = np.sort(s), np.sort(e)
    cs = np.concatenate([[0], np.cumsum(ss)])
    ce = np.concatenate([[0], np.cumsum(ee)])
    ns, ne = np.searchsorted(ss, x, "left"), np.searchsorted(ee, x, "left")
    covered = ns * x - cs[ns] - (ne * x - ce[ne])  # sum of clamp(x - s, 0, e - s): elements below x
    return np.diff(covered)


def _windows(load: np.ndarray, cell: int, size: int, limit: int) -> tuple[tuple[int, int], ...]:
    """Greedy shard-relative windows of whole cells, each of total ``load`` at most ``limit`` (at least one
    cell), skipping cells nobody needs."""
    cum = np.concatenate([[0], np.cumsum(load)])
    busy = np.flatnonzero(load)
    out, k = [], 0
    while True:
        at = int(np.searchsorted(busy, k))
        if at == len(busy):
            return tuple(out)
        i = int(busy[at])
        j = max(int(np.searchsorted(cum, cum[i] + limit, "right")) - 1, i + 1)
        out.append((i * cell, min(j * cell, size)))
        k = j


def _merge(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Adjacent runs joined (order kept)."""
    if len(s) <= 1:
        return s, e
    cut = np.flatnonzero(s[1:] != e[:-1]) + 1
    return s[np.r_[0, cut]], e[np.r_[cut - 1, len(s) - 1]]


def _strided(s: np.ndarray, e: np.ndarray) -> list[tuple[int, int, int, int]]:
    """The runs as strided blocks ``(start, count, stride, length)``: consecutive runs of one length at one
    spacing (a TP slice's rows) form one block, so copies need no index tensor. Blocks never overlap
    themselves (spacing >= length)."""
    n = e - s
    if len(s) == 1:
        return [(int(s[0]), 1, 0, int(n[0]))]
    d = np.diff(s)  # [k - 1]
    # cut between runs i and i+1 where the length changes, they would overlap, or the spacing changes
    cut = (n[1:] != n[:-1]) | (d < n[:-1])
    cut[1:] |= d[1:] != d[:-1]
    first = np.r_[0, np.flatnonzero(cut) + 1]
    count = np.diff(np.r_[first, len(s)])
    stride = np.where(count > 1, d[np.minimum(first, len(d) - 1)], 0)
    return list(zip(s[first].tolist(), count.tolist(), stride.tolist(), n[first].tolist()))


def _view(flat: torch.Tensor, start: int, count: int, stride: int, length: int) -> torch.Tensor:
    """``[count, length]`` view of ``flat`` (1-D, contiguous) at a strided block."""
    return flat.as_strided((count, length), (stride, 1), flat.storage_offset() + start)


def take(flat: torch.Tensor, s: np.ndarray, e: np.ndarray, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``flat``'s elements in the runs, concatenated in run order: a view when they are one run, else
    copied into ``out`` (``[total]``, same dtype; default a new tensor)."""
    s, e = _merge(s, e)
    if len(s) == 0:
        return flat[:0]
    if len(s) == 1:
        return flat[int(s[0]):int(e[0])]
    if out is None:
        out = torch.empty(int((e - s).sum()), dtype=flat.dtype, device=flat.device)
    o = 0
    for block in _strided(s, e):
        m = block[1] * block[3]
        out[o:o + m].view(block[1], block[3]).copy_(_view(flat, *block))
        o += m
    return out


def put(flat: torch.Tensor, s: np.ndarray, e: np.ndarray, values: torch.Tensor, *, add: bool) -> None:
    """Write (or add) ``values`` into ``flat``'s runs, in run order."""
    s, e = _merge(s, e)
    if len(s) == 0:
        return
    o = 0
    for block in _strided(s, e):
        m = block[1] * block[3]
        src = values[o:o + m].view(block[1], block[3])
        dst = _view(flat, *block)
        dst.add_(src) if add else dst.copy_(src)  # copy_/add_ convert the dtype (bf16 slices, fp32 buffers)
        o += m


@dataclass(frozen=True, slots=True)
class Bucket:
    """One window ``[a, b)`` of every shard, resolved once per plan (pulls and pushes reuse it)."""

    mine_n: list[int]  # [world] elements of this rank's slices in each owner's window
    peer_n: list[int]  # [world] elements of each rank's slices in this rank's window
    ps: np.ndarray  # [m] int64 shard-relative starts of those parts, in rank order
    pe: np.ndarray  # [m] int64 ... and ends
    parts: tuple[tuple[int, np.ndarray, np.ndarray, np.ndarray], ...]  # per local parameter j: (j, offset in
    # this rank's buffer, offset in the parameter's flat view, length) of its parts ([k] int64 each)
    a: int = 0  # the window [a, b), shard-relative
    b: int = 0


def _bucket(mine: Runs, theirs: Runs, a: int, b: int, world: int, size: int) -> Bucket:
    shards = np.arange(world, dtype=np.int64) * size
    # this rank's runs inside window [a, b) of every owner's shard, in owner (= flat) order
    ms, me, mi, mw = mine.clip(shards + a, shards + b)
    n = me - ms
    moff = np.cumsum(n) - n  # where each part sits in this rank's buffer
    mj = mine.param[mi]  # ... in which local parameter
    mloc = mine.local[mi] + ms - mine.start[mi]  # ... and where in it
    # every rank's runs inside this rank's window, in rank order, shard-relative
    ps, pe, _, pw = theirs.clip(shards + a, shards + b)
    parts = []
    for j in np.unique(mj).tolist():
        sel = mj == j
        parts.append((j, moff[sel], mloc[sel], n[sel]))
    return Bucket(mine_n=np.bincount(mw, weights=n, minlength=world).astype(np.int64).tolist(),
                   peer_n=np.bincount(pw, weights=pe - ps, minlength=world).astype(np.int64).tolist(),
                   ps=ps - pw * size, pe=pe - pw * size, parts=tuple(parts), a=a, b=b)


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """One exchange: its buckets (derived from this rank's runs and every rank's runs inside its shard)."""

    buckets: tuple[Bucket, ...]


def uncovered(buckets: tuple[Bucket, ...], size: int) -> list[tuple[int, int]]:
    """The shard-relative ranges ``[a, b)`` of ``[0, size)`` that no bucket's window covers (nobody sends there)."""
    out, at = [], 0
    for bk in sorted(buckets, key=lambda b: b.a):
        if bk.a > at:
            out.append((at, bk.a))
        at = max(at, bk.b)
    if at < size:
        out.append((at, size))
    return out


def tp_group_needs(layout: FlatLayout, rows: np.ndarray, buckets: tuple[Bucket, ...]) -> list[int]:
    """For each row (parameter, tp index, tp size): the last bucket that holds part of that parameter's slice
    of *any* tp index of the group, -1 if none. Why: a module's forward runs TP collectives, so every rank
    of a TP group must have waited for the same buckets before it; waiting only for its own slice's (the
    vocab rows of tp index 3 sit in a later bucket than those of tp index 0) lets one member enter the
    module's all-reduce while another waits for a bucket the first posts only after it: a deadlock."""
    size = layout.shard_size
    starts = np.array([b.a for b in buckets], dtype=np.int64)  # [buckets] ascending windows
    out = []
    for p, _, tsize in rows.tolist():
        last = -1
        for t in range(tsize):
            s, n = _param_runs(layout, p, t, tsize)
            e = s + n
            # relative end of each run in its last shard, or the shard's end when it crosses a boundary
            y = np.where(s // size == (e - 1) // size, e - (e - 1) // size * size, size)
            last = max(last, int(np.searchsorted(starts, int(y.max()), "left")) - 1)
        out.append(last)
    return out


def plan_exchange(layout: FlatLayout, rows: np.ndarray, every: list[np.ndarray], rank: int, bucket_elems: int,
                  reduce_max: Callable[[np.ndarray], np.ndarray]) -> ExchangePlan:
    """The buckets of one exchange: this rank's slices ``rows`` (``[n, 3]``: parameter, tp index, tp size),
    every rank's (``every[q]``), windows of at most ``bucket_elems`` elements of every rank's send and
    receive buffer. ``reduce_max`` makes the per-cell loads common (a MAX all-reduce; the identity in
    a world of one), so every rank cuts the same windows."""
    own, theirs = own_runs(layout, rows), their_runs(layout, every, rank)
    load = reduce_max(cell_load(layout, own, theirs, bucket_elems))
    cell = _cell(layout, bucket_elems)
    return ExchangePlan(buckets=tuple(_bucket(own, theirs, a, b, layout.world_size, layout.shard_size)
                                      for a, b in _windows(load, cell, layout.shard_size, bucket_elems)))


def _cell(layout: FlatLayout, bucket_elems: int) -> int:
    return max(1, bucket_elems // (4 * layout.world_size))


def cell_load(layout: FlatLayout, own: Runs, theirs: Runs, bucket_elems: int) -> np.ndarray:
    """``[cells]`` int64: per cell of the shard-relative space, the most this rank receives (from all owners)
    or sends (to all) there; the MAX of every rank's is what windows are cut by."""
    world, size = layout.world_size, layout.shard_size
    cell = _cell(layout, bucket_elems)
    shards = np.arange(world, dtype=np.int64) * size
    rs, re, _, rw = own.clip(shards, shards + size)
    ts, te, _, tw = theirs.clip(shards, shards + size)
    return np.maximum(_cell_loads(rs - rw * size, re - rw * size, cell, size),
                      _cell_loads(ts - tw * size, te - tw * size, cell, size))


def world_load(layout: FlatLayout, every: list[np.ndarray], bucket_elems: int) -> np.ndarray:
    """What the MAX all-reduce of :func:`plan_exchange` gives, computed from every rank's slices in one
    process (``diagnostics.estimate``, where the collective moves nothing)."""
    return np.max([cell_load(layout, own_runs(layout, rows), their_runs(layout, every, q), bucket_elems)
                   for q, rows in enumerate(every)], axis=0)
