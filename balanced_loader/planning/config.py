"""What a policy needs besides the batch and the cost model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from balanced_loader.planning.registry import POLICIES


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What a policy needs besides the batch and the cost model."""

    policy: str = "hydra"
    world_size: int
    tp: int | None = None  # static shape for maxlen / static-sp (None: policy default)
    pp: int | None = None
    cp: int | None = None  # fixed CP degree (maxlen, static-sp, token-kk), else the largest; 1: plain DP
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
