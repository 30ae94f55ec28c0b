"""Baselines (papers/spindle.md §8-9): plans Spindle must never lose to.

* ``all`` ("unified", Megatron/DeepSpeed style): every MetaOp on all devices, one after another,
  in frontier order; one wave each. "All" is the MetaOp's largest allowed count, which is every
  device unless the count rule forbids it (e.g. a batch of 48 on 64 devices uses 48).
* ``fixed_split`` ("decoupled", Optimus style): each task gets a fixed block of devices for the
  whole step. Each MetaOp runs all its layers on the largest allowed count inside its task's
  block. Per frontier, a task's ready MetaOps run one after another, so the frontier is a
  sequence of waves, the j-th holding each task's j-th longest ready MetaOp. The split
  minimises the total over candidate splits: the exact min-max split of the per-task times
  (bisection over candidate makespans), then a local search that raises a critical task to its
  next useful count with idle devices or devices taken from another task.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from balanced_loader.spindle.graph import Graph
from balanced_loader.spindle.placement import pack_aligned
from balanced_loader.spindle.waves import Run

PlacedWave = list[tuple[Run, tuple[int, ...]]]


def all_devices(graph: Graph) -> list[tuple[int, PlacedWave]]:
    """``[(frontier, wave)]``: every MetaOp alone on all devices (its largest allowed count), in frontier order."""
    out = []
    for f, frontier in enumerate(graph.frontiers()):
        for i in frontier:
            op = graph.metaops[i]
            n = op.best_count(graph.gpus)
            out.append((f, [(Run(op=i, n=n, layers=op.layers), tuple(range(n)))]))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedSplit:
    devices: tuple[tuple[str, int], ...]  # [tasks] (task, devices)
    total_ms: float
    waves: tuple[tuple[int, PlacedWave], ...]  # [(frontier, wave)]


class _Objective:
    """Total time of the frontier-synchronous fixed-split plan for a device split."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.tasks = list(graph.tasks)
        self.frontiers = graph.frontiers()
        ops = graph.metaops
        self.task_of = [self.tasks.index(op.task) for op in ops]
        # Useful counts per task: the union of its MetaOps' allowed counts above every one's minimum.
        self.steps: list[list[int]] = []
        for t in range(len(self.tasks)):
            mine = [op for op, k in zip(ops, self.task_of) if k == t]
            floor = max(op.counts[0] for op in mine)
            self.steps.append(sorted({c for op in mine for c in op.counts if c >= floor}))
        # table[t][s][f]: the task's ready MetaOps of frontier f on steps[t][s] devices, longest first,
        # as (ms, MetaOp); empty when the task has none there.
        self.table: list[list[list[list[tuple[float, int]]]]] = []
        for t, steps in enumerate(self.steps):
            rows = []
            for n in steps:
                per_f = []
                for fr in self.frontiers:
                    mine = [(ops[i].ms(ops[i].best_count(n)), i) for i in fr if self.task_of[i] == t]
                    per_f.append(sorted(mine, key=lambda x: (-x[0], x[1])))
                rows.append(per_f)
            self.table.append(rows)
        self.cache: dict[tuple[int, ...], float] = {}

    def _rows(self, split: tuple[int, ...]) -> list[list[list[tuple[float, int]]]]:
        return [self.table[t][bisect.bisect_right(self.steps[t], n) - 1] for t, n in enumerate(split)]

    def frontier_waves(self, split: tuple[int, ...], f: int) -> list[list[tuple[float, int]]]:
        """The j-th wave of frontier ``f`` holds each task's j-th longest ready MetaOp, as (ms, MetaOp)."""
        per_task = [r[f] for r in self._rows(split) if r[f]]
        depth = max(len(x) for x in per_task)
        return [[x[j] for x in per_task if j < len(x)] for j in range(depth)]

    def __call__(self, split: tuple[int, ...]) -> float:
        got = self.cache.get(split)
        if got is None:
            rows = self._rows(split)
            got = 0.0
            for f in range(len(self.frontiers)):
                lists = [r[f] for r in rows if r[f]]
                depth = max(len(x) for x in lists)
                for j in range(depth):
                    got += max(x[j][0] for x in lists if j < len(x))
            self.cache[split] = got
        return got

    def task_ms(self, t: int, n: int) -> float:
        s = bisect.bisect_right(self.steps[t], n) - 1
        return sum(ms for per_f in self.table[t][s] for ms, _ in per_f)


def _minmax_split(obj: _Objective, gpus: int) -> tuple[int, ...]:
    """Exact split minimising the slowest task's total time (sum of its MetaOps)."""
    times = [[obj.task_ms(t, n) for n in steps] for t, steps in enumerate(obj.steps)]
    cands = sorted({x for ts in times for x in ts})

    def need(c: float) -> tuple[int, ...]:
        out = []
        for steps, ts in zip(obj.steps, times):
            k = next((k for k, x in enumerate(ts) if x <= c * (1 + 1e-12)), len(ts) - 1)
            out.append(steps[k])
        return tuple(out)

    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(need(cands[mid])) <= gpus:
            hi = mid
        else:
            lo = mid + 1
    return need(cands[lo])


def _improve(obj: _Objective, split: tuple[int, ...], gpus: int, max_rounds: int = 200) -> tuple[int, ...]:
    """Raise a critical task to its next useful count (idle devices, or lowering another task)."""
    cur, best = split, obj(split)
    for _ in range(max_rounds):
        critical = set()
        for f in range(len(obj.frontiers)):
            for wave in obj.frontier_waves(cur, f):
                critical.add(obj.task_of[max(wave)[1]])
        free = gpus - sum(cur)
        found = None
        for b in sorted(critical):
            k = bisect.bisect_right(obj.steps[b], cur[b])
            if k >= len(obj.steps[b]):
                continue
            need = obj.steps[b][k] - cur[b]
            options = []
            if need <= free:
                options.append(tuple(obj.steps[b][k] if t == b else cur[t] for t in range(len(cur))))
            else:
                for a in range(len(cur)):
                    if a == b:
                        continue
                    target = cur[a] - (need - free)
                    j = bisect.bisect_right(obj.steps[a], target) - 1
                    if j < 0:
                        continue
                    options.append(tuple(obj.steps[b][k] if t == b else obj.steps[a][j] if t == a else cur[t]
                                         for t in range(len(cur))))
            for s in options:
                v = obj(s)
                if v < best - 1e-12 and (found is None or v < found[0]):
                    found = (v, s)
        if found is None:
            break
        best, cur = found
    return cur


def fixed_split(graph: Graph) -> FixedSplit | None:
    """The best fixed split found (see the module docstring); None if there are more tasks than devices."""
    gpus, node = graph.gpus, graph.gpus_per_node
    obj = _Objective(graph)
    if sum(s[0] for s in obj.steps) > gpus:
        return None
    starts = [_minmax_split(obj, gpus), tuple(s[0] for s in obj.steps)]
    split = min((_improve(obj, s, gpus) for s in starts), key=obj)
    blocks = pack_aligned(split, gpus, node)
    if blocks is None:  # task blocks that do not tile nodes: contiguous in task order
        blocks = [sum(split[:t]) for t in range(len(split))]
    ops = graph.metaops
    waves: list[tuple[int, PlacedWave]] = []
    for f in range(len(obj.frontiers)):
        for wave in obj.frontier_waves(split, f):
            placed = []
            for _, i in wave:
                t = obj.task_of[i]
                n = ops[i].best_count(split[t])
                placed.append((Run(op=i, n=n, layers=ops[i].layers), tuple(range(blocks[t], blocks[t] + n))))
            waves.append((f, placed))
    total = obj(split)
    assert math.isfinite(total)
    return FixedSplit(devices=tuple(zip(obj.tasks, split)), total_ms=total, waves=tuple(waves))
