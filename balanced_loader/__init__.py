"""balanced-loader: plan the data and the parallelism of every global batch together.

Public names are imported lazily so that ``balanced-loader --help`` starts fast
(numba and torch are only imported by the parts that need them).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "StepPlan": "balanced_loader.plan",
    "Plan": "balanced_loader.plan",
    "Pool": "balanced_loader.plan",
    "Group": "balanced_loader.plan",
    "CostModel": "balanced_loader.cost",
    "ShapeCost": "balanced_loader.cost",
    "cost_preset": "balanced_loader.presets",
    "analytic_cost": "balanced_loader.presets",
    "PlanConfig": "balanced_loader.planning",
    "BatchItems": "balanced_loader.planning",
    "make_plan": "balanced_loader.planning",
    "open_source": "balanced_loader.data.open",
    "mix": "balanced_loader.data.mixture",
    "MixtureSource": "balanced_loader.data.mixture",
    "BalancedLoader": "balanced_loader.loader",
    "StepBatch": "balanced_loader.loader",
    "Microbatch": "balanced_loader.materialize",
    "wrap": "balanced_loader.wrapping",
    "pack": "balanced_loader.planning.packing",
    "cp_positions": "balanced_loader.materialize",
    "MicrobatchTimer": "balanced_loader.calibration",
    "CalibrationOptions": "balanced_loader.calibration",
    "Calibrator": "balanced_loader.calibration",
    "Samples": "balanced_loader.calibration",
    "balance": "balanced_loader.planning.rl",
    "balance_batch": "balanced_loader.planning.rl",
    "MegatronSource": "balanced_loader.data.megatron",
    "DatatroveSource": "balanced_loader.data.datatrove",
    "HydraCPScheduler": "balanced_loader.integrations.megatron",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'balanced_loader' has no attribute '{name}'")
