"""Device placement (papers/spindle.md §6): ranks for every run of every wave.

* Contiguous and node aligned: a run of up to one node lies inside one node, a larger run
  covers whole nodes (allowed counts are node aligned, so this always exists unless earlier
  pins fragment a wave; then we re-pack without pins, and as a last resort place contiguously).
* Runs that keep their MetaOp's previous device count are first pinned to its previous ranks
  (no data moves); the rest are packed best-fit decreasing into the free parts of nodes.
* Local search: swap two equal-size blocks of consecutive cells (runs or idle ranks, up to
  three cells per block) that each lie inside one node or whose starts agree modulo the node
  size (so alignment is kept), while that lowers the movement cost; best swap first.

Movement cost of a run: the docs of its batch whose activations are not already on the rank
that needs them. Inside an entry the batch is split contiguously over its ranks
(:func:`balanced_loader.spindle.wave_plan.batch_shards`); a MetaOp's activations live where it
last ran. A MetaOp's first run reads its predecessors' outputs: with ``handover=True`` the
search also counts those (Spindle's released code does not remap at frontier boundaries,
which is the default here and reproduces fixture F1's ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balanced_loader.spindle.graph import MetaOp
from balanced_loader.spindle.wave_plan import batch_shards
from balanced_loader.spindle.waves import Run

Ranks = tuple[int, ...]


def moved_docs(src: Ranks, src_batch: int, start: int, n: int, batch: int) -> float:
    """Docs (of ``batch``) not already on their rank when data on ``src`` moves to ``[start, start + n)``.

    Shards are compared as fractions of each side's own batch, so a hand-over between MetaOps
    of different batch sizes is measured in the destination's docs.
    """
    lo, hi = max(start, min(src)), min(start + n, max(src) + 1)
    if lo >= hi:
        return float(batch)
    if src[-1] - src[0] + 1 == len(src):  # contiguous (placement's runs): vectorised
        r = np.arange(lo, hi)  # [overlap] ranks in both ranges
        a0, a1 = _shard_bounds(r - src[0], src_batch, len(src))
        b0, b1 = _shard_bounds(r - start, batch, n)
        kept = float(np.maximum(0.0, np.minimum(a1, b1) - np.maximum(a0, b0)).sum())
        return batch * (1.0 - kept)
    pos = {r: k for k, r in enumerate(src)}
    s_sh = batch_shards(src_batch, len(src))
    d_sh = batch_shards(batch, n)
    kept = 0.0
    for r in range(lo, hi):
        k = pos.get(r)
        if k is None:
            continue
        a0, a1 = s_sh[k][0] / src_batch, s_sh[k][1] / src_batch
        b0, b1 = d_sh[r - start][0] / batch, d_sh[r - start][1] / batch
        kept += max(0.0, min(a1, b1) - max(a0, b0))
    return batch * (1.0 - kept)


def _shard_bounds(k: np.ndarray, batch: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Fractional ``[start, stop)`` of shard ``k`` of :func:`batch_shards` (``batch`` over ``n``)."""
    q, rem = divmod(batch, n)
    s = k * q + np.minimum(k, rem)
    e = s + q + (k < rem)
    return s / batch, e / batch


class _Mover:
    """Cached movement cost of a run at a start rank."""

    def __init__(self, ops: Sequence[MetaOp], sources: list[list[tuple[Ranks, int]]], runs: Sequence[Run]) -> None:
        self.ops, self.sources, self.runs = ops, sources, runs
        self.cache: dict[tuple[int, int], float] = {}

    def __call__(self, k: int, start: int) -> float:
        key = (k, start)
        c = self.cache.get(key)
        if c is None:
            r = self.runs[k]
            batch = self.ops[r.op].batch
            c = sum(moved_docs(src, b, start, r.n, batch) for src, b in self.sources[k])
            self.cache[key] = c
        return c


def pack_aligned(sizes: Sequence[int], gpus: int, node: int,
                 blocked: Sequence[tuple[int, int]] = ()) -> list[int] | None:
    """Node-aligned starts for ``sizes`` in the ranks not ``blocked`` (``[start, stop)``), or None.

    Whole-node runs take the lowest free whole nodes; smaller runs go best-fit decreasing
    into the free intervals of nodes (ties: lowest rank).
    """
    taken = bytearray(gpus)
    for a, b in blocked:
        taken[a:b] = b"\x01" * (b - a)
    order = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    starts: list[int] = [-1] * len(sizes)
    for k in order:
        s = sizes[k]
        if s >= node:
            need = -(-s // node)
            run, found = 0, -1
            for v in range(gpus // node):
                run = run + 1 if not any(taken[v * node:(v + 1) * node]) else 0
                if run == need:
                    found = (v - need + 1) * node
                    break
            if found < 0:
                return None
            starts[k] = found
            taken[found:found + s] = b"\x01" * s
            continue
        best: tuple[int, int] | None = None  # (free length of the interval, start)
        for v in range(gpus // node):
            a = v * node
            while a < (v + 1) * node:
                if taken[a]:
                    a += 1
                    continue
                b = a
                while b < (v + 1) * node and not taken[b]:
                    b += 1
                if b - a >= s and (best is None or b - a < best[0]):
                    best = (b - a, a)
                a = b
        if best is None:
            return None
        starts[k] = best[1]
        taken[best[1]:best[1] + s] = b"\x01" * s
    return starts


def _contiguous(sizes: Sequence[int]) -> list[int]:
    order = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    starts, at = [0] * len(sizes), 0
    for k in order:
        starts[k] = at
        at += sizes[k]
    return starts


def _initial(runs: Sequence[Run], gpus: int, node: int, prev: dict[int, Ranks]) -> list[int]:
    """Pin runs that keep their previous ranks, pack the rest aligned; fall back as documented."""
    sizes = [r.n for r in runs]
    pinned: dict[int, int] = {}
    used: set[int] = set()
    for k in sorted(range(len(runs)), key=lambda k: -sizes[k]):
        src = prev.get(runs[k].op)
        if src is None or len(src) != sizes[k] or src[-1] - src[0] + 1 != sizes[k] or used & set(src):
            continue
        pinned[k] = src[0]
        used.update(src)
    rest = [k for k in range(len(runs)) if k not in pinned]
    blocked = [(pinned[k], pinned[k] + sizes[k]) for k in pinned]
    got = pack_aligned([sizes[k] for k in rest], gpus, node, blocked) if pinned else None
    if got is not None:
        starts = [0] * len(runs)
        for k, s in pinned.items():
            starts[k] = s
        for k, s in zip(rest, got):
            starts[k] = s
        return starts
    got = pack_aligned(sizes, gpus, node)
    return got if got is not None else _contiguous(sizes)


def _local_search(runs: Sequence[Run], starts: list[int], gpus: int, node: int, cost: _Mover,
                  *, max_block: int = 3, max_rounds: int = 64) -> list[int]:
    """Swap equal-size blocks of consecutive cells (alignment kept, see the module docstring) while cost drops."""
    starts = list(starts)
    for _ in range(max_rounds):
        # Cells in rank order: (start, size, run index or -1 for idle ranks, split at node boundaries).
        cells: list[tuple[int, int, int]] = sorted((starts[k], runs[k].n, k) for k in range(len(runs)))
        idle, at = [], 0
        for s, n, _k in cells + [(gpus, 0, -1)]:
            a = at
            while a < s:
                b = min(s, (a // node + 1) * node)
                idle.append((a, b - a, -1))
                a = b
            at = max(at, s + n)
        cells = sorted(cells + idle)
        blocks: dict[int, list[tuple[int, int, int]]] = {}  # size -> [(start, first cell, last cell)]
        for i in range(len(cells)):
            size = 0
            for j in range(i, min(i + max_block, len(cells))):
                size += cells[j][1]
                blocks.setdefault(size, []).append((cells[i][0], i, j))
        best = (-1e-9, None)
        for group in blocks.values():
            if len(group) < 2:
                continue
            for x in range(len(group)):
                s1, i1, j1 = group[x]
                for y in range(x + 1, len(group)):
                    s2, i2, j2 = group[y]
                    if not (j1 < i2 or j2 < i1):
                        continue  # overlapping blocks
                    size = sum(cells[c][1] for c in range(i1, j1 + 1))
                    inside = s1 // node == (s1 + size - 1) // node and s2 // node == (s2 + size - 1) // node
                    if not inside and s1 % node != s2 % node:
                        continue  # the swap would move a run across a node boundary
                    if all(cells[c][2] < 0 for c in (*range(i1, j1 + 1), *range(i2, j2 + 1))):
                        continue
                    d = s2 - s1
                    delta = 0.0
                    for c in range(i1, j1 + 1):
                        k = cells[c][2]
                        if k >= 0:
                            delta += cost(k, starts[k] + d) - cost(k, starts[k])
                    for c in range(i2, j2 + 1):
                        k = cells[c][2]
                        if k >= 0:
                            delta += cost(k, starts[k] - d) - cost(k, starts[k])
                    if delta < best[0]:
                        best = (delta, (i1, j1, i2, j2, d))
        if best[1] is None:
            break
        i1, j1, i2, j2, d = best[1]
        for c in range(i1, j1 + 1):
            if cells[c][2] >= 0:
                starts[cells[c][2]] += d
        for c in range(i2, j2 + 1):
            if cells[c][2] >= 0:
                starts[cells[c][2]] -= d
    return starts


def place(ops: Sequence[MetaOp], waves: Sequence[Sequence[Run]], gpus: int, node: int, *,
          handover: bool = False, search: bool = True) -> list[list[Ranks]]:
    """Ranks for every run, wave by wave (see the module docstring)."""
    where: dict[int, Ranks] = {}  # MetaOp -> ranks holding its activations
    name_index = {op.name: i for i, op in enumerate(ops)}
    out: list[list[Ranks]] = []
    for runs in waves:
        sources: list[list[tuple[Ranks, int]]] = []
        for r in runs:
            if r.op in where:
                sources.append([(where[r.op], ops[r.op].batch)])
            elif handover:
                preds = [name_index[a] for a in ops[r.op].after]
                sources.append([(where[p], ops[p].batch) for p in preds if p in where])
            else:
                sources.append([])
        starts = _initial(runs, gpus, node, where)
        if search and any(sources):
            starts = _local_search(runs, starts, gpus, node, _Mover(ops, sources, runs))
        ranks = [tuple(range(s, s + r.n)) for s, r in zip(starts, runs)]
        for r, rk in zip(runs, ranks):
            where[r.op] = rk
        out.append(ranks)
    return out


def movement(ops: Sequence[MetaOp], waves: Sequence[Sequence[tuple[int, Ranks]]]) -> float:
    """Docs that change rank over a placed plan: within MetaOps and at hand-overs from predecessors.

    ``waves``: per wave, ``(MetaOp index, ranks)`` of each entry.
    """
    where: dict[int, Ranks] = {}
    name_index = {op.name: i for i, op in enumerate(ops)}
    total = 0.0
    for entries in waves:
        for op, ranks in entries:
            batch = ops[op].batch
            if op in where:
                srcs = [(where[op], batch)]
            else:
                srcs = [(where[p], ops[p].batch) for p in (name_index[a] for a in ops[op].after) if p in where]
            total += sum(moved_docs(src, b, ranks[0], len(ranks), batch) for src, b in srcs)
        for op, ranks in entries:
            where[op] = ranks
    return total
