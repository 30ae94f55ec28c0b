"""Contract 2: the cost model (time and memory of a group), read from a YAML cost file.

Times are whole-model forward+backward on one lane, in milliseconds::

    group_ms = microbatch_ms + sum_s ((q*s^2 + l*s) / d + [d > 1] * comm_bytes_per_token*s / d / (bw(d)*1e6))

This module holds the formula (per segment and per group) and the degree helpers; the
execution order (lane schedule, pool and step times) lives in :mod:`balanced_loader.simulate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from balanced_loader.strict import check_keys, number, read_yaml

_BASE_KEYS = ("quadratic_ms", "linear_ms", "microbatch_ms", "comm_bytes_per_token", "max_tokens_per_lane")
_OPTIONAL_KEYS = ("gpus_per_node", "strategies", "name", "bandwidth_gbs")
_STRATEGY_KEYS = {"tp", "pp", *_BASE_KEYS, "bandwidth_gbs"}


# sane upper bounds of the cost keys: far above any real device, low enough that sums of times stay exact
_MAXIMA = {"quadratic_ms": 1e6, "linear_ms": 1e9, "microbatch_ms": 1e9, "comm_bytes_per_token": 1e15,
           "max_tokens_per_lane": 1 << 40}


def _base_value(d: dict[str, Any], key: str, where: str) -> float | int:
    """A contract-2 number: finite, >= 0, at most :data:`_MAXIMA` (one line naming the key otherwise)."""
    return number(d, key, where, integer=(key == "max_tokens_per_lane"), minimum=0, maximum=_MAXIMA[key])


def _bandwidth(d: Any, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(d, dict) or not d:
        raise ValueError(f"{where}: 'bandwidth_gbs' must be a non-empty mapping degree -> GB/s")
    out = []
    for k, v in d.items():
        try:
            deg = int(k)
            bw = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: bandwidth_gbs entry {k!r}: {v!r} is not degree: GB/s") from None
        if not 2 <= deg <= 1 << 20 or not 0 < bw <= 1e9:  # nan and inf fail too
            raise ValueError(f"{where}: bandwidth_gbs entry {k}: {v} needs a degree in 2..{1 << 20} and "
                             f"0 < GB/s <= 1e9")
        out.append((deg, bw))
    return tuple(sorted(out))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeCost:
    """Coefficients of one ``(tp, pp)`` shape (whole-model fwd+bwd on one lane)."""

    tp: int = 1
    pp: int = 1
    quadratic_ms: float
    linear_ms: float
    microbatch_ms: float
    comm_bytes_per_token: float
    bandwidth_gbs: tuple[tuple[int, float], ...]  # [(min degree, GB/s per device)], sorted
    max_tokens_per_lane: int

    @property
    def usable(self) -> bool:
        return self.max_tokens_per_lane > 0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def bandwidth(self, d: int) -> float:
        """GB/s per device for a group of ``d`` lanes: the largest key <= d (the smallest key below it)."""
        bw = self.bandwidth_gbs[0][1]
        for deg, v in self.bandwidth_gbs:
            if deg <= d:
                bw = v
            else:
                break
        return bw

    def bandwidths(self, d: np.ndarray) -> np.ndarray:
        """:meth:`bandwidth` of every degree in ``d`` (``[S]`` -> ``[S]`` GB/s)."""
        keys = np.asarray([k for k, _ in self.bandwidth_gbs], dtype=np.float64)
        vals = np.asarray([v for _, v in self.bandwidth_gbs], dtype=np.float64)
        # searchsorted(side="right") - 1 is the largest key <= d; degrees below every key take the first
        return vals[np.maximum(np.searchsorted(keys, d, side="right") - 1, 0)]

    def compute_ms(self, s: float | np.ndarray) -> float | np.ndarray:
        """Work of a segment of ``s`` tokens on one lane: ``q*s^2 + l*s``."""
        return self.quadratic_ms * s * s + self.linear_ms * s

    def comm_ms(self, s: float | np.ndarray, d: int | np.ndarray) -> float | np.ndarray:
        """Per-lane CP/SP communication of a segment spread over ``d`` lanes (0 for d == 1).

        ``d`` is one degree or an array broadcasting with ``s`` (one per segment, or ``[n, 1]`` x ``[levels]``)."""
        if np.ndim(d) == 0:
            if d <= 1:
                return 0.0 * s
            return self.comm_bytes_per_token * s / d / (self.bandwidth(d) * 1e6)
        s, d = np.broadcast_arrays(np.asarray(s, dtype=np.float64), np.asarray(d, dtype=np.float64))
        out = np.zeros(d.shape, dtype=np.float64)  # [S] (or any shape s and d broadcast to)
        multi = d > 1  # one-lane groups send nothing
        if multi.any():
            out[multi] = self.comm_bytes_per_token * s[multi] / d[multi] / (self.bandwidths(d[multi]) * 1e6)
        return out

    def segment_ms(self, s: float | np.ndarray, d: int | np.ndarray) -> float | np.ndarray:
        """Time a segment adds to a group of ``d`` lanes (``d`` one degree or one per segment)."""
        return self.compute_ms(s) / d + self.comm_ms(s, d)

    def group_ms(self, lengths: Iterable[int] | np.ndarray, d: int) -> float:
        """Contract-2 time of one group: segments of ``lengths`` tokens on ``d`` lanes (the formula;
        many groups at once: :meth:`balanced_loader.simulate.PoolArrays.group_ms`)."""
        arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.float64)
        return float(self.microbatch_ms + np.sum(self.segment_ms(arr, d)))

    def fits(self, tokens: int, d: int) -> bool:
        return tokens <= self.max_tokens_per_lane * d


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """The cost file: base coefficients (tp = pp = 1) plus optional per-shape overrides."""

    quadratic_ms: float
    linear_ms: float
    microbatch_ms: float
    comm_bytes_per_token: float
    bandwidth_gbs: tuple[tuple[int, float], ...]
    max_tokens_per_lane: int
    gpus_per_node: int = 8
    strategies: tuple[ShapeCost, ...] = ()
    name: str = ""
    _shapes: dict[tuple[int, int], ShapeCost] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        base = ShapeCost(tp=1, pp=1, **{k: getattr(self, k) for k in (*_BASE_KEYS, "bandwidth_gbs")})
        table = {(1, 1): base}
        for s in self.strategies:
            table[(s.tp, s.pp)] = s
        self._shapes.clear()
        self._shapes.update(table)

    # ---- reading and writing -------------------------------------------
    @staticmethod
    def from_dict(d: dict[str, Any], where: str = "cost file") -> CostModel:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of cost keys")
        check_keys(d, (*_BASE_KEYS, *_OPTIONAL_KEYS), where)
        if "bandwidth_gbs" not in d:
            raise ValueError(f"{where}: missing key 'bandwidth_gbs'")
        base = {k: _base_value(d, k, where) for k in _BASE_KEYS}
        base["bandwidth_gbs"] = _bandwidth(d["bandwidth_gbs"], where)
        gpn = number(d, "gpus_per_node", where, integer=True, minimum=1, maximum=1 << 20, default=8)
        strategies = []
        raw = d.get("strategies") or []
        if not isinstance(raw, list):
            raise ValueError(f"{where}: 'strategies' must be a list of {{tp, pp, ...}} entries")
        for i, s in enumerate(raw):
            sw = f"{where}: strategies[{i}]"
            if not isinstance(s, dict):
                raise ValueError(f"{sw}: expected a mapping")
            check_keys(s, _STRATEGY_KEYS, sw)
            tp = number(s, "tp", sw, integer=True, minimum=1, maximum=1 << 20)
            pp = number(s, "pp", sw, integer=True, minimum=1, maximum=1 << 20)
            merged = dict(base)
            for k in _BASE_KEYS:
                if k in s:
                    merged[k] = _base_value(s, k, sw)
            if "bandwidth_gbs" in s:
                merged["bandwidth_gbs"] = _bandwidth(s["bandwidth_gbs"], sw)
            if any(x.tp == tp and x.pp == pp for x in strategies):
                raise ValueError(f"{sw}: shape tp={tp}, pp={pp} is listed twice")
            strategies.append(ShapeCost(tp=tp, pp=pp, **merged))
        return CostModel(**base, gpus_per_node=gpn, strategies=tuple(strategies), name=str(d.get("name", "")))

    @staticmethod
    def from_file(path: str) -> CostModel:
        data = read_yaml(path, "cost file", mapping=True)
        return CostModel.from_dict(data, where=f"cost file {path}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.name:
            d["name"] = self.name
        for k in _BASE_KEYS:
            d[k] = getattr(self, k)
        d["bandwidth_gbs"] = {deg: bw for deg, bw in self.bandwidth_gbs}
        d["gpus_per_node"] = self.gpus_per_node
        if self.strategies:
            base = self.shape(1, 1)
            out = []
            for s in self.strategies:
                e: dict[str, Any] = {"tp": s.tp, "pp": s.pp}
                for k in _BASE_KEYS:
                    if getattr(s, k) != getattr(base, k):
                        e[k] = getattr(s, k)
                if s.bandwidth_gbs != base.bandwidth_gbs:
                    e["bandwidth_gbs"] = {deg: bw for deg, bw in s.bandwidth_gbs}
                out.append(e)
            d["strategies"] = out
        return d

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_yaml())

    def replace(self, **changes: Any) -> CostModel:
        """A copy with base keys changed (strategies keep their own overrides)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_shapes"}
        kw.update(changes)
        return CostModel(**kw)

    def with_base(self, **changes: Any) -> CostModel:
        """A copy with keys changed for every shape (strategies too)."""
        strategies = tuple(replace(s, **changes) for s in self.strategies)
        return self.replace(strategies=strategies, **changes)

    # ---- shapes ----------------------------------------------------------
    def shape(self, tp: int = 1, pp: int = 1) -> ShapeCost:
        try:
            return self._shapes[(tp, pp)]
        except KeyError:
            listed = ", ".join(f"tp={a} pp={b}" for a, b in sorted(self._shapes))
            raise ValueError(f"shape tp={tp}, pp={pp} is not in the cost file (listed: {listed}); "
                             f"add it under 'strategies'") from None

    def shapes(self, usable_only: bool = True) -> list[ShapeCost]:
        """Shapes in the file, sorted by (tp*pp, tp)."""
        out = [s for s in self._shapes.values() if s.usable or not usable_only]
        return sorted(out, key=lambda s: (s.gpus, s.tp, s.pp))

    @property
    def base(self) -> ShapeCost:
        return self._shapes[(1, 1)]

    def lane_cap(self, tp: int = 1, pp: int = 1) -> int:
        """``max_tokens_per_lane`` of a shape (0: unusable); what :meth:`StepPlan.validate` asks for."""
        return self.shape(tp, pp).max_tokens_per_lane

    def group_ms(self, lengths: Iterable[int] | np.ndarray, d: int, tp: int = 1, pp: int = 1) -> float:
        """:meth:`ShapeCost.group_ms` of shape ``(tp, pp)`` (lane schedules, pool and step times:
        :mod:`balanced_loader.simulate`)."""
        return self.shape(tp, pp).group_ms(lengths, d)


# ---- degree helpers (the one home of power-of-two and memory-fit degree arithmetic) ----------


def floor_level(n: int) -> int:
    """Largest level ``v`` with ``2**v <= n`` (``n >= 1``): the largest aligned block of ``n`` lanes is
    ``2**v`` lanes, and a power-of-two degree ``d`` is level ``floor_level(d)``."""
    return int(n).bit_length() - 1


def pow2_divisor(n: int) -> int:
    """Largest power of two dividing ``n`` (``n >= 1``): the largest fixed degree that splits ``n`` lanes
    into equal groups of a power-of-two size."""
    n = int(n)
    return n & -n  # two's complement: only the lowest set bit survives


def fit_levels(lengths: Sequence[int] | np.ndarray, cap: int) -> np.ndarray:
    """``[n]`` level ``v`` of each doc's memory-fit degree: the smallest power of two ``2**v`` with
    ``length <= 2**v * cap`` (level 0 for empty docs). Exact integer arithmetic."""
    if cap <= 0:
        raise ValueError(f"max_tokens_per_lane must be positive, got {cap}")
    rest = np.maximum(-(-np.asarray(lengths, dtype=np.int64) // cap), 1) - 1  # [n] lanes needed - 1
    level = np.zeros(rest.shape, dtype=np.int64)  # [n] the bit length of rest
    while rest.any():
        level += rest > 0
        rest = rest >> 1
    return level


def fit_degrees(lengths: Sequence[int] | np.ndarray, cap: int, degrees: Sequence[int]) -> np.ndarray:
    """``[n]`` smallest degree of ``degrees`` whose ``d * cap`` tokens hold each doc (0 where none does)."""
    ln = np.asarray(lengths)
    out = np.zeros(len(ln), dtype=np.int64)  # [n]
    for d in sorted(degrees, reverse=True):  # smaller degrees overwrite larger ones
        out[ln <= cap * d] = d
    return out


def allowed_degrees(num_lanes: int, *, powers_of_two: bool = True, min_degree: int = 1) -> list[int]:
    """Group sizes the runtime pre-creates for a pool of ``num_lanes`` lanes (aligned blocks), from
    ``min_degree`` up: powers of two up to ``num_lanes``, else the divisors of ``num_lanes``."""
    if num_lanes < 1:
        return []
    if powers_of_two:
        out, d = [], 1
        while d <= num_lanes:
            if d >= min_degree:
                out.append(d)
            d *= 2
        return out
    return [d for d in range(1, num_lanes + 1) if num_lanes % d == 0 and d >= min_degree]
