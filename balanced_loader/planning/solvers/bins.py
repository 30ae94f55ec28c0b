"""Longest-processing-time placement of bins (jobs with a time) onto equal lane blocks.

Packing itself (first-fit / best-fit decreasing) is :func:`balanced_loader.planning.packing.pack`.
"""

from __future__ import annotations

import heapq

import numpy as np


def lpt_blocks(times: np.ndarray, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Each job, longest first (ties: lower index), onto the least-loaded block (ties: lower block).

    Returns ``(block per job [n], position of the job in its block [n])``.
    """
    order = np.lexsort((np.arange(len(times)), -np.asarray(times, dtype=np.float64)))
    heap = [(0.0, b) for b in range(num_blocks)]
    block = np.zeros(len(times), dtype=np.int64)  # [n]
    pos = np.zeros(len(times), dtype=np.int64)  # [n]
    count = [0] * num_blocks
    for i in order:
        t, b = heapq.heappop(heap)
        block[i] = b
        pos[i] = count[b]
        count[b] += 1
        heapq.heappush(heap, (t + float(times[i]), b))
    return block, pos
