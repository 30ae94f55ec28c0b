"""``batch-ada``: FlexSP's BatchAda baseline, the best single sequence-parallel degree per batch.

One pool of shape ``(config.tp or 1, config.pp or 1)``. For every power-of-two degree ``d``
that holds the batch's longest doc, docs are packed best-fit decreasing into bins of
``max(fill * max_tokens_per_lane * d, longest doc)`` tokens (FlexSP's ``adaptive_bfd``,
``fill`` 0.9); the bins go longest-processing-time first onto the ``lanes // d`` aligned lane
blocks (bin ``i`` of a block runs in microbatch ``i``, so every microbatch holds up to
``lanes // d`` bins, as in FlexSP). The degree with the fastest contract-2 time wins.

Knobs (``PlanConfig.extra``): ``fill`` (0.9), ``min_degree`` (1). Deterministic.
"""

from __future__ import annotations

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost
from balanced_loader.plan import BatchItems, Group, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.packing import BFD_MAX_CAPACITY, pack
from balanced_loader.planning.policies.common import check_fits, one_pool_plan, pool_setup, sp_degrees
from balanced_loader.planning.solvers.bins import lpt_blocks
from balanced_loader.simulate import makespan_ms
from balanced_loader.strict import check_keys

_DEFAULTS = {"fill": 0.9, "min_degree": 1}


def _options(config: PlanConfig) -> tuple[float, int]:
    check_keys(config.extra, (*_DEFAULTS, "length_histogram"), "policy 'batch-ada'", word="option")
    fill = config.extra.get("fill", _DEFAULTS["fill"])
    mind = config.extra.get("min_degree", _DEFAULTS["min_degree"])
    if isinstance(fill, bool) or not isinstance(fill, (int, float)) or not 0 < fill <= 1:
        raise ValueError(f"policy 'batch-ada': fill must be in (0, 1], got {fill!r}")
    if isinstance(mind, bool) or not isinstance(mind, int) or mind < 1 or mind & (mind - 1):
        raise ValueError(f"policy 'batch-ada': min_degree must be a power of two >= 1, got {mind!r}")
    return float(fill), int(mind)


def best_degree(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int], fill: float, pp: int
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The fastest single degree (module docstring): ``(d, bin per doc [n], block per bin, position per bin)``."""
    cap = sc.max_tokens_per_lane
    longest = int(lengths.max())
    best: tuple[float, int, np.ndarray, np.ndarray, np.ndarray] | None = None
    for d in degrees:
        if longest > cap * d:
            continue
        capacity = min(cap * d, max(int(fill * cap * d), longest))
        bins = pack(lengths, capacity, "bfd" if capacity <= BFD_MAX_CAPACITY else "ffd")  # [n] (bfd: a leaf per token)
        nb = int(bins.max()) + 1
        seg = np.asarray(sc.segment_ms(lengths.astype(np.float64), d))  # [n]
        times = sc.microbatch_ms + np.bincount(bins, weights=seg, minlength=nb)  # [num_bins]
        block, pos = lpt_blocks(times, num_lanes // d)
        # each block runs its bins back to back: its finish is the sum of their stage shares
        finish = np.bincount(block, weights=times, minlength=num_lanes // d) / pp  # [num_lanes // d]
        span = makespan_ms(finish, float(times.max()), pp)
        if best is None or span < best[0] - 1e-9:
            best = (span, d, bins, block, pos)
    assert best is not None
    return best[1:]


def batch_ada_arrays(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, degrees: list[int], pp: int,
                     fill: float = _DEFAULTS["fill"]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BatchAda's plan as per-item ``(microbatch, first lane, degree)`` ``[n]`` each (bin ``b`` of a block
    runs in microbatch ``position[b]``, as :func:`plan_step` lays it out)."""
    d, bins, block, pos = best_degree(np.asarray(lengths, dtype=np.int64), sc, num_lanes, degrees, fill, pp)
    return pos[bins], block[bins] * d, np.full(len(bins), d, dtype=np.int64)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    fill, min_degree = _options(config)
    setup = pool_setup(items, cost, config, "batch-ada")
    tp, pp, sc, num_lanes = setup.tp, setup.pp, setup.shape, setup.lanes
    degrees = sp_degrees(config, num_lanes, min_degree, "batch-ada")
    cap = sc.max_tokens_per_lane
    lengths = np.asarray(items.lengths, dtype=np.int64)
    check_fits(items, cap, degrees[-1], "batch-ada")
    if len(items) == 0:
        return one_pool_plan(step, config.world_size, tp, pp, ())
    d, bins, block, pos = best_degree(lengths, sc, num_lanes, degrees, fill, pp)
    microbatches: list[list[Group]] = [[] for _ in range(int(pos.max()) + 1)]
    for b in range(len(block)):
        docs = np.flatnonzero(bins == b)
        lanes = tuple(range(int(block[b]) * d, (int(block[b]) + 1) * d))
        microbatches[int(pos[b])].append(Group(lanes=lanes, segments=tuple(items.segment(int(i)) for i in docs)))
    return one_pool_plan(step, config.world_size, tp, pp, tuple(tuple(mb) for mb in microbatches))
