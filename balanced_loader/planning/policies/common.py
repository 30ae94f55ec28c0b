"""Small helpers shared by policies: building groups and microbatches lane by lane."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks

if TYPE_CHECKING:
    from balanced_loader.plan import BatchItems
    from balanced_loader.planning.config import PlanConfig


class MicrobatchBuilder:
    """Places groups so that the groups of one microbatch use disjoint lanes.

    A group goes into the first microbatch index after every one of its lanes' earlier
    groups (``k = max(next_k[lanes])``), which is exactly the contract-2 execution order.
    """

    def __init__(self, num_lanes: int) -> None:
        self.next_k = np.zeros(num_lanes, dtype=np.int64)  # [num_lanes]
        self.microbatches: list[list[Group]] = []  # [num_microbatches][groups]

    def add(self, lanes: Sequence[int], segments: Sequence[tuple[int, int, int]], k: int | None = None) -> int:
        lanes = tuple(int(x) for x in lanes)
        kk = int(self.next_k[list(lanes)].max()) if k is None else k
        assert k is None or kk >= int(self.next_k[list(lanes)].max())
        while len(self.microbatches) <= kk:
            self.microbatches.append([])
        self.microbatches[kk].append(Group(lanes=lanes, segments=tuple(segments)))
        self.next_k[list(lanes)] = kk + 1
        return kk

    def build(self) -> tuple[tuple[Group, ...], ...]:
        return tuple(tuple(mb) for mb in self.microbatches if mb)


def one_pool_plan(step: int, world_size: int, tp: int, pp: int,
                  microbatches: tuple[tuple[Group, ...], ...]) -> StepPlan:
    """A plan with a single pool of shape (tp, pp) covering the whole world."""
    pool = Pool(tp=tp, pp=pp, ranks=single_pool_ranks(world_size, tp, pp), microbatches=microbatches)
    return StepPlan(step=step, world_size=world_size, pools=(pool,))


def check_fits(items: BatchItems, cap: int, max_degree: int, policy: str, *, what: str = "largest degree",
               fix: str = "use more lanes or a shape with a larger max_tokens_per_lane") -> None:
    """One clear error naming the longest item when no group of ``max_degree`` lanes holds it."""
    if len(items) and int(items.lengths.max()) > cap * max_degree:
        i = int(np.argmax(items.lengths))
        raise ValueError(f"policy '{policy}': doc {int(items.doc_ids[i])} ({int(items.lengths[i])} tokens) does not "
                         f"fit: max_tokens_per_lane {cap} x {what} {max_degree} = {cap * max_degree} tokens; split "
                         f"long docs (--max-seq-len N, or the loader's max_seq_len with long_docs='split') or {fix}")


def max_cp_degree(config: PlanConfig, lanes: int, policy: str) -> int:
    """The largest CP/SP group a dynamic-degree policy may form: ``config.cp`` (a power of two, at
    most ``lanes``) when set, else ``lanes``. ``cp=1`` is plain data parallelism: one lane per group."""
    cp = config.cp
    if cp is None:
        return lanes
    if cp & (cp - 1) or cp > lanes:
        raise ValueError(f"policy '{policy}': --cp {cp} must be a power of two of at most the {lanes} lanes "
                         f"per stage (it caps the CP degree on aligned lane blocks)")
    return cp


def refuse_flags(config: PlanConfig, policy: str, flags: Sequence[str], why: str, *, cp1_ok: bool = False) -> None:
    """One clear error when a flag the policy cannot honour is set (never silently ignored).
    ``cp1_ok``: the policy's groups are single lanes anyway, so ``cp=1`` holds."""
    for flag in flags:
        v = getattr(config, flag)
        if v is not None and not (cp1_ok and flag == "cp" and v == 1):
            raise ValueError(f"policy '{policy}' cannot honour --{flag} {v}: {why}")
