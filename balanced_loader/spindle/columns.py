"""Column-generation wave packer: an improvement over the greedy packer (not in Spindle).

A *configuration* gives each MetaOp of the frontier an allowed device count or 0, using at
most ``N`` devices. The master LP picks how long each configuration runs,

    min sum_w tau_w   s.t.   sum_w tau_w / T_i(n_iw) >= 1   for every MetaOp i,   tau >= 0,

(each MetaOp completes, running ``tau_w / t_i(n_iw)`` of its layers in configuration ``w``);
its optimum is at least the frontier's ``C*`` (Jensen on the concave envelope) and equals it
whenever the fractional counts can be mixed exactly. New configurations come from pricing, a
multiple-choice knapsack over devices (dynamic programme, maximise ``sum_i y_i / T_i(n_i)``
for the LP duals ``y``). Whole layers on the LP's support come from deterministic rounding
(floors, then each remaining layer where it lengthens the waves least; the planner then runs
the wave local search of :mod:`.refine` on the result). Each configuration is one wave
(at most one slice per MetaOp, as the greedy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from balanced_loader.spindle.graph import MetaOp
from balanced_loader.spindle.waves import Run

Config = tuple[int, ...]  # [frontier] device count per MetaOp, 0: absent


def _price(y: np.ndarray, counts: Sequence[Sequence[int]], rates: Sequence[np.ndarray],
           gpus: int) -> tuple[float, Config]:
    """Best configuration for duals ``y``: max ``sum_i y_i * rate_i(n_i)`` with ``sum n_i <= gpus``."""
    k = len(counts)
    dp = np.zeros(gpus + 1)  # [gpus + 1] best value using at most d devices
    choice = np.zeros((k, gpus + 1), dtype=np.int64)  # [frontier][gpus + 1] count chosen for op i at capacity d
    cap = np.arange(gpus + 1)  # [gpus + 1]
    for i in range(k):
        if y[i] <= 0:
            continue
        c = np.asarray(counts[i], dtype=np.int64)  # [counts]
        rest = cap[None, :] - c[:, None]  # [counts][gpus + 1] devices left for the MetaOps before i
        cand = np.where(rest >= 0, dp[np.maximum(rest, 0)], -np.inf) + y[i] * rates[i][:, None]
        pick = np.argmax(cand, axis=0)  # [gpus + 1] best count index (first on ties)
        value = cand[pick, cap]
        better = value > dp + 1e-15
        choice[i] = np.where(better, c[pick], 0)
        dp = np.where(better, value, dp)
    config = [0] * k
    d = gpus
    for i in range(k - 1, -1, -1):
        c = int(choice[i, d])
        config[i] = c
        d -= c
    return float(dp[gpus]), tuple(config)


def _master(columns: list[Config], rate_of: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray, float]:
    from scipy.optimize import linprog

    k = len(rate_of)
    a = np.zeros((k, len(columns)))  # [frontier][columns] completed fraction per ms
    for w, col in enumerate(columns):
        for i, c in enumerate(col):
            if c:
                a[i, w] = rate_of[i][c]
    res = linprog(np.ones(len(columns)), A_ub=-a, b_ub=-np.ones(k), bounds=(0, None), method="highs")
    if res.status != 0:  # times the graph's checks let through but HiGHS cannot scale: one line, not an assert
        raise ValueError(f"the wave LP of a frontier could not be solved ({res.message}); the MetaOps' times are too "
                         f"far apart (rescale alpha_ms / beta_ms, or check the model shapes)")
    return res.x, -res.ineqlin.marginals, float(res.fun)


def _round_layers(ops: Sequence[MetaOp], frontier: Sequence[int], columns: list[Config],
                  tau: np.ndarray) -> list[list[int]]:
    """Whole layers from the LP's fractional ones: floors, then each remaining layer where it
    lengthens the waves least (slowest layers first)."""
    k, w_n = len(frontier), len(columns)
    t = [[ops[frontier[i]].layer_ms(columns[w][i]) if columns[w][i] else math.inf for i in range(k)]
         for w in range(w_n)]  # [waves][frontier] per-layer ms, inf: not in the wave
    layers = [[0] * k for _ in range(w_n)]
    for i in range(k):
        frac = [tau[w] / t[w][i] if columns[w][i] else 0.0 for w in range(w_n)]
        scale = ops[frontier[i]].layers / max(sum(frac), 1e-300)
        for w in range(w_n):
            layers[w][i] = math.floor(frac[w] * scale + 1e-9)
    wave = [max((layers[w][i] * t[w][i] for i in range(k) if layers[w][i]), default=0.0) for w in range(w_n)]
    order = sorted(range(k), key=lambda i: -min(t[w][i] for w in range(w_n)))
    for i in order:
        for _ in range(ops[frontier[i]].layers - sum(layers[w][i] for w in range(w_n))):
            best = min((w for w in range(w_n) if columns[w][i]),
                       key=lambda w: (max(wave[w], (layers[w][i] + 1) * t[w][i]) - wave[w], t[w][i]))
            layers[best][i] += 1
            wave[best] = max(wave[best], layers[best][i] * t[best][i])
    return layers


def column_waves(ops: Sequence[MetaOp], frontier: Sequence[int], gpus: int, seeds: Sequence[Sequence[Run]], *,
                 max_rounds: int = 8) -> list[list[Run]]:
    """Waves for one frontier by column generation (see the module docstring).

    ``seeds``: waves of other packers (allowed counts), used as the initial configurations;
    together they must cover every MetaOp of the frontier.
    """
    columns, tau = generate_columns(ops, frontier, gpus, seeds, max_rounds=max_rounds)
    return lp_waves(ops, frontier, columns, tau)


def lp_waves(ops: Sequence[MetaOp], frontier: Sequence[int], columns: list[Config], tau: np.ndarray) -> list[list[Run]]:
    """Whole-layer waves from the master LP's solution (``tau`` ``[columns]``) by rounding."""
    support = [w for w in range(len(columns)) if tau[w] > 1e-9]
    cols = [columns[w] for w in support]
    layers = _round_layers(ops, frontier, cols, tau[support])
    waves = []
    for col, ls in zip(cols, layers):
        wave = [Run(op=frontier[i], n=col[i], layers=ls[i]) for i in range(len(frontier)) if col[i] and ls[i] > 0]
        if wave:
            waves.append(wave)
    return waves


def generate_columns(ops: Sequence[MetaOp], frontier: Sequence[int], gpus: int, seeds: Sequence[Sequence[Run]], *,
                     max_rounds: int = 8) -> tuple[list[Config], np.ndarray]:
    """The configurations (seeds' waves, then priced ones) and the master LP's wave lengths ``[columns]``."""
    pos = {g: i for i, g in enumerate(frontier)}
    counts = [ops[g].counts for g in frontier]
    rates = [np.array([1.0 / ops[g].ms(c) for c in ops[g].counts]) for g in frontier]
    rate_of = [dict(zip(cs, rs)) for cs, rs in zip(counts, rates)]
    columns: list[Config] = []
    for wave in seeds:
        col = [0] * len(frontier)
        for r in wave:
            col[pos[r.op]] = r.n
        if any(col) and tuple(col) not in columns:
            columns.append(tuple(col))
    tau, y, _ = _master(columns, rate_of)
    for _ in range(max_rounds):
        value, col = _price(y, counts, rates, gpus)
        if value <= 1.0 + 1e-9 or col in columns:
            break
        columns.append(col)
        tau, y, _ = _master(columns, rate_of)
    return columns, tau
