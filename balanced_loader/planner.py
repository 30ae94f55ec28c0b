"""Policy registry and the one entry point every caller uses: :func:`make_plan`.

A policy is a module in ``balanced_loader.policies`` with a function
``plan_step(items, cost, config, step) -> StepPlan``. Planning is a pure function of
(items, cost, config): every rank can compute the same plan.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.plan import StepPlan

# policy name -> module under balanced_loader.policies (imported lazily: the CLI starts fast)
POLICIES: dict[str, str] = {
    "greedy": "greedy",
    "maxlen": "maxlen",
    "static-sp": "static_sp",
    "token-kk": "token_kk",
    "mcore-dcp": "mcore_dcp",
    "hydra": "hydra",
    "batch-ada": "batch_ada",
    "flexsp": "flexsp",
    "hydraulis": "hydraulis",
    "pools": "pools",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What a policy needs besides the batch and the cost model."""

    policy: str = "hydra"
    world_size: int
    tp: int | None = None  # static shape for maxlen / static-sp (None: policy default)
    pp: int | None = None
    cp: int | None = None
    seed: int = 0
    time_limit_s: float = 1.0  # per solver call (flexsp, hydraulis)
    candidates: str | None = None  # hydraulis candidates file
    extra: dict[str, Any] = field(default_factory=dict)  # policy-specific knobs

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy '{self.policy}'; choose one of: {', '.join(POLICIES)}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        for k in ("tp", "pp", "cp"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        tp, pp = self.tp or 1, self.pp or 1
        if self.world_size % (tp * pp):
            raise ValueError(f"world_size {self.world_size} is not divisible by tp*pp = {tp * pp}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchItems:
    """The sequences of one global batch, each planned as an independent training sequence.

    A normal doc is one item with ``start == 0``; a doc split at the context limit is
    several items with the same doc_id.
    """

    doc_ids: np.ndarray  # [n] int64
    starts: np.ndarray  # [n] int64
    lengths: np.ndarray  # [n] int64

    def __post_init__(self) -> None:
        n = len(self.doc_ids)
        assert len(self.starts) == n and len(self.lengths) == n

    @staticmethod
    def from_lengths(lengths: Any, doc_ids: Any = None) -> BatchItems:
        ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
        ids = np.arange(len(ln), dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
        if ln.size and ln.min() <= 0:
            bad = int(np.flatnonzero(ln <= 0)[0])
            raise ValueError(f"lengths must be positive: doc {int(ids[bad])} has length {int(ln[bad])}")
        return BatchItems(doc_ids=ids, starts=np.zeros(len(ln), dtype=np.int64), lengths=ln)

    def __len__(self) -> int:
        return len(self.lengths)

    def segment(self, i: int) -> tuple[int, int, int]:
        return (int(self.doc_ids[i]), int(self.starts[i]), int(self.lengths[i]))

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def get_policy(name: str):
    """The ``plan_step`` function of a policy."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    try:
        mod = importlib.import_module(f"balanced_loader.policies.{POLICIES[name]}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("balanced_loader.policies"):
            raise ValueError(f"policy '{name}' is not available in this build") from None
        raise
    return mod.plan_step


def make_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int = 0) -> StepPlan:
    """Plan one step with ``config.policy``; fills ``plan_seconds`` and ``predicted_ms``."""
    fn = get_policy(config.policy)
    t0 = time.perf_counter()
    plan = fn(items, cost, config, step)
    dt = time.perf_counter() - t0
    from balanced_loader.simulate import step_ms  # vectorised contract-2 step time (equals cost.step_ms)

    return plan.with_timing(plan_seconds=dt, predicted_ms=step_ms(plan, cost))


def warm_up(batches: Sequence[BatchItems], cost: CostModel, configs: Sequence[PlanConfig]) -> None:
    """Load each policy and compile its kernels on a one-sequence batch, so ``plan_seconds`` is the
    step's own work. A failure here is left for the real step to report."""
    from balanced_loader.packing import warm_up as warm_kernels

    warm_kernels()
    first = next((b for b in batches if len(b)), None)
    if first is None:
        return
    i = int(np.argmin(first.lengths))
    one = BatchItems(doc_ids=first.doc_ids[i:i + 1], starts=first.starts[i:i + 1], lengths=first.lengths[i:i + 1])
    for c in configs:
        with contextlib.suppress(ValueError):
            make_plan(one, cost, c)
