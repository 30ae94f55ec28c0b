"""Wave packer (papers/spindle.md §5): a frontier's slices become sequential waves.

Greedy, as in Spindle:

1. sort the queued slices by (devices, total time), largest first;
2. admit a slice when its devices are free and its MetaOp has no slice in this wave yet
   (its layers run in sequence);
3. wave length from the shortest admitted slice: each slice runs ``k = max(1, round(T_min / t))``
   layers, ``tau`` is the longest of those, then every slice runs ``min(l, floor(tau / t))``
   layers; the remainders go back to the queue with the same device count;
4. idle devices are filled (the extension pass): a slice in the wave moves up to a larger
   allowed count, or a queued MetaOp not in the wave joins, when that runs more layers within
   ``tau``; the extra layers come off the MetaOp's queued slices, largest device-time first;
5. a wave whose (MetaOp, devices) pairs are a subset of the previous wave's is merged into it.

A wave here is unplaced: a list of :class:`Run` (MetaOp, devices, layers); placement assigns ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from balanced_loader.spindle.allocator import Slice
from balanced_loader.spindle.graph import MetaOp

_EPS = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """``layers`` layers of MetaOp ``op`` (graph index) on ``n`` devices within one wave."""

    op: int
    n: int
    layers: int


class _Queued:
    __slots__ = ("layer_ms", "layers", "n", "op", "order")

    def __init__(self, op: int, n: int, layers: int, layer_ms: float, order: int) -> None:
        self.op, self.n, self.layers, self.layer_ms, self.order = op, n, layers, layer_ms, order

    @property
    def ms(self) -> float:
        return self.layers * self.layer_ms


def wave_ms(ops: Sequence[MetaOp], wave: Sequence[Run]) -> float:
    """A wave lasts as long as its slowest run."""
    return max((r.layers * ops[r.op].layer_ms(r.n) for r in wave), default=0.0)


def waves_ms(ops: Sequence[MetaOp], waves: Sequence[Sequence[Run]]) -> float:
    return sum(wave_ms(ops, w) for w in waves)


def _fit_layers(tau: float, layer_ms: float) -> int:
    return math.floor(tau / layer_ms * (1 + _EPS))


def pack(ops: Sequence[MetaOp], slices: Sequence[Slice], gpus: int, *, fill: bool = True) -> list[list[Run]]:
    """Greedy waves for one frontier's slices (``ops`` is the graph's MetaOp list)."""
    queue = [_Queued(s.op, s.n, s.layers, ops[s.op].layer_ms(s.n), k) for k, s in enumerate(slices) if s.layers > 0]
    waves: list[list[Run]] = []
    while queue:
        queue.sort(key=lambda q: (-q.n, -q.ms, q.order))
        free = gpus
        chosen: list[_Queued] = []
        in_wave: set[int] = set()
        for q in queue:
            if q.n <= free and q.op not in in_wave:
                chosen.append(q)
                in_wave.add(q.op)
                free -= q.n
        assert chosen, "every slice uses at most gpus devices"
        t_min = min(q.ms for q in chosen)
        tau = max(max(1, math.floor(t_min / q.layer_ms + 0.5)) * q.layer_ms for q in chosen)
        runs: dict[int, list[int]] = {}  # op -> [devices, layers], in admission order
        for q in chosen:
            m = min(q.layers, _fit_layers(tau, q.layer_ms))
            runs[q.op] = [q.n, m]
            q.layers -= m
        if fill and free > 0:
            _fill(ops, queue, runs, free, tau)
        queue = [q for q in queue if q.layers > 0]
        wave = [Run(op=op, n=n, layers=m) for op, (n, m) in runs.items() if m > 0]
        if waves and {(r.op, r.n) for r in wave} <= {(r.op, r.n) for r in waves[-1]}:
            extra = {r.op: r.layers for r in wave}
            waves[-1] = [Run(op=r.op, n=r.n, layers=r.layers + extra.get(r.op, 0)) for r in waves[-1]]
        else:
            waves.append(wave)
    return waves


def _take(ops: Sequence[MetaOp], queue: list[_Queued], op: int, layers: int, *, dry: bool) -> float:
    """Remove ``layers`` queued layers of ``op`` (largest device-time per layer first); their device-ms."""
    entries = sorted((q for q in queue if q.op == op and q.layers > 0), key=lambda q: (-q.n * q.layer_ms, q.order))
    saved = 0.0
    for q in entries:
        if layers <= 0:
            break
        k = min(layers, q.layers)
        saved += k * q.n * q.layer_ms
        layers -= k
        if not dry:
            q.layers -= k
    return saved


def _fill(ops: Sequence[MetaOp], queue: list[_Queued], runs: dict[int, list[int]], free: int, tau: float) -> None:
    """Use idle devices: raise a run to a larger count or add a queued MetaOp, while it runs more layers."""
    while free > 0:
        left: dict[int, int] = {}
        for q in queue:
            left[q.op] = left.get(q.op, 0) + q.layers
        best: tuple[float, int, int, int] | None = None  # (saved device-ms, op, devices, extra layers)
        for op, layers_left in left.items():
            if layers_left <= 0:
                continue
            n0, m0 = runs.get(op, (0, 0))
            for c in ops[op].counts:
                if c <= n0 or c - n0 > free:
                    continue
                extra = min(m0 + layers_left, _fit_layers(tau, ops[op].layer_ms(c))) - m0
                if extra <= 0:
                    continue
                saved = _take(ops, queue, op, extra, dry=True)
                if best is None or saved > best[0]:
                    best = (saved, op, c, extra)
        if best is None:
            return
        _, op, c, extra = best
        _take(ops, queue, op, extra, dry=False)
        n0, m0 = runs.get(op, (0, 0))
        runs[op] = [c, m0 + extra]
        free -= c - n0


def order_waves(waves: Sequence[Sequence[Run]], previous: Sequence[Run] = ()) -> list[list[Run]]:
    """Chain one frontier's waves so consecutive ones share the most devices of equal (MetaOp, count)
    pairs, which placement can keep in place; ``previous`` is the wave before the frontier.

    Order inside a frontier is free: its MetaOps do not depend on each other.
    """
    left = [list(w) for w in waves]
    out: list[list[Run]] = []
    last = {(r.op, r.n) for r in previous}
    while left:
        k = max(range(len(left)), key=lambda k: (sum(r.n for r in left[k] if (r.op, r.n) in last),
                                                 sum(r.n for r in left[k]), -k))
        out.append(left.pop(k))
        last = {(r.op, r.n) for r in out[-1]}
    return out
