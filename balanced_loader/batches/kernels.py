"""Numba kernels of stage 2: the Feistel permutation with cycle-walking, per position.

Why a kernel: a window's units are permuted by position, a few dozen to a few thousand at a time; in
numpy each of the 6 rounds (and each round of cycle-walking) is several array calls, so small reads
cost ~100 us of call overhead per position batch. Here one call does the whole walk of every position
(~50 ns each). uint64 arithmetic wraps, as in the numpy form (tested equal to it in
``tests/balanced_loader/test_batching.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _mix(x, key):
    """splitmix64's finalizer of ``x ^ key`` (uint64, wrapping)."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def feistel_walk(pos, keys, half, n, inverse):
    """``[k]`` int64: each position through the Feistel network over ``2 * half`` bits (``keys``: ``[rounds]``
    uint64; ``inverse``: decrypt), re-applied until the value is below ``n`` (cycle-walking)."""
    h = np.uint64(half)
    mask = np.uint64((1 << half) - 1)
    rounds = keys.shape[0]
    out = np.empty(pos.shape[0], np.int64)
    nn = np.uint64(n)
    for i in range(pos.shape[0]):
        x = np.uint64(pos[i])
        while True:
            left, right = x >> h, x & mask
            if inverse:
                for r in range(rounds - 1, -1, -1):  # (L', R') -> (R' ^ F(L'), L')
                    left, right = right ^ (_mix(left, keys[r]) & mask), left
            else:
                for r in range(rounds):  # (L, R) -> (R, L ^ F(R))
                    left, right = right, left ^ (_mix(right, keys[r]) & mask)
            x = (left << h) | right
            if x < nn:
                break
        out[i] = np.int64(x)
    return out
