"""Per-rank speed factors, measured online: the ratio of predicted compute to the wall time it took.

A rank whose microbatches take twice the wall time the (contention-free) model predicts runs at
speed 0.5: a throttled GPU, a noisy neighbour, a CPU core shared with another process. Each fit,
a rank's raw speed is ``sum predicted / sum wall`` over its samples in the window (its one-lane
groups when it has a few: a CP group's wall time includes waiting for its slowest member).

Speeds are relative: the fastest rank is 1 (the fitted coefficients carry the common level, and
only the ratios between ranks change a plan). Raw speeds come from the samples since the previous
fit, so a rank that recovers from a slow spell is seen as recovered within a few fits.

Why smoothing, hysteresis and a grid: plans change when speeds change, and noise must not make
them oscillate. The raw value is smoothed (``smoothed = a raw + (1 - a) smoothed``) and divided by
the fastest rank's; the speed in use moves only when that is more than ``hysteresis`` away from
it, and then to 1 when it is within ``hysteresis`` of the fastest (ranks that are alike plan as
exactly alike), else to the nearest multiple of ``quantum`` (the planners' speed groups stay few).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balanced_loader.calibration.samples import Samples

MIN_ONE_LANE = 3  # one-lane samples a rank needs before its speed uses only those


def raw_speeds(s: Samples, predicted: np.ndarray, world_size: int) -> np.ndarray:
    """``[world_size]`` each rank's ``sum predicted / sum wall`` (nan for a rank without samples)."""
    out = np.full(world_size, np.nan)
    for r in np.unique(s.rank).tolist():
        m = s.rank == r
        one = m & (s.degree == 1)
        if int(one.sum()) >= MIN_ONE_LANE:
            m = one
        wall = float(s.wall_ms[m].sum())
        if 0 <= r < world_size and wall > 0:
            out[r] = float(predicted[m].sum()) / wall
    return out


class SpeedTracker:
    """The speeds in use, smoothed with hysteresis (module docstring)."""

    def __init__(self, world_size: int, *, smoothing: float, hysteresis: float, quantum: float) -> None:
        self.world_size = world_size
        self.smoothing, self.hysteresis, self.quantum = smoothing, hysteresis, quantum
        self.smoothed = np.full(world_size, np.nan)  # [world_size]
        self.in_use = np.ones(world_size)  # [world_size]

    def update(self, raw: np.ndarray) -> bool:
        """Fold in one fit's raw speeds (nan: no data for that rank); True when a speed in use changed."""
        seen = np.isfinite(raw) & (raw > 0)
        first = seen & ~np.isfinite(self.smoothed)
        self.smoothed[first] = raw[first]
        again = seen & ~first
        self.smoothed[again] = self.smoothing * raw[again] + (1 - self.smoothing) * self.smoothed[again]
        known = np.isfinite(self.smoothed)
        if not known.any():
            return False
        rel = np.where(known, self.smoothed / np.max(self.smoothed[known]), 1.0)  # [world_size] fastest = 1
        moved = seen & (np.abs(rel / self.in_use - 1.0) > self.hysteresis)
        if not moved.any():
            return False
        grid = np.round(np.maximum(np.round(rel[moved] / self.quantum) * self.quantum, self.quantum), 6)
        grid = np.where(rel[moved] >= 1.0 - self.hysteresis, 1.0, grid)  # alike the fastest: exactly alike
        changed = bool(np.any(grid != self.in_use[moved]))
        self.in_use[moved] = grid
        return changed

    def state_dict(self) -> dict[str, Any]:
        return {"smoothed": [None if not np.isfinite(x) else float(x) for x in self.smoothed],
                "in_use": self.in_use.tolist()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.smoothed, self.in_use = self.parse_state(d)

    def parse_state(self, d: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(smoothed, in_use)`` of a :meth:`state_dict`, checked (one ValueError line): one entry per rank,
        positive finite numbers (``smoothed`` may hold None for a rank not measured yet)."""
        where = "calibration state: speeds"
        sm, use = (d.get("smoothed"), d.get("in_use")) if isinstance(d, dict) else (None, None)
        if not isinstance(sm, list) or not isinstance(use, list) or len(sm) != self.world_size \
                or len(use) != self.world_size:
            raise ValueError(f"{where}: 'smoothed' and 'in_use', speeds for {self.world_size} ranks expected")

        def speed(x: Any, what: str, none: bool) -> float:
            if x is None and none:
                return float("nan")
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 < x < float("inf")):
                raise ValueError(f"{where}: {what} must be a positive number, got {str(x)[:40]}")
            return float(x)

        return (np.asarray([speed(x, f"smoothed[{r}]", True) for r, x in enumerate(sm)], dtype=np.float64),
                np.asarray([speed(x, f"in_use[{r}]", False) for r, x in enumerate(use)], dtype=np.float64))
