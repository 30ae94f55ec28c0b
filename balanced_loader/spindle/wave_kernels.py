"""Numba kernel of the wave refinement (arrays in, arrays out), with its pure-Python reference.

``wave_length``: the least length of one wave, given each MetaOp's layers in it and its
per-layer time at each allowed count (rows padded with inf), under ``sum counts <= gpus``.
Greedy: start every MetaOp on its smallest count, then repeatedly move the slowest one to its
next count while the devices last. This is optimal: every other MetaOp already has the least
count that keeps it under the current maximum, so only the slowest can lower it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def wave_length(layers: np.ndarray, layer_ms: np.ndarray, counts: np.ndarray, gpus: int) -> tuple[float, np.ndarray]:
    """``layers [k]``, ``layer_ms [k, C]`` (inf-padded), ``counts [k, C]`` -> (length, count index ``[k]``)."""
    k, width = layer_ms.shape
    idx = np.zeros(k, dtype=np.int64)
    used = 0
    times = np.empty(k)
    for i in range(k):
        used += counts[i, 0]
        times[i] = layers[i] * layer_ms[i, 0]
    if used > gpus:
        return math.inf, idx
    while True:
        i = 0
        for j in range(1, k):
            if times[j] > times[i]:
                i = j
        nxt = idx[i] + 1
        if nxt >= width or not math.isfinite(layer_ms[i, nxt]) or used + counts[i, nxt] - counts[i, nxt - 1] > gpus:
            return times[i], idx
        used += counts[i, nxt] - counts[i, nxt - 1]
        idx[i] = nxt
        times[i] = layers[i] * layer_ms[i, nxt]


def wave_length_reference(layers: list[float], layer_ms: list[list[float]], counts: list[list[int]],
                          gpus: int) -> tuple[float, list[int]]:
    """Pure-Python reference of :func:`wave_length`."""
    idx = [0] * len(layers)
    used = sum(c[0] for c in counts)
    times = [m * t[0] for m, t in zip(layers, layer_ms)]
    if used > gpus:
        return math.inf, idx
    while True:
        i = max(range(len(times)), key=lambda j: (times[j], -j))
        nxt = idx[i] + 1
        if (nxt >= len(layer_ms[i]) or not math.isfinite(layer_ms[i][nxt])
                or used + counts[i][nxt] - counts[i][nxt - 1] > gpus):
            return times[i], idx
        used += counts[i][nxt] - counts[i][nxt - 1]
        idx[i] = nxt
        times[i] = layers[i] * layer_ms[i][nxt]


def warm() -> None:
    """Compile the kernel, or load it from numba's cache, so that planning times exclude it."""
    wave_length(np.ones(1), np.ones((1, 1)), np.ones((1, 1), dtype=np.int64), 1)
