"""A local search over wave boundaries: MetaOps start in an earlier frontier's idle devices.

Spindle plans frontier by frontier, and a frontier is a barrier: a MetaOp whose predecessors all
finished in the frontier's first waves still waits for its last one. The plan's semantics need less
(:meth:`balanced_loader.spindle.schedule.WavePlan.validate`): a MetaOp may run in any wave once every
predecessor finished in earlier waves. :func:`start_early` walks the waves in order and gives a wave's
idle devices to MetaOps of later frontiers that are ready by then: each gets the allowed count, among
the idle devices, that runs the most of its layers within the wave's length (its first layers, taken off
its first later runs). A wave never gets longer and later waves only lose layers, so the plan's total
never grows; a wave left empty is dropped. Greedy, in order of the MetaOps' remaining device-time
(largest first), one pass.

A MetaOp that finishes inside a wave readies its successors only in the next wave. :func:`split_waves`
therefore also tries, for each run that ends a MetaOp before its wave does, cutting the wave where that
run ends (the other runs keep the whole layers that fit before the cut; the rest form a second wave), then
:func:`start_early` on the result; a cut is kept when the plan's total drops (at most ``MAX_CUTS`` tried).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from balanced_loader.spindle.graph import MetaOp
from balanced_loader.spindle.waves import Run, wave_ms

_EPS = 1e-9
MAX_CUTS = 64  # wave cuts tried per plan (each costs one pass of start_early)


def start_early(ops: Sequence[MetaOp], waves: Sequence[tuple[int, list[Run]]], gpus: int
                ) -> list[tuple[int, list[Run]]]:
    """``waves`` (``(frontier, runs)`` in execution order) with later MetaOps moved into idle devices."""
    out = [(f, list(w)) for f, w in waves]
    index = {op.name: i for i, op in enumerate(ops)}
    preds = [[index[a] for a in op.after] for op in ops]
    for k in range(len(out)):
        finished = _finished_before(ops, out, k)
        f, wave = out[k]
        tau = wave_ms(ops, wave)
        free = gpus - sum(r.n for r in wave)
        if free <= 0 or tau <= 0:
            continue
        present = {r.op for r in wave}
        started = {r.op for _, w in out[:k] for r in w}
        ready = [j for j in range(len(ops)) if j not in present and j not in started and j not in finished
                 and all(p in finished for p in preds[j]) and _later_layers(out, k, j) > 0]
        ready.sort(key=lambda j: (-sum(r.layers * ops[j].layer_ms(r.n) * r.n for _, w in out[k + 1:]
                                       for r in w if r.op == j), j))
        for j in ready:
            if free <= 0:
                break
            best = None
            for n in ops[j].counts:
                if n > free:
                    break
                layers = min(_later_layers(out, k, j), int(math.floor(tau / ops[j].layer_ms(n) + _EPS)))
                if layers >= 1 and (best is None or layers > best[1]):
                    best = (n, layers)
            if best is None:
                continue
            n, layers = best
            wave.append(Run(op=j, n=n, layers=layers))
            free -= n
            _take_first(out, k, j, layers)
    return [(f, w) for f, w in out if w]


def _finished_before(ops: Sequence[MetaOp], waves: Sequence[tuple[int, list[Run]]], k: int) -> set[int]:
    """MetaOps whose layers all ran in waves before ``k``."""
    done: dict[int, int] = {}
    for _, w in waves[:k]:
        for r in w:
            done[r.op] = done.get(r.op, 0) + r.layers
    return {j for j, n in done.items() if n == ops[j].layers}


def _later_layers(waves: Sequence[tuple[int, list[Run]]], k: int, j: int) -> int:
    return sum(r.layers for _, w in waves[k + 1:] for r in w if r.op == j)


def _take_first(waves: list[tuple[int, list[Run]]], k: int, j: int, layers: int) -> None:
    """Remove ``layers`` of MetaOp ``j`` from its earliest runs after wave ``k``."""
    for m in range(k + 1, len(waves)):
        if layers <= 0:
            return
        f, w = waves[m]
        for i, r in enumerate(w):
            if r.op != j:
                continue
            cut = min(layers, r.layers)
            layers -= cut
            if cut == r.layers:
                w.pop(i)
            else:
                w[i] = Run(op=j, n=r.n, layers=r.layers - cut)
            break


def _total(ops: Sequence[MetaOp], waves: Sequence[tuple[int, list[Run]]]) -> float:
    return sum(wave_ms(ops, w) for _, w in waves)


def split_waves(ops: Sequence[MetaOp], waves: Sequence[tuple[int, list[Run]]], gpus: int
                ) -> list[tuple[int, list[Run]]]:
    """:func:`start_early`, and wave cuts where a MetaOp ends early (module docstring): the best plan found."""
    best = start_early(ops, waves, gpus)
    best_ms = _total(ops, best)
    tried = 0
    k = 0
    while k < len(best) and tried < MAX_CUTS:
        f, wave = best[k]
        tau = wave_ms(ops, wave)
        ends = []
        for r in wave:
            ran = sum(x.layers for _, w in best[:k] for x in w if x.op == r.op)
            t = r.layers * ops[r.op].layer_ms(r.n)
            if ran + r.layers == ops[r.op].layers and t < tau * (1 - 1e-6):
                ends.append((t, r))
        improved = False
        for cut, r in sorted(ends, key=lambda x: x[0]):
            if tried >= MAX_CUTS:
                break
            tried += 1
            first, second = [], []
            for q in wave:
                lq = ops[q.op].layer_ms(q.n)
                keep = q.layers if q is r else min(q.layers, int(math.floor(cut / lq + _EPS)))
                if keep:
                    first.append(Run(op=q.op, n=q.n, layers=keep))
                if q.layers - keep:
                    second.append(Run(op=q.op, n=q.n, layers=q.layers - keep))
            if not second:
                continue
            trial = start_early(ops, [*best[:k], (f, first), (f, second), *best[k + 1:]], gpus)
            trial_ms = _total(ops, trial)
            if trial_ms < best_ms * (1 - 1e-9):
                best, best_ms, improved = trial, trial_ms, True
                break
        k += 0 if improved else 1
    return best


def graph_bound(ops: Sequence[MetaOp], gpus: int) -> float:
    """A lower bound of every plan, frontier-synchronous or not: the larger of the device-time (every MetaOp at
    its cheapest allowed count, over ``gpus`` devices) and the longest chain of MetaOps each at its fastest."""
    area = sum(min(n * op.ms(n) for n in op.counts if n <= gpus) for op in ops) / gpus
    index = {op.name: i for i, op in enumerate(ops)}
    finish: list[float] = [0.0] * len(ops)
    order = sorted(range(len(ops)), key=lambda i: _depth(ops, index, i))
    for i in order:
        start = max((finish[index[a]] for a in ops[i].after), default=0.0)
        finish[i] = start + min(ops[i].ms(n) for n in ops[i].counts if n <= gpus)
    return max(area, max(finish, default=0.0))


def _depth(ops: Sequence[MetaOp], index: dict[str, int], i: int, memo: dict[int, int] | None = None) -> int:
    memo = {} if memo is None else memo
    if i not in memo:
        memo[i] = 1 + max((_depth(ops, index, index[a], memo) for a in ops[i].after), default=0)
    return memo[i]
