"""Schedules: a loader setting as a function of the global step.

A schedule is a list of ``(step, value)`` points with strictly increasing steps: the value is
piecewise linear between points, the first value before the first point and constant after the
last. A plain number is a schedule of one point. Three settings take one:

* ``max_seq_len`` (sequence-length warm-up) and ``global_batch_tokens`` (batch-size ramp-up):
  :class:`Schedule` with ``integer=True``; a step between points gets the nearest integer
  (halves round up), computed in exact integer arithmetic so every process agrees;
* mixture weights: :class:`WeightSchedule`, one weight per source at every point, normalized to
  shares at each step (``weights=[(0, {"web": 0.6, "code": 0.4}), (1000, {...})]``, or per source
  ``{"web": [(0, 0.6), (1000, 0.2)], "code": 0.4}``).

On the command line a schedule is ``VALUE@STEP,VALUE@STEP,...`` (``--max-seq-len 512@0,4096@20``),
in a recipe a list of ``[step, value]`` pairs. Every mistake is one ``ValueError`` naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from balanced_loader.strict import check_number


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A number per global step: piecewise linear between ``points``, constant outside them."""

    name: str  # the setting, for messages
    points: tuple[tuple[int, float], ...]  # (step, value), steps strictly increasing
    integer: bool = True

    def at(self, step: int) -> Any:
        """The value at global ``step``."""
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
            if step < s1:
                if self.integer:  # nearest integer, exactly: (v0 (s1 - s) + v1 (s - s0)) / (s1 - s0)
                    span = s1 - s0
                    return (v0 * (s1 - step) + v1 * (step - s0) + span // 2) // span
                return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
        return pts[-1][1]

    @property
    def constant(self) -> bool:
        return len({v for _, v in self.points}) == 1

    @property
    def largest(self) -> Any:
        return max(v for _, v in self.points)

    def to_json(self) -> Any:
        """The plain value when constant, else ``[[step, value], ...]`` (what :func:`schedule` reads back)."""
        return self.points[0][1] if self.constant else [[s, v] for s, v in self.points]


def _points(value: Any, name: str) -> list[tuple[Any, Any]]:
    """``value`` as a list of ``(step, value)`` pairs with checked, strictly increasing steps."""
    if isinstance(value, Mapping):
        raise ValueError(f"{name}: a schedule is a list of (step, value) pairs, not a mapping")
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise ValueError(f"{name}: expected a number or a non-empty list of (step, value) pairs, got {value!r}")
    out: list[tuple[Any, Any]] = []
    for i, p in enumerate(value):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
            raise ValueError(f"{name}: schedule point {i} must be a (step, value) pair, got {p!r}")
        step = check_number(p[0], f"{name}: the step of schedule point {i}", integer=True, minimum=0)
        if out and step <= out[-1][0]:
            raise ValueError(f"{name}: schedule steps must increase; point {i} (step {step}) comes after "
                             f"step {out[-1][0]} (sort the points by step)")
        out.append((step, p[1]))
    return out


def schedule(value: Any, name: str, *, integer: bool = True, minimum: float = 1) -> Schedule:
    """A :class:`Schedule` from a number, a list of ``(step, value)`` pairs or a :class:`Schedule`."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [(0, value)]
    pts = [(s, check_number(v, f"{name} at step {s}", integer=integer, minimum=minimum))
           for s, v in _points(value, name)]
    return Schedule(name=name, points=tuple(pts), integer=integer)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSchedule:
    """Mixture weights per global step; :meth:`at` gives the shares (they sum to 1)."""

    names: tuple[str, ...]  # the sources, in name order
    points: tuple[tuple[int, tuple[float, ...]], ...]  # (step, [k] raw weights), steps strictly increasing

    def raw(self, step: int) -> tuple[float, ...]:
        """``[k]`` raw weights at ``step`` (each source's own linear interpolation)."""
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (s0, w0), (s1, w1) in zip(pts, pts[1:]):
            if step < s1:
                f = (step - s0) / (s1 - s0)
                return tuple(a + (b - a) * f for a, b in zip(w0, w1))
        return pts[-1][1]

    def at(self, step: int) -> tuple[float, ...]:
        """``[k]`` shares at ``step``: the raw weights over their sum."""
        w = self.raw(step)
        total = sum(w)
        return tuple(x / total for x in w)

    def active(self, step: int) -> tuple[bool, ...]:
        """``[k]`` whether each source has a positive weight at ``step`` or at any later step."""
        later = [w for s, w in self.points if s > step]
        return tuple(x > 0 or any(w[i] > 0 for w in later) for i, x in enumerate(self.raw(step)))

    @property
    def constant(self) -> bool:
        return len(self.points) == 1

    def to_json(self) -> Any:
        """``{name: weight}`` when constant, else ``[[step, {name: weight}], ...]``."""
        pts = [[s, dict(zip(self.names, w))] for s, w in self.points]
        return pts[0][1] if self.constant else pts


def weight_schedule(weights: Any, names: Sequence[str], *, default: Sequence[float] | None = None) -> WeightSchedule:
    """Weights for the sources ``names`` from what :func:`balanced_loader.mix` takes.

    ``weights``: ``{name: w}``; ``{name: w or [(step, w), ...]}`` (each source its own schedule);
    ``[(step, {name: w}), ...]``; or ``None`` for ``default`` (one weight per name). Every source
    needs a weight and every weight a source; weights are finite and >= 0, and at every point at
    least one is positive.
    """
    names = tuple(names)
    if weights is None:
        if default is None:
            raise ValueError("weights: give a weight for every source")
        weights = dict(zip(names, default))
    if isinstance(weights, WeightSchedule):
        if weights.names != names:
            raise ValueError(f"weights are for sources {list(weights.names)}, the mixture has {list(names)}")
        return weights
    if isinstance(weights, Mapping):
        _check_names(weights, names, "weights")
        per = {n: schedule(weights[n], f"weights: '{n}'", integer=False, minimum=0) for n in names}
        steps = sorted({s for sc in per.values() for s, _ in sc.points})
        pts = [(s, tuple(float(per[n].at(s)) for n in names)) for s in steps]
    else:
        pts = []
        for s, point in _points(weights, "weights"):
            if not isinstance(point, Mapping):
                raise ValueError(f"weights at step {s}: expected a mapping {{source: weight}}, got {point!r}")
            _check_names(point, names, f"weights at step {s}")
            pts.append((s, tuple(check_number(point[n], f"weights at step {s}: '{n}'", minimum=0)
                                 for n in names)))
    for s, w in pts:
        if not any(x > 0 for x in w):
            raise ValueError(f"weights at step {s} are all zero; at least one source needs a positive weight")
    return WeightSchedule(names=names, points=tuple((s, tuple(float(x) for x in w)) for s, w in pts))


def _check_names(d: Mapping[str, Any], names: Sequence[str], where: str) -> None:
    extra = [k for k in d if k not in names]
    if extra:
        raise ValueError(f"{where}: {extra[0]!r} is not a source of the mixture (sources: {', '.join(names)})")
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"{where}: no weight for source '{missing[0]}' (give every source a weight, 0 to leave "
                         f"it out)")


def parse_text(text: str, name: str, *, integer: bool = True) -> Any:
    """A command-line value: ``N`` or ``VALUE@STEP,VALUE@STEP,...`` as a number or a list of (step, value)."""
    def num(t: str, what: str) -> Any:
        try:
            v = float(t)
        except ValueError:
            raise ValueError(f"{name}: {what} {t!r} is not a number") from None
        return int(v) if integer and v == int(v) else v

    text = text.strip()
    if "@" not in text:
        return num(text, "value")
    pts = []
    for part in text.split(","):
        value, sep, step = part.partition("@")
        if not sep:
            raise ValueError(f"{name}: schedule point {part!r} is not VALUE@STEP (e.g. 512@0,4096@20)")
        pts.append((num(step, "step"), num(value, "value")))
    return pts


def setting(value: Any, name: str) -> Schedule:
    """A positive-integer loader setting (``global_batch_tokens``, ``max_seq_len``): an int or a schedule."""
    if isinstance(value, (list, tuple, Schedule)):
        return schedule(value, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (or a schedule [(step, value), ...]), got {value!r}")
    return schedule(value, name)
