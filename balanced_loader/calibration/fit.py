"""Fit contract-2 coefficients to measured samples: robust non-negative least squares per class and shape.

For the samples of one device class and one shape ``(tp, pp)`` (one stage's share of a group each):

    compute_ms ~ beta x0 + q x1 + l x2 + B x3,   x0 = 1/pp, x1 = sum s^2 / (d pp),
                                                 x2 = sum s / (d pp), x3 = [d > 1] sum s / (d pp bw(d) 1e6)

``beta, q, l, B >= 0`` (``scipy.optimize.nnls``). Why the extras around a plain solve:

* rows are weighted by ``1 / sqrt(compute_ms)``: between absolute errors (long microbatches decide a
  step) and relative ones (short ones are most of the samples);
* a small ridge pulls every coefficient towards the prior (the cost model in use), scaled by its
  column's size: a column without signal (``B`` when every group ran on one lane; ``q`` when all
  docs have one length) keeps the prior's value instead of drifting;
* outliers (a page fault storm, a preempted microbatch) are dropped: residuals beyond
  ``outlier_mad`` median absolute deviations, at most a fifth of the rows, then the fit is redone;
* a shape with fewer than ``min_samples`` rows is only rescaled (the median ratio of measured to
  predicted, one number that is always identifiable); shapes without samples take the class's
  median rescaling. Bandwidth tables and memory caps are kept as they are.

Two settings serve a fit of chosen cases instead of a training window (the cost-file profiler,
:mod:`parallel_runtime.diagnostics.profile`): ``robust=False`` is plain NNLS on milliseconds (rows
unweighted, no ridge, no outlier drop, the prior kept as it is, not rescaled), and ``free`` names the
coefficients the fit may change; the others keep the prior's values (their part of each measured time is
taken off before the solve).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from balanced_loader.calibration.samples import Samples
from balanced_loader.cost import CostModel, ShapeCost

MAX_DROPPED = 0.2  # at most this share of a fit's rows are dropped as outliers
COEFFICIENTS = ("microbatch_ms", "quadratic_ms", "linear_ms", "comm_bytes_per_token")  # beta, q, l, B: features order


@dataclass(frozen=True, kw_only=True, slots=True)
class FitSettings:
    min_samples: int = 8  # below: the prior only rescaled
    outlier_mad: float = 3.5  # robust only
    prior_weight: float = 0.01  # robust only
    robust: bool = True  # False: plain NNLS on milliseconds (module docstring)
    free: tuple[str, ...] = COEFFICIENTS  # the coefficients fitted; the others keep the prior's values

    def __post_init__(self) -> None:
        bad = [c for c in self.free if c not in COEFFICIENTS]
        if bad or not self.free:
            raise ValueError(f"FitSettings.free: {list(self.free)} must name some of {list(COEFFICIENTS)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeFit:
    """One (class, shape)'s fit, for the metrics."""

    samples: int
    dropped: int
    kind: str  # "fit" (all coefficients), "scale" (rescaled), "kept" (no samples, class rescaling)
    ratio: float  # median measured / predicted with the prior, over its samples
    error_before: float  # median |predicted - measured| / measured with the prior
    error_after: float  # the same with the fit

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "dropped": self.dropped, "kind": self.kind,
                "ratio": round(self.ratio, 4), "error_before": round(self.error_before, 4),
                "error_after": round(self.error_after, 4)}


def features(sc: ShapeCost, s: Samples) -> np.ndarray:
    """``[n, 4]`` the contract-2 feature columns of samples of shape ``sc`` (module docstring)."""
    d = s.degree.astype(np.float64)
    pp = s.pp.astype(np.float64)
    bw = sc.bandwidths(d) * 1e6  # [n] bytes per ms
    comm = np.where(d > 1, s.tokens / (d * bw), 0.0)
    return np.stack([1.0 / pp, s.sumsq / (d * pp), s.tokens / (d * pp), comm / pp], axis=1)


def coefficients(sc: ShapeCost) -> np.ndarray:
    """``[4]`` (beta, q, l, B) of a shape, in :func:`features` order."""
    return np.array([sc.microbatch_ms, sc.quadratic_ms, sc.linear_ms, sc.comm_bytes_per_token])


def predict(model: CostModel, s: Samples) -> np.ndarray:
    """``[n]`` contract-2 compute ms of every sample under a uniform model (no lane speeds)."""
    out = np.zeros(len(s), dtype=np.float64)
    shapes = {(int(a), int(b)) for a, b in zip(s.tp.tolist(), s.pp.tolist())}
    for tp, pp in shapes:
        m = (s.tp == tp) & (s.pp == pp)
        sc = model.shape(tp, pp)
        out[m] = features(sc, s.select(m)) @ coefficients(sc)
    return out


def rel_error(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    """``|pred - meas| / meas`` (0 where nothing was measured)."""
    return np.abs(pred - meas) / np.maximum(meas, 1e-9)


def _solve(a: np.ndarray, y: np.ndarray, x0: np.ndarray, settings: FitSettings) -> np.ndarray:
    """``[4]`` the NNLS of the ``free`` columns of ``a`` (``[n, 4]``) to ``y`` (``[n]``); the others stay at ``x0``."""
    from scipy.optimize import nnls  # scipy: loaded when a fit runs

    free = np.array([c in settings.free for c in COEFFICIENTS])  # [4]
    rest = y - a[:, ~free] @ x0[~free]  # [n] what the fixed coefficients leave to the free ones
    a = a[:, free]  # [n, f]
    # robust: between absolute and relative errors (module docstring); plain: absolute errors (ms)
    w = 1.0 / np.sqrt(np.maximum(y, 1e-6)) if settings.robust else np.ones_like(y)  # [n] row weights
    aw, yw = a * w[:, None], rest * w
    col = np.sqrt((aw * aw).sum(axis=0))  # [f] each column's size
    scale = np.where(col > 0, col, 1.0)
    # ridge rows sqrt(lambda) * col_j * (x_j - x0_j): in units of the column, so one weight fits all columns
    ridge = np.sqrt(settings.prior_weight if settings.robust else 0.0) * np.diag(col)
    lhs = np.vstack([aw, ridge]) / scale  # columns scaled to one: nnls converges on columns of any size
    rhs = np.concatenate([yw, ridge @ x0[free]])
    x, _ = nnls(lhs, rhs, maxiter=50 * lhs.shape[1])
    # a column of zeros (no sample exercises it: B when every group ran on one lane) has no ridge row
    # either, and nnls leaves its coefficient at 0: it keeps the prior instead
    out = x0.copy()
    out[free] = np.where(col > 0, x / scale, x0[free])
    return out


def fit_shape(sc: ShapeCost, s: Samples, settings: FitSettings) -> tuple[ShapeCost, ShapeFit]:
    """The fitted coefficients of one shape from its samples (module docstring)."""
    a = features(sc, s)  # [n, 4]
    y = s.compute_ms
    x0 = coefficients(sc)
    before = a @ x0
    ratio = float(np.median(y / np.maximum(before, 1e-9))) if len(y) else 1.0
    err0 = float(np.median(rel_error(before, y))) if len(y) else 0.0
    prior = x0.copy()  # the free coefficients' prior rescaled to the level seen (the fixed ones keep theirs)
    prior[[c in settings.free for c in COEFFICIENTS]] *= ratio
    if len(y) < settings.min_samples:
        x = prior
        return _with(sc, x), ShapeFit(samples=len(y), dropped=0, kind="scale", ratio=ratio, error_before=err0,
                                      error_after=float(np.median(rel_error(a @ x, y))) if len(y) else 0.0)
    if not settings.robust:  # plain NNLS: every row, the prior as it is
        x = _solve(a, y, x0, settings)
        return _with(sc, x), ShapeFit(samples=len(y), dropped=0, kind="fit", ratio=ratio, error_before=err0,
                                      error_after=float(np.median(rel_error(a @ x, y))))
    x = _solve(a, y, prior, settings)  # the ridge pulls to the rescaled prior
    r = (y - a @ x) / np.maximum(y, 1e-9)  # [n] relative residuals
    mad = float(np.median(np.abs(r - np.median(r)))) * 1.4826
    keep = np.abs(r - np.median(r)) <= settings.outlier_mad * max(mad, 1e-3)
    if not keep.all() and (~keep).sum() <= MAX_DROPPED * len(y):
        x = _solve(a[keep], y[keep], prior, settings)
    else:
        keep = np.ones(len(y), dtype=bool)
    return _with(sc, x), ShapeFit(samples=len(y), dropped=int((~keep).sum()), kind="fit", ratio=ratio,
                                  error_before=err0, error_after=float(np.median(rel_error(a @ x, y))))


def _with(sc: ShapeCost, x: np.ndarray) -> ShapeCost:
    beta, q, lin, comm = (float(v) for v in x)
    return replace(sc, microbatch_ms=beta, quadratic_ms=q, linear_ms=lin, comm_bytes_per_token=comm)


def fit_model(model: CostModel, s: Samples, settings: FitSettings) -> tuple[CostModel, dict[str, ShapeFit]]:
    """A uniform model (one device class) refitted to its samples; shapes without samples are rescaled
    by the median ratio of the fitted ones. Returns the model and each shape's :class:`ShapeFit`."""
    fitted: dict[tuple[int, int], ShapeCost] = {}
    report: dict[str, ShapeFit] = {}
    for tp, pp in sorted({(int(a), int(b)) for a, b in zip(s.tp.tolist(), s.pp.tolist())}):
        m = (s.tp == tp) & (s.pp == pp)
        sc, rep = fit_shape(model.shape(tp, pp), s.select(m), settings)
        fitted[(tp, pp)] = sc
        report[f"{tp}x{pp}"] = rep
    if not fitted:
        return model, report
    ratios = [float(coefficients(fitted[k]) @ [1, 1024**2, 1024, 0]) / max(float(coefficients(model.shape(*k))
              @ [1, 1024**2, 1024, 0]), 1e-12) for k in fitted]  # each shape's change on a 1,024-token group
    rest = float(np.median(ratios))
    shapes = {}
    for sc in model.shapes(usable_only=False):
        key = (sc.tp, sc.pp)
        shapes[key] = fitted.get(key) or _with(sc, coefficients(sc) * np.array([rest, rest, rest, rest]))
    base = shapes.pop((1, 1))
    out = model.replace(strategies=tuple(shapes[(sc.tp, sc.pp)] for sc in model.strategies),
                        **{k: getattr(base, k) for k in ("quadratic_ms", "linear_ms", "microbatch_ms",
                                                         "comm_bytes_per_token")})
    return out, report
