"""FlexSP's sequence blaster: min-max contiguous chunking and error-minimizing length buckets.

Both are dynamic programs with a numba kernel and a pure-Python reference of the same
recurrence and the same tie-breaking (the smallest split index wins), so tests compare them
exactly.

* :func:`chunk_cuts`: lengths sorted descending, cut into ``M`` contiguous non-empty chunks so
  the largest chunk's token sum is minimal: ``D[m][i] = min_j max(D[m-1][j], S[i] - S[j])``.
* :func:`bucket_ends`: distinct lengths ascending with counts, grouped into at most ``Q``
  contiguous buckets whose bound is their longest length, minimizing the padding
  ``sum count * (bound - length)`` (FlexSP eq. 16).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _chunk_kernel(prefix: np.ndarray, m_chunks: int) -> np.ndarray:
    k = prefix.shape[0] - 1
    big = np.iinfo(np.int64).max
    best = np.full((m_chunks + 1, k + 1), big, dtype=np.int64)  # [M+1][K+1]
    arg = np.zeros((m_chunks + 1, k + 1), dtype=np.int64)  # [M+1][K+1]
    for i in range(1, k + 1):
        best[1, i] = prefix[i]
    # best[m, i]: the smallest largest-chunk sum cutting the first i values into m chunks; the last
    # chunk is (j, i], so best[m, i] = min_j max(best[m - 1, j], sum(j, i]); arg keeps the j for the cuts
    for m in range(2, m_chunks + 1):
        for i in range(m, k + 1):
            b = big
            bj = m - 1
            for j in range(m - 1, i):
                left = best[m - 1, j]
                right = prefix[i] - prefix[j]
                v = left if left > right else right
                if v < b:
                    b = v
                    bj = j
            best[m, i] = b
            arg[m, i] = bj
    cuts = np.zeros(m_chunks + 1, dtype=np.int64)  # [M+1]
    cuts[m_chunks] = k
    i = k
    for m in range(m_chunks, 1, -1):
        i = arg[m, i]
        cuts[m - 1] = i
    return cuts


def chunk_cuts_reference(lengths: np.ndarray, m_chunks: int) -> np.ndarray:
    """Pure-Python twin of :func:`chunk_cuts`."""
    k = len(lengths)
    prefix = [0]
    for s in lengths:
        prefix.append(prefix[-1] + int(s))
    big = float("inf")
    best = [[big] * (k + 1) for _ in range(m_chunks + 1)]
    arg = [[0] * (k + 1) for _ in range(m_chunks + 1)]
    for i in range(1, k + 1):
        best[1][i] = prefix[i]
    for m in range(2, m_chunks + 1):
        for i in range(m, k + 1):
            b, bj = big, m - 1
            for j in range(m - 1, i):
                v = max(best[m - 1][j], prefix[i] - prefix[j])
                if v < b:
                    b, bj = v, j
            best[m][i] = b
            arg[m][i] = bj
    cuts = [0] * (m_chunks + 1)
    cuts[m_chunks] = k
    i = k
    for m in range(m_chunks, 1, -1):
        i = arg[m][i]
        cuts[m - 1] = i
    return np.asarray(cuts, dtype=np.int64)


def chunk_cuts(lengths: np.ndarray, m_chunks: int) -> np.ndarray:
    """``[M+1]`` cut positions (0 first, K last) of ``M`` contiguous chunks with minimal max tokens.

    ``lengths`` ``[K]`` in planning order (FlexSP: descending). ``1 <= M <= K``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    assert 1 <= m_chunks <= len(lengths)
    prefix = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [K+1]
    return _chunk_kernel(prefix, int(m_chunks))


@njit(cache=True)
def _bucket_kernel(values: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    u = values.shape[0]
    q_max = min(q_max, u)
    pc = np.zeros(u + 1, dtype=np.int64)  # [U+1] prefix counts
    pt = np.zeros(u + 1, dtype=np.int64)  # [U+1] prefix count * value
    for i in range(u):
        pc[i + 1] = pc[i] + counts[i]
        pt[i + 1] = pt[i] + counts[i] * values[i]
    big = np.iinfo(np.int64).max
    best = np.full((q_max + 1, u + 1), big, dtype=np.int64)  # [Q+1][U+1]
    arg = np.zeros((q_max + 1, u + 1), dtype=np.int64)
    # padding of one bucket (j, k]: every doc padded to the bucket's largest value values[k - 1],
    # i.e. values[k - 1] * count - sum(count * value), both from the prefix sums in O(1)
    for k in range(1, u + 1):
        best[1, k] = values[k - 1] * pc[k] - pt[k]
    for q in range(2, q_max + 1):
        for k in range(q, u + 1):
            b = big
            bj = q - 1
            for j in range(q - 1, k):
                v = best[q - 1, j] + values[k - 1] * (pc[k] - pc[j]) - (pt[k] - pt[j])
                if v < b:
                    b = v
                    bj = j
            best[q, k] = b
            arg[q, k] = bj
    ends = np.zeros(q_max, dtype=np.int64)  # [Q] exclusive end index of each bucket
    k = u
    for q in range(q_max, 0, -1):
        ends[q - 1] = k
        k = arg[q, k]
    return ends


def bucket_ends_reference(values: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """Pure-Python twin of :func:`bucket_ends`."""
    u = len(values)
    q_max = min(q_max, u)
    pc, pt = [0], [0]
    for v, c in zip(values, counts):
        pc.append(pc[-1] + int(c))
        pt.append(pt[-1] + int(c) * int(v))
    big = float("inf")
    best = [[big] * (u + 1) for _ in range(q_max + 1)]
    arg = [[0] * (u + 1) for _ in range(q_max + 1)]
    for k in range(1, u + 1):
        best[1][k] = int(values[k - 1]) * pc[k] - pt[k]
    for q in range(2, q_max + 1):
        for k in range(q, u + 1):
            b, bj = big, q - 1
            for j in range(q - 1, k):
                v = best[q - 1][j] + int(values[k - 1]) * (pc[k] - pc[j]) - (pt[k] - pt[j])
                if v < b:
                    b, bj = v, j
            best[q][k] = b
            arg[q][k] = bj
    ends = [0] * q_max
    k = u
    for q in range(q_max, 0, -1):
        ends[q - 1] = k
        k = arg[q][k]
    return np.asarray(ends, dtype=np.int64)


def bucket_ends(values: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """Exclusive end indices ``[min(Q, U)]`` of the error-minimizing buckets over distinct ``values``.

    ``values`` ``[U]`` strictly ascending, ``counts`` ``[U]`` positive. Bucket ``b`` holds
    ``values[ends[b-1]:ends[b]]`` and is bounded by its last value.
    """
    return _bucket_kernel(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64), int(q_max))


def padding_error(values: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> int:
    """Tokens added by rounding every length up to its bucket's bound."""
    err, start = 0, 0
    for e in ends:
        seg_v = np.asarray(values[start:e], dtype=np.int64)
        seg_c = np.asarray(counts[start:e], dtype=np.int64)
        err += int((seg_c * (int(values[e - 1]) - seg_v)).sum())
        start = int(e)
    return err


def buckets_for(lengths: np.ndarray, capacity_tokens: int, q0: int = 16,
                step: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Bucket label per doc and each bucket's bound: the DP with ``Q`` grown from ``q0``.

    ``Q`` grows until the rounded tokens are at most ``(real tokens + capacity) / 2``
    (FlexSP's rule, which keeps the rounded problem within the cluster's memory), or
    every distinct length has its own bucket. Returns ``(label [K], bound [B])``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    values, inverse, counts = np.unique(lengths, return_inverse=True, return_counts=True)
    real = int(lengths.sum())
    limit = (real + capacity_tokens) / 2
    q = max(1, q0)
    while True:
        ends = bucket_ends(values, counts, q)
        if len(ends) >= len(values) or real + padding_error(values, counts, ends) <= limit:
            break
        q += step
    label_of_value = np.zeros(len(values), dtype=np.int64)  # [U]
    start = 0
    for b, e in enumerate(ends):
        label_of_value[start:e] = b
        start = int(e)
    bound = values[np.asarray(ends) - 1].astype(np.int64)  # [B]
    return label_of_value[inverse], bound
