"""Scalability estimator: the per-layer time of a MetaOp on ``n`` devices.

Two kinds, both monotone non-increasing in ``n``:

* :class:`AlphaBeta` (Spindle's model, papers/spindle.md §3): pure data parallel,
  ``alpha_ms + beta_ms * ceil(batch / n)``.
* :class:`ShapeScaling`: a model shape and the step's token counts. On ``n`` devices the
  MetaOp takes the best ``tp x dp`` layout (``tp`` in 1, 2, 4, 8 inside one node) of the
  analytic cost model (:func:`balanced_loader.presets.analytic_cost` for a ``layers``-deep,
  vocabulary-free stack), with each lane's load at the balancer's target
  ``max(sum_c / dp, max_c)`` for per-doc costs ``c = q*s^2 + l*s`` (FLOP-weighted tokens),
  plus the fixed per-microbatch time once per microbatch, a lane's share being cut into
  microbatches of at most the memory cap in tokens. A layout whose cap is below the longest
  doc is infeasible (no context parallelism here). The table is then made monotone by a running minimum (on ``n``
  devices the MetaOp may leave some idle), and the allocator takes the concave envelope of
  the speedup (:mod:`balanced_loader.spindle.allocator`), so bisection and slicing stay valid.
  There is no data-parallel gradient term, as in Spindle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBeta:
    """``alpha_ms + beta_ms * ceil(batch / n)`` per layer on ``n`` devices (data parallel)."""

    alpha_ms: float
    beta_ms: float
    batch: int

    def layer_ms(self, n: int) -> float:
        if n < 1:
            return math.inf
        return self.alpha_ms + self.beta_ms * (-(-self.batch // n))

    def layout(self, n: int) -> tuple[int, int]:
        """``(tp, dp)`` used on ``n`` devices."""
        return (1, n)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeScaling:
    """Per-layer time table over device counts, from a model shape and token counts."""

    table_ms: tuple[float, ...]  # [max_gpus + 1] per-layer ms on n devices (running minimum), inf: infeasible
    layouts: tuple[tuple[int, int], ...]  # [max_gpus + 1] (tp, dp) reaching table_ms[n]; tp * dp <= n

    def layer_ms(self, n: int) -> float:
        if n < 1:
            return math.inf
        return self.table_ms[min(n, len(self.table_ms) - 1)]

    def layout(self, n: int) -> tuple[int, int]:
        return self.layouts[min(n, len(self.layouts) - 1)]


def shape_scaling(*, hidden: int, heads: int, kv_heads: int, ffn: int, layers: int, tokens: np.ndarray,
                  hardware: str, max_gpus: int, gpus_per_node: int, world_size: int) -> ShapeScaling:
    """Best-layout per-layer time for ``n = 0..max_gpus`` devices (see the module docstring).

    ``tokens``: ``[batch]`` token counts of the step's docs for this MetaOp.
    """
    from balanced_loader.presets import HARDWARE, ModelShape, analytic_cost

    hw = HARDWARE[hardware]
    model = ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=0)
    tps = tuple(t for t in TP_DEGREES if t <= gpus_per_node and t <= max_gpus and heads % t == 0)
    cost = analytic_cost(model, hw, world_size=world_size, shapes=tuple((t, 1) for t in tps))
    s = np.asarray(tokens, dtype=np.float64)  # [batch]
    total_tokens, max_tokens = float(s.sum()), float(s.max())
    n = np.arange(max_gpus + 1)  # [max_gpus + 1]
    best = np.full(max_gpus + 1, np.inf)  # [max_gpus + 1]
    best_tp = np.ones(max_gpus + 1, dtype=np.int64)  # [max_gpus + 1]
    for tp in tps:
        sc = cost.shape(tp, 1)
        q, lin, mb = sc.quadratic_ms / layers, sc.linear_ms / layers, sc.microbatch_ms / layers
        sum_c = q * float(np.dot(s, s)) + lin * total_tokens
        max_c = q * max_tokens * max_tokens + lin * max_tokens
        ok = (n >= tp) & (n % tp == 0) & (max_tokens <= sc.max_tokens_per_lane)
        dp = np.where(ok, n // tp, 1)  # [max_gpus + 1]
        lane_tokens = np.maximum(np.ceil(total_tokens / dp), max_tokens)
        micro = np.ceil(lane_tokens / max(sc.max_tokens_per_lane, 1))  # microbatches that fit in memory
        t = np.where(ok, mb * micro + np.maximum(sum_c / dp, max_c), np.inf)
        better = t < best
        best = np.where(better, t, best)
        best_tp = np.where(better, tp, best_tp)
    table = np.minimum.accumulate(best)  # monotone: on n devices, the best layout on at most n
    # The device count reaching each running minimum (first index where it was attained).
    arg = np.zeros(max_gpus + 1, dtype=np.int64)
    for i in range(1, max_gpus + 1):
        arg[i] = i if best[i] <= table[i - 1] or i == 1 else arg[i - 1]
    layouts = tuple((int(best_tp[a]), int(a // best_tp[a]) if a else 0) for a in arg)
    return ShapeScaling(table_ms=tuple(float(x) for x in table), layouts=layouts)
