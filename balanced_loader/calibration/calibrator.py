"""The closed loop: samples in, a cost model out every few steps, identical on every rank.

:class:`Calibrator` keeps a window of every rank's samples (the same on every rank: they are
all-gathered), and every ``every`` steps (the first time after ``first``) fits the contract-2
coefficients of each device class and shape (:mod:`.fit`, on contention-free compute times) and
the speed of each rank (:mod:`.speeds`, wall time against the fitted prediction). The result is a
:class:`~balanced_loader.cost.CostModel` with the fitted keys and ``lane_speed``; the loader plans
with it from the first step it has not planned yet (:meth:`BalancedLoader.set_cost`), so plans made
ahead keep the cost they were made with and every rank switches at the same step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from balanced_loader.calibration.fit import FitSettings, ShapeFit, fit_model, predict, rel_error
from balanced_loader.calibration.samples import MAX_STEP, Samples
from balanced_loader.calibration.speeds import SpeedTracker, raw_speeds
from balanced_loader.cost import CostModel
from balanced_loader.strict import check_keys, check_number

log = logging.getLogger("balanced_loader")
STATE_FORMAT = "balanced-loader/calibration"
HISTORY = 8  # fit reports kept in the state (the metrics log has all of them)


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationOptions:
    """The ``calibration:`` section of a recipe, or ``BalancedLoader(calibrate=...)``."""

    every: int = 4  # steps between fits
    first: int = 2  # steps observed before the first fit
    window: int = 16  # steps of samples a fit uses (older ones are forgotten)
    min_samples: int = 8  # rows a (class, shape) needs for a full fit (fewer: one rescaling)
    outlier_mad: float = 3.5  # residuals beyond this many median absolute deviations are dropped
    prior_weight: float = 0.01  # ridge towards the model in use (a share of each column's size)
    coefficients: bool = True  # fit the time keys (else only speeds)
    speeds: bool = True  # measure a speed per rank
    speed_smoothing: float = 0.5  # weight of the newest raw speed
    speed_hysteresis: float = 0.05  # the speed in use moves only beyond this relative change
    speed_quantum: float = 0.05  # speeds in use are multiples of this

    def __post_init__(self) -> None:
        for k, lo, hi in (("every", 1, 1 << 20), ("first", 1, 1 << 20), ("window", 1, 1 << 20),
                          ("min_samples", 1, 1 << 20)):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"'{k}' must be an integer in {lo}..{hi}, got {v!r}")
        for k, lo, hi in (("outlier_mad", 0.5, 1e3), ("prior_weight", 0.0, 1e3), ("speed_smoothing", 0.01, 1.0),
                          ("speed_hysteresis", 0.0, 10.0), ("speed_quantum", 1e-3, 1.0)):
            check_number(getattr(self, k), f"'{k}'", minimum=lo, maximum=hi)
        for k in ("coefficients", "speeds"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"'{k}' must be true or false, got {getattr(self, k)!r}")

    @staticmethod
    def of(value: Any) -> CalibrationOptions:
        """From ``True`` (defaults), a mapping of options, or options themselves."""
        if isinstance(value, CalibrationOptions):
            return value
        if value is True:
            return CalibrationOptions()
        if isinstance(value, dict):
            check_keys(value, [f.name for f in fields(CalibrationOptions)], "calibration", word="option")
            try:
                return CalibrationOptions(**value)
            except ValueError as e:
                raise ValueError(f"calibration: {e}") from None
        raise ValueError(f"calibrate must be True, a mapping of calibration options or CalibrationOptions, "
                         f"got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Update:
    """One fit: the new cost model and what it changed."""

    step: int  # the step after which it was fitted
    cost: CostModel
    shapes: dict[str, ShapeFit]  # "class:tpxpp" -> its fit
    error_before: float  # median per-rank-step |predicted - measured| / measured compute, model in use
    error_after: float  # the same with the fitted model
    speeds: list[float]  # [world_size] speeds in use after the fit
    speeds_changed: bool
    dropped: int = 0  # samples left out since the previous fit: implausible times or steps outside the window

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "error_before": round(self.error_before, 4),
                "error_after": round(self.error_after, 4), "speeds": [round(v, 4) for v in self.speeds],
                "speeds_changed": self.speeds_changed, "dropped_samples": self.dropped,
                "shapes": {k: v.to_json() for k, v in self.shapes.items()}}


def per_rank_step_error(s: Samples, predicted: np.ndarray) -> float:
    """Median over (rank, step) of ``|sum predicted - sum measured| / sum measured`` compute."""
    if not len(s):
        return 0.0
    key = s.step * (int(s.rank.max()) + 1) + s.rank  # one id per (step, rank)
    _, inv = np.unique(key, return_inverse=True)
    pred = np.bincount(inv, weights=predicted)
    meas = np.bincount(inv, weights=s.compute_ms)
    return float(np.median(rel_error(pred, meas)))


class Calibrator:
    """Online calibration of a cost model for a world of ``world_size`` ranks (module docstring)."""

    def __init__(self, prior: CostModel, world_size: int, options: CalibrationOptions | None = None) -> None:
        self.options = options or CalibrationOptions()
        self.world_size = world_size
        self.cost = prior
        self.class_of_rank = prior.rank_class_index(world_size)  # [world_size], checks the class map covers it
        o = self.options
        self.speeds = SpeedTracker(world_size, smoothing=o.speed_smoothing, hysteresis=o.speed_hysteresis,
                                   quantum=o.speed_quantum)
        self.speeds.in_use = prior.rank_speeds(world_size)
        self.window = Samples.empty()
        self.steps_seen = 0
        self.dropped = 0  # samples left out since the last fit (module samples: which samples count)
        self.history: list[dict[str, Any]] = []
        import scipy.optimize  # noqa: F401  (the fit's solver, loaded now rather than inside a timed step)

    @property
    def settings(self) -> FitSettings:
        o = self.options
        return FitSettings(min_samples=o.min_samples, outlier_mad=o.outlier_mad, prior_weight=o.prior_weight)

    def due(self) -> bool:
        o = self.options
        return self.steps_seen >= o.first and (self.steps_seen - o.first) % o.every == 0

    def observe(self, step: int, samples: Samples) -> Update | None:
        """Add one step's samples of every rank (the same on every rank); a fit when one is due.

        Samples with implausible times (:meth:`Samples.plausible`) or of a step outside the window
        ``(step - window, step]`` are left out and counted (``Update.dropped``)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < MAX_STEP:
            raise ValueError(f"observe(step, ...): step must be an integer in 0..2**53, got {step!r}")
        step = int(step)
        if len(samples) and (int(samples.rank.min()) < 0 or int(samples.rank.max()) >= self.world_size):
            bad_rank = int(samples.rank.max()) if int(samples.rank.max()) >= self.world_size else \
                int(samples.rank.min())
            raise ValueError(f"calibration samples name rank {bad_rank} but the world has "
                             f"{self.world_size} ranks")
        lo = step - self.options.window
        keep = samples.plausible() & (samples.step > lo) & (samples.step <= step)
        self.dropped += int(len(samples) - keep.sum())
        self.window = Samples.concat([self.window, samples.select(keep)])
        self.window = self.window.select((self.window.step > lo) & (self.window.step <= step))  # forget old samples
        self.steps_seen += 1
        if not self.due() or not len(self.window):
            return None
        return self._fit(step)

    def _models(self) -> list[tuple[str, CostModel]]:
        return list(self.cost.device_classes) or [("", self.cost.device())]

    def _fit(self, step: int) -> Update:
        s = self.window
        rank_cls = self.class_of_rank[s.rank]  # [n] class of each sample's rank
        before = np.zeros(len(s))
        after = np.zeros(len(s))
        models, shapes = [], {}
        for c, (name, model) in enumerate(self._models()):
            m = rank_cls == c
            sub = s.select(m)
            before[m] = predict(model, sub)
            new, rep = fit_model(model, sub, self.settings) if self.options.coefficients else (model, {})
            after[m] = predict(new, sub)
            models.append((name, new))
            shapes.update({f"{name or 'all'}:{k}": v for k, v in rep.items()})
        changed = False
        if self.options.speeds:
            # raw speeds from the steps since the previous fit (the window still feeds the coefficients)
            last = int(self.history[-1]["step"]) if self.history else -(1 << 62)
            recent = s.step > last
            changed = self.speeds.update(raw_speeds(s.select(recent), after[recent], self.world_size))
        cost = self.cost.replace(device_classes=tuple(models)) if self.cost.device_classes else \
            models[0][1].replace(device_classes=(), rank_classes=(), lane_speed=())
        cost = cost.replace(rank_classes=self.cost.rank_classes).with_speeds(self.speeds.in_use)
        if not self.cost.device_classes:
            cost = cost.replace(name=self.cost.name)
        up = Update(step=step, cost=cost, shapes=shapes, error_before=per_rank_step_error(s, before),
                    error_after=per_rank_step_error(s, after), speeds=self.speeds.in_use.tolist(),
                    speeds_changed=changed, dropped=self.dropped)
        self.dropped = 0
        self.cost = cost
        self.history = [*self.history, up.to_json()][-HISTORY:]
        log.info("calibration after step %d: error %.3f -> %.3f, speeds %s", step, up.error_before,
                 up.error_after, [round(v, 2) for v in up.speeds])
        return up

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "version": 1, "world_size": self.world_size,
                "options": asdict(self.options), "cost": self.cost.to_dict(), "steps_seen": self.steps_seen,
                "window": self.window.to_json(), "speeds": self.speeds.state_dict(), "history": self.history,
                "dropped": self.dropped}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Resume exactly (same world size), or at another world size keeping the fitted coefficients
        (speeds and samples are per rank, so they start afresh).

        Every field is checked before anything changes (one ValueError line naming the field): the format,
        the world size, the options, a cost model that parses with lane speeds and a class map for this
        world, a step count, the window's rows (ranks of the world, finite non-negative times, integer
        columns), the speeds and the fit history."""
        where = "calibration state"
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT or d.get("version") != 1:
            raise ValueError(f"not a calibration state: expected \"format\": \"{STATE_FORMAT}\", version 1")
        missing = [k for k in ("world_size", "cost", "steps_seen", "window", "speeds") if k not in d]
        if missing:
            raise ValueError(f"{where}: missing '{missing[0]}'; pass a dict from Calibrator.state_dict()")
        saved_world = _count(d["world_size"], f"{where}: world_size", 1, 1 << 20)
        steps_seen = _count(d["steps_seen"], f"{where}: steps_seen", 0, MAX_STEP)
        dropped = _count(d.get("dropped", 0), f"{where}: dropped", 0, MAX_STEP)
        if not isinstance(d.get("options", {}), dict):
            raise ValueError(f"{where}: options must be a mapping, got {type(d['options']).__name__}")
        CalibrationOptions.of(d.get("options") or True)  # well formed (this run's own options apply)
        if not isinstance(d["cost"], dict):
            raise ValueError(f"{where}: cost must be a cost-model mapping, got {type(d['cost']).__name__}")
        try:
            cost = CostModel.from_dict(d["cost"], where=f"{where}: cost")
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{where}: cost is malformed ({type(e).__name__}: {e})") from None
        history = _history(d.get("history", []), where)
        same = saved_world == self.world_size
        if same:
            try:
                cost.rank_speeds(self.world_size)
                cost.rank_class_index(self.world_size)
            except ValueError as e:
                raise ValueError(f"{where}: cost: {e}") from None
            window = Samples.from_json(d["window"], f"{where}: window", world_size=self.world_size)
            for tp, pp in sorted({(int(a), int(b)) for a, b in zip(window.tp.tolist(), window.pp.tolist())}):
                for _, model in cost.device_classes or (("", cost),):
                    try:
                        model.shape(tp, pp)
                    except ValueError as e:
                        raise ValueError(f"{where}: window: {e}") from None
            keep = window.plausible()  # a state saved before the rule (module samples): its rows the rule drops
            dropped += int((~keep).sum())
            window = window.select(keep)
            speeds = self.speeds.parse_state(d["speeds"])
        else:
            cost = for_world(cost, self.cost, where)
        # everything checked: apply
        self.cost, self.steps_seen, self.history, self.dropped = cost, steps_seen, history, dropped
        if same:
            self.window = window
            self.speeds.smoothed, self.speeds.in_use = speeds
        else:
            log.warning("calibration state saved at world size %s, resumed at %d: speeds and samples start "
                        "afresh, fitted coefficients kept", saved_world, self.world_size)
            self.window = Samples.empty()
            self.speeds.smoothed = np.full(self.world_size, np.nan)
            self.speeds.in_use = self.cost.rank_speeds(self.world_size)


def _count(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{what} must be an integer in {lo}..{hi:,}, got {str(v)[:40]}")
    return int(v)


def _history(h: Any, where: str) -> list[dict[str, Any]]:
    """The fit reports of a state: a list of mappings, each with the integer step it was fitted after."""
    if not isinstance(h, list):
        raise ValueError(f"{where}: history must be a list of fit reports, got {type(h).__name__}")
    for i, e in enumerate(h):
        if not isinstance(e, dict):
            raise ValueError(f"{where}: history[{i}] must be a mapping, got {type(e).__name__}")
        _count(e.get("step"), f"{where}: history[{i}].step", 0, MAX_STEP)
    return list(h)[-HISTORY:]


def for_world(saved: CostModel, own: CostModel, where: str) -> CostModel:
    """A cost model saved at another world size, for this one: its fitted coefficients with ``own``'s per-rank
    keys (lane speeds, and the rank-to-class map when both name the same device classes)."""
    if saved.class_names != own.class_names:
        raise ValueError(f"{where}: the saved cost model has device classes {list(saved.class_names)}, this loader's "
                         f"{list(own.class_names)}; at another world size pass a cost file with the same classes")
    return saved.replace(lane_speed=own.lane_speed, rank_classes=own.rank_classes)
