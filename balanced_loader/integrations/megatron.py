r"""A drop-in for Megatron-Core's hybrid (dynamic) context-parallel scheduler: :class:`HydraCPScheduler`.

**What it replaces.** megatron-core 0.16's ``HybridCPDataLoaderWrapper`` (``datasets/data_schedule.py``)
gathers every DP rank's sub-sample lengths into ``sample_id_seqlens = [(global_id, seqlen), ...]`` and asks
``BalancedCPScheduler.get_groups_and_subsamples(sample_id_seqlens, config)``
(``pipeline_parallel/hybrid_cp_schedule.py``) for ``(groups, sample_id_groups)``: per *group*, one list per
DP x CP rank, ``groups[j][r]`` the sequence lengths and ``sample_id_groups[j][r]`` the sample ids rank ``r``
runs in group ``j``, in order. Only ``sample_id_groups`` drives the run.

**Megatron's execution model** (``hybrid_context_parallel_forward_backward``). Rank ``r`` runs the samples of
``sample_id_groups[j][r]`` one after another, **each its own forward and backward** (so each pays the
fixed per-pass cost); a sample listed on ``k`` ranks runs with context parallelism ``k`` on the process
group of those ranks (``local_cp_size = k``), which must be one Megatron created:
``create_hybrid_dp_cp_groups`` makes aligned blocks of every power of two ``2 <= k < 2^floor(log2 N)`` over
the ``N`` DP x CP ranks, and the whole DP x CP group serves ``k = N``; ``k = 1`` needs no group. A
``torch.distributed.barrier`` over the DP x CP group follows every group but the last, and the last group
must give every rank at least one sample (its last sample runs outside ``no_sync``). A sample starts when
all its ranks reach it, so the per-rank orders must be consistent (no cycle of waits).

**The plan and the cost** live in :mod:`balanced_loader.planning.megatron_cp` (Megatron's execution model
as a contract-1 plan, :func:`modeled_ms`, and hydra's schedule of samples, :func:`plan_samples`); this module is
the adapter: Megatron's data structures in and out, checked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.planning.megatron_cp import (
    allowed_block,
    group_sizes,
    lower_bound_ms,
    normalize_samples,
    plan_samples,
    run_order,
)

DEFAULT_COST = "hydra-gpt7b-a100"  # FlexSP GPT-7B on A100 coefficients, its cap replaced by max_seq_len_per_rank
def check_schedule(sample_id_groups: Sequence[Sequence[Sequence[Any]]], sample_id_seqlens: Any, world_size: int,
                   max_seq_len_per_rank: int, groups: Any = None) -> None:
    """One ``ValueError`` naming the first way a schedule breaks Megatron's rules (module doc), else ``None``:
    ``world_size`` lists per group, every sample once, on an allowed block that holds it
    (``ceil(s / k) <= max_seq_len_per_rank``), every rank busy in the last group, per-rank orders without a
    cycle of waits, and (when given) ``groups`` the lengths of ``sample_id_groups``."""
    ids, lens = normalize_samples(sample_id_seqlens)
    length = dict(zip(ids, lens.tolist()))
    seen: set[Any] = set()
    if not sample_id_groups and ids:
        raise ValueError("no groups")
    for j, grp in enumerate(sample_id_groups):
        if len(grp) != world_size:
            raise ValueError(f"group {j} has {len(grp)} rank lists, not {world_size}")
        ranks: dict[Any, list[int]] = {}
        for r, lst in enumerate(grp):
            for sid in lst:
                ranks.setdefault(sid, []).append(r)
        for sid, rs in ranks.items():
            if sid not in length:
                raise ValueError(f"group {j} lists sample {sid}, which is not in sample_id_seqlens")
            if sid in seen:
                raise ValueError(f"sample {sid} is in more than one group")
            if len(set(rs)) != len(rs):
                raise ValueError(f"group {j}: a rank lists sample {sid} twice")
            k = len(rs)
            if rs != list(range(rs[0], rs[0] + k)) or not allowed_block(rs[0], k, world_size):
                raise ValueError(f"group {j}: sample {sid} is on ranks {rs[:8]}{'...' if k > 8 else ''}, not one of "
                                 f"Megatron's hybrid DP x CP groups (aligned blocks of sizes "
                                 f"{group_sizes(world_size)})")
            if -(-length[sid] // k) > max_seq_len_per_rank:
                raise ValueError(f"sample {sid} ({length[sid]} tokens) on {k} ranks holds {-(-length[sid] // k)} a "
                                 f"rank, over max_seq_len_per_rank {max_seq_len_per_rank}")
        seen.update(ranks)
        if groups is not None and [list(x) for x in groups[j]] != [[length[s] for s in lst] for lst in grp]:
            raise ValueError(f"groups[{j}] does not list the lengths of sample_id_groups[{j}]")
        run_order(grp)  # raises on a cycle of waits
    missing = [sid for sid in ids if sid not in seen]
    if missing:
        raise ValueError(f"{len(missing)} sample(s) are in no group (first: {missing[0]})")
    if sample_id_groups and not all(sample_id_groups[-1]):
        r = next(r for r, lst in enumerate(sample_id_groups[-1]) if not lst)
        raise ValueError(f"rank {r} has no sample in the last group (Megatron runs the last group's last sample "
                         f"outside no_sync on every rank)")


def scheduler_cost(cost: Any, max_seq_len_per_rank: int, world_size: int) -> CostModel:
    """The scheduler's cost model: ``cost`` as the loader takes it (:func:`balanced_loader.presets.resolve_cost`:
    a :class:`CostModel`, a cost file, a preset name; ``None``: ``DEFAULT_COST``), uniform, its lane cap set to
    ``max_seq_len_per_rank`` (the memory rule is Megatron's)."""
    import os

    from balanced_loader.presets import resolve_cost

    if cost is not None and not isinstance(cost, (CostModel, str, os.PathLike)):
        raise ValueError(f"cost must be a CostModel, a cost file or a preset name, got {type(cost).__name__}")
    cost = resolve_cost(DEFAULT_COST if cost is None else cost, world_size)
    if not cost.uniform:
        raise ValueError("HydraCPScheduler plans ranks of one speed: pass a cost without device_classes or lane_speed")
    return cost.with_base(max_tokens_per_lane=int(max_seq_len_per_rank))


class HydraCPScheduler:
    """A drop-in for megatron-core's ``BalancedCPScheduler`` (module doc): same constructor and
    ``get_groups_and_subsamples(sample_id_seqlens, config) -> (groups, sample_id_groups)``.

    ``dp_cp_group``: the DP x CP process group (only its ``size()`` is read), or ``world_size=`` without one
    (on CPU, in tests). ``cost``: a :class:`CostModel`, a cost file or a preset name; by default the
    ``hydra-gpt7b-a100`` preset (FlexSP's GPT-7B A100 coefficients) with ``max_seq_len_per_rank`` as its lane
    cap. ``megatron_candidate``: also evaluate Megatron's own schedule and keep it when it is faster.
    After each call, ``last`` holds the chosen schedule's modeled time, which candidate won and the
    planning seconds."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: Any = None, *, world_size: int | None = None,
                 cost: Any = None, megatron_candidate: bool = True) -> None:
        if isinstance(max_seq_len_per_rank, bool) or not isinstance(max_seq_len_per_rank, (int, np.integer)) \
                or max_seq_len_per_rank < 1:
            raise ValueError(f"max_seq_len_per_rank must be a positive integer, got {max_seq_len_per_rank!r}")
        if dp_cp_group is not None:
            size = int(dp_cp_group.size())
            if world_size is not None and world_size != size:
                raise ValueError(f"world_size={world_size} but dp_cp_group has {size} ranks; give one of them")
            world_size = size
        if world_size is None or isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
                or world_size < 1:
            raise ValueError(f"HydraCPScheduler needs dp_cp_group or world_size (a positive integer), "
                             f"got {world_size!r}")
        self.max_seq_len_per_rank = int(max_seq_len_per_rank)
        self.total_hdp_gpus = int(world_size)  # Megatron's name for the DP x CP size
        self.cost = scheduler_cost(cost, self.max_seq_len_per_rank, self.total_hdp_gpus)
        self.megatron_candidate = bool(megatron_candidate)
        self.last: dict[str, Any] = {}
        # load the placement kernel now (numba, cached on disk), so that the first step does not pay for it
        plan_samples(np.ones(1, dtype=np.int64), self.total_hdp_gpus, self.max_seq_len_per_rank, self.cost,
                     megatron_candidate=False)

    def get_groups_and_subsamples(self, sample_id_seqlens: Any, config: Any = None
                                  ) -> tuple[list[list[list[int]]], list[list[list[Any]]]]:
        """``(groups, sample_id_groups)`` as Megatron's: per group, per DP x CP rank, the sequence lengths and the
        sample ids it runs in order; ``config`` is accepted and unused, as in Megatron."""
        t0 = time.perf_counter()
        ids, lens = normalize_samples(sample_id_seqlens)
        sched = plan_samples(lens, self.total_hdp_gpus, self.max_seq_len_per_rank, self.cost,
                             megatron_candidate=self.megatron_candidate)
        sample_id_groups = [[[ids[i] for i in lst] for lst in grp] for grp in sched.groups]
        groups = [[[int(lens[i]) for i in lst] for lst in grp] for grp in sched.groups]
        self.last = {"modeled_ms": sched.modeled_ms, "how": sched.how, "groups": len(groups),
                     "plan_seconds": time.perf_counter() - t0,
                     "lower_bound_ms": lower_bound_ms(lens, self.cost.shape(1, 1), self.total_hdp_gpus,
                                                      self.max_seq_len_per_rank)}
        return groups, sample_id_groups


def megatron_cp_degrees(sample_id_groups: Sequence[Sequence[Sequence[Any]]]) -> dict[Any, int]:
    """The CP size each sample runs with (the ranks that list it in its group), as Megatron computes
    ``local_cp_size``."""
    out: dict[Any, int] = {}
    for grp in sample_id_groups:
        for lst in grp:
            for sid in lst:
                out[sid] = out.get(sid, 0) + 1
    return out


