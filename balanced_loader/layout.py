"""The one context-parallel token layout, shared by the loader and every CP engine.

A doc of ``length`` tokens on a group of ``degree = inner * outer`` lanes is padded to a
multiple of ``2 * degree`` and cut into ``2 * outer`` equal chunks (zigzag on the outer
index): outer rank ``j`` owns chunks ``j`` and ``2*outer - 1 - j``. Each owned chunk is then
split evenly among the ``inner`` ranks, inner rank ``i`` taking sub-chunk ``i`` of both.
Lane ``j * inner + i`` of the group holds, in order, its sub-chunk of chunk ``j`` followed by
its sub-chunk of chunk ``2*outer - 1 - j``.

* ``inner == 1`` is the plain per-doc zigzag used by ring attention.
* ``outer == 1`` is the layout a Ulysses all-to-all gathers back into token order.
* Padding positions are ``-1``; every lane gets the same number of positions.
"""

from __future__ import annotations

import numpy as np


def padded_length(length: int, degree: int) -> int:
    """``length`` rounded up to a multiple of ``2 * degree`` (``length`` itself when degree == 1)."""
    if degree <= 1:
        return length
    m = 2 * degree
    return -(-length // m) * m


def cp_positions(length: int, degree: int, inner: int = 1) -> np.ndarray:
    """Token positions of each lane: ``[degree][padded_length // degree]``, ``-1`` for padding."""
    if degree < 1 or inner < 1 or degree % inner:
        raise ValueError(f"CP degree {degree} must be a positive multiple of the inner (Ulysses) size {inner}")
    if degree == 1:
        return np.arange(length, dtype=np.int64)[None, :]
    outer = degree // inner
    total = padded_length(length, degree)
    pos = np.arange(total, dtype=np.int64)
    pos[pos >= length] = -1
    chunks = pos.reshape(2 * outer, inner, total // (2 * outer) // inner)  # [2*outer][inner][sub]
    out = np.empty((degree, total // degree), dtype=np.int64)  # [degree][per_lane]
    half = total // degree // 2
    for j in range(outer):
        for i in range(inner):
            lane = j * inner + i
            out[lane, :half] = chunks[j, i]
            out[lane, half:] = chunks[2 * outer - 1 - j, i]
    return out


def lane_positions(length: int, degree: int, lane: int, inner: int = 1) -> np.ndarray:
    """Positions held by one lane of the group (``[padded_length // degree]``, ``-1`` for padding)."""
    return cp_positions(length, degree, inner)[lane]
