"""Wave refinement: a local search over whole-layer waves (an improvement over Spindle's packer).

The state is, per wave, how many layers of each MetaOp it runs. Given those, the device
counts of one wave are chosen exactly: minimising the wave's slowest entry under ``sum n <= N``
is solved by repeatedly moving the slowest MetaOp to its next faster allowed count while the
devices last (:func:`wave_counts`; optimal because every other MetaOp already has the least
count that keeps it under the current maximum). A move takes ``k`` layers (one, or all)
of a wave's slowest MetaOp to another wave or to a new wave; the best move that shortens the
summed wave time is applied, up to ``max_moves`` times. The result is never longer than the
input (re-choosing counts alone cannot lengthen a wave) and is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from balanced_loader.spindle.graph import MetaOp
from balanced_loader.spindle.wave_kernels import wave_length
from balanced_loader.spindle.waves import Run

Layers = dict[int, int]  # MetaOp (graph index) -> layers in the wave


class WaveTables:
    """Allowed counts and per-layer times per MetaOp (strictly faster counts only), as padded rows."""

    def __init__(self, ops: Sequence[MetaOp], members: Sequence[int]) -> None:
        self.row = {i: r for r, i in enumerate(members)}
        rows_c, rows_t = [], []
        for i in members:
            cs, ts = [], []
            for c in ops[i].counts:
                t = ops[i].layer_ms(c)
                if not ts or t < ts[-1]:
                    cs.append(c)
                    ts.append(t)
            rows_c.append(cs)
            rows_t.append(ts)
        width = max(len(c) for c in rows_c)
        self.counts = np.zeros((len(members), width), dtype=np.int64)  # [members][counts], padded with the last
        self.layer_ms = np.full((len(members), width), np.inf)  # [members][counts] per-layer ms, inf: padding
        for r, (cs, ts) in enumerate(zip(rows_c, rows_t)):
            self.counts[r, : len(cs)], self.counts[r, len(cs):] = cs, cs[-1]
            self.layer_ms[r, : len(ts)] = ts


Evaluation = tuple[float, dict[int, int], tuple[int, ...]]  # (length, MetaOp -> count, slowest MetaOps)


def wave_counts(tab: WaveTables, wave: Layers, gpus: int) -> Evaluation:
    """Least possible length of a wave running ``wave`` on ``gpus`` devices, the counts reaching it,
    and the MetaOps at that length (see :func:`balanced_loader.spindle.wave_kernels.wave_length`)."""
    ops = list(wave)
    rows = np.fromiter((tab.row[i] for i in ops), dtype=np.int64, count=len(ops))
    layers = np.fromiter(wave.values(), dtype=np.float64, count=len(ops))
    layer_ms = tab.layer_ms[rows]
    length, idx = wave_length(layers, layer_ms, tab.counts[rows], gpus)
    if math.isinf(length):
        return length, {}, ()
    times = layers * layer_ms[np.arange(len(ops)), idx]
    slow = tuple(ops[j] for j in np.flatnonzero(times >= length * (1 - 1e-12)))
    counts = tab.counts[rows, idx]
    return length, {i: int(c) for i, c in zip(ops, counts)}, slow


def refine(ops: Sequence[MetaOp], waves: Sequence[Sequence[Run]], gpus: int, *,
           max_moves: int = 200) -> list[list[Run]]:
    """Shorter waves for one frontier (see the module docstring); ``waves`` use allowed counts."""
    members = sorted({r.op for w in waves for r in w})
    tab = WaveTables(ops, members)
    memo: dict[tuple[tuple[int, int], ...], Evaluation] = {}

    def evaluate(wave: Layers) -> Evaluation:
        if not wave:
            return 0.0, {}, ()
        key = tuple(sorted(wave.items()))
        got = memo.get(key)
        if got is None:
            got = memo[key] = wave_counts(tab, wave, gpus)
        return got

    state: dict[int, Layers] = {}  # wave id -> layers; ids only grow, so order is stable
    for w in waves:
        layers = {r.op: r.layers for r in w if r.layers > 0}
        if layers:
            state[len(state)] = layers
    evals = {w: evaluate(layers) for w, layers in state.items()}
    next_id = len(state)
    new = -1  # target id of a wave not yet opened
    Move = tuple[float, int, int, int, int, tuple, tuple]  # (gain, a, b, op, k, eval a, eval b)
    pair: dict[tuple[int, int], Move | None] = {}

    def source_options(a: int) -> list[tuple[int, int, Layers, tuple]]:
        """(op, k, wave a without k layers of op, its evaluation) for a's slowest MetaOps."""
        wa = state[a]
        out = []
        for i in evals[a][2]:
            have = wa[i]
            for k in sorted({1, have}):
                rest = dict(wa)
                if k == have:
                    del rest[i]
                else:
                    rest[i] = have - k
                out.append((i, k, rest, evaluate(rest)))
        return out

    # Lower bounds on a wave's length: a MetaOp's layers at its fastest count, all work on all devices.
    fastest = {i: float(tab.layer_ms[tab.row[i]].min()) for i in members}
    least_work = {i: min(c * ops[i].layer_ms(c) for c in ops[i].counts) / gpus for i in members}

    def best_move(a: int, b: int, options: list[tuple[int, int, Layers, tuple]]) -> Move | None:
        length_a = evals[a][0]
        old_b = evals[b][0] if b != new else 0.0
        work_b = sum(m * least_work[j] for j, m in state[b].items()) if b != new else 0.0
        best = None
        for i, k, _rest, ev_a in options:
            room = length_a - ev_a[0]  # the most this move can gain
            if best is not None and room <= best[0]:
                continue
            have_b = state[b].get(i, 0) if b != new else 0
            if max(old_b, (have_b + k) * fastest[i], work_b + k * least_work[i]) - old_b >= room:
                continue
            wb = dict(state[b]) if b != new else {}
            wb[i] = have_b + k
            ev_b = evaluate(wb)
            gain = length_a + old_b - ev_a[0] - ev_b[0]
            if gain > 1e-9 * (length_a + old_b) and (best is None or gain > best[0]):
                best = (gain, a, b, i, k, ev_a, ev_b)
        return best

    def refresh(sources: Sequence[int], targets: Sequence[int]) -> None:
        for a in sources:
            opts = source_options(a)
            for b in [*state, new]:
                if b != a:
                    pair[(a, b)] = best_move(a, b, opts)
        for a in state:
            if a in sources:
                continue
            opts = None
            for b in targets:
                if b != a:
                    opts = source_options(a) if opts is None else opts
                    pair[(a, b)] = best_move(a, b, opts)

    refresh(list(state), [])
    for _ in range(max_moves):
        moves = [m for m in pair.values() if m is not None]
        if not moves:
            break
        _, a, b, i, k, ev_a, ev_b = max(moves, key=lambda m: (m[0], -m[1], -m[2]))
        if b == new:
            b, next_id = next_id, next_id + 1
            state[b] = {}
        state[a][i] -= k
        if not state[a][i]:
            del state[a][i]
        state[b][i] = state[b].get(i, 0) + k
        evals[a], evals[b] = ev_a, ev_b
        changed = [a, b]
        if not state[a]:
            del state[a], evals[a]
            changed = [b]
        pair = {key: m for key, m in pair.items() if key[0] in state and key[1] not in (a, b)
                and key[0] not in (a, b) and (key[1] in state or key[1] == new)}
        refresh(changed, changed)
    return [[Run(op=i, n=evals[w][1][i], layers=m) for i, m in layers.items()] for w, layers in state.items()]
