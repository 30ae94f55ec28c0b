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

from balanced_loader.strict import check_keys, check_number, number, read_yaml

# contract 2's keys for clusters that are not uniform: device classes, a rank-to-class map, lane speeds
CLUSTER_KEYS = ("device_classes", "rank_classes", "lane_speed")
MAX_SPEED = 1e3  # a lane at most 1000x its class's keys (a bound, so a typo is one line, not a silent plan)

_BASE_KEYS = ("quadratic_ms", "linear_ms", "microbatch_ms", "comm_bytes_per_token", "max_tokens_per_lane")
_OPTIONAL_KEYS = ("gpus_per_node", "strategies", "name", "bandwidth_gbs", *CLUSTER_KEYS)
_STRATEGY_KEYS = {"tp", "pp", *_BASE_KEYS, "bandwidth_gbs"}
_TIME_KEYS = ("quadratic_ms", "linear_ms", "microbatch_ms")  # what a device class scales in inherited strategies


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
    # contract 2 for clusters that are not uniform (all empty: every lane the keys above at speed 1)
    device_classes: tuple[tuple[str, CostModel], ...] = ()  # [classes] (name, that class's own uniform model)
    rank_classes: tuple[tuple[str, int], ...] = ()  # [runs] (class name, ranks) in rank order
    lane_speed: tuple[tuple[int, float], ...] = ()  # [ranks listed] (rank, speed), sorted by rank
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
        top = CostModel._uniform_from_dict(d, where)
        classes, runs, speeds = _parse_cluster(d, top, where)
        return top.replace(device_classes=classes, rank_classes=runs, lane_speed=speeds)

    @staticmethod
    def _uniform_from_dict(d: dict[str, Any], where: str) -> CostModel:
        """The keys of one kind of device (top level, or one device class with the top level's keys filled in)."""
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
        if self.device_classes:
            d["device_classes"] = {n: _class_dict(m) for n, m in self.device_classes}
            d["rank_classes"] = [{"class": n, "ranks": k} for n, k in self.rank_classes]
        if self.lane_speed:
            d["lane_speed"] = {r: v for r, v in self.lane_speed}
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

    def scaled(self, factor: float) -> CostModel:
        """The same device ``factor`` times slower (every time key of every shape times ``factor``;
        communication through ``comm_bytes_per_token``): contract 2's ``formula / speed`` with
        ``factor = 1 / speed``. Caps, bandwidths and the cluster keys are kept."""
        if factor == 1.0:
            return self
        keys = (*_TIME_KEYS, "comm_bytes_per_token")
        strategies = tuple(replace(sc, **{k: getattr(sc, k) * factor for k in keys}) for sc in self.strategies)
        return self.replace(strategies=strategies, **{k: getattr(self, k) * factor for k in keys})

    # ---- the cluster: device classes and lane speeds (contract 2) -----------------
    @property
    def uniform(self) -> bool:
        """Every lane is the top-level keys at speed 1 (no device classes, no speed other than 1)."""
        return not self.device_classes and all(v == 1.0 for _, v in self.lane_speed)

    def device(self) -> CostModel:
        """The top-level keys alone (no classes, no speeds): one kind of device at speed 1."""
        if not self.device_classes and not self.lane_speed:
            return self
        return self.replace(device_classes=(), rank_classes=(), lane_speed=())

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.device_classes)

    def class_model(self, name: str) -> CostModel:
        """The uniform cost model of one device class (the top level for ``""``)."""
        if not name:
            return self.device()
        for n, m in self.device_classes:
            if n == name:
                return m
        raise ValueError(f"unknown device class '{name}'; the cost file lists: {', '.join(self.class_names)}")

    def rank_class_index(self, world_size: int) -> np.ndarray:
        """``[world_size]`` int64: each rank's index in :attr:`device_classes` (all 0 without classes).

        The runs of ``rank_classes`` must cover the world exactly (one line naming both counts otherwise)."""
        if not self.device_classes:
            return np.zeros(world_size, dtype=np.int64)
        covered = sum(k for _, k in self.rank_classes)
        if covered != world_size:
            raise ValueError(f"rank_classes covers {covered} ranks but the world has {world_size}; list a class "
                             f"for every rank (runs of ranks in rank order)")
        names = self.class_names
        return np.repeat(np.asarray([names.index(n) for n, _ in self.rank_classes], dtype=np.int64),
                         [k for _, k in self.rank_classes])

    def rank_speeds(self, world_size: int) -> np.ndarray:
        """``[world_size]`` float64: each rank's speed (1 where ``lane_speed`` does not list it)."""
        out = np.ones(world_size, dtype=np.float64)
        for r, v in self.lane_speed:
            if r >= world_size:
                raise ValueError(f"lane_speed lists rank {r} but the world has {world_size} ranks "
                                 f"(0..{world_size - 1})")
            out[r] = v
        return out

    def with_speeds(self, speeds: Sequence[float] | np.ndarray | dict[int, float]) -> CostModel:
        """A copy with ``lane_speed`` set (a rank -> speed mapping, or one speed per rank; 1s are left out)."""
        items = speeds.items() if isinstance(speeds, dict) else enumerate(np.asarray(speeds, dtype=np.float64).tolist())
        plain = [(r.item() if isinstance(r, np.generic) else r, v.item() if isinstance(v, np.generic) else v)
                 for r, v in items]  # numpy scalars as Python numbers, for the checks
        pairs = tuple(sorted((check_number(r, "lane_speed rank", integer=True, minimum=0, maximum=1 << 24),
                              _speed(v, f"lane_speed of rank {r}")) for r, v in plain if v != 1.0))
        return self.replace(lane_speed=pairs)

    def with_classes(self, classes: dict[str, CostModel], runs: Sequence[tuple[str, int]]) -> CostModel:
        """A copy with device classes (each a uniform model, e.g. a preset per GPU kind) and the rank-to-class
        map as runs ``[(class, ranks), ...]`` in rank order; checked like a cost file's keys."""
        d = self.to_dict()
        d["device_classes"] = {n: _class_dict(m) for n, m in classes.items()}
        d["rank_classes"] = [{"class": n, "ranks": k} for n, k in runs]
        return CostModel.from_dict(d, where="with_classes")

    def lanes(self, ranks: Sequence[Sequence[int]] | np.ndarray, tp: int, world_size: int) -> LaneProfile:
        """Class and speed of every lane of a pool with rank grid ``ranks`` (``[pp][lanes * tp]``).

        Contract 2: a lane is its ``tp`` ranks at every stage; its speed is the smallest of theirs; a
        lane whose ranks are of several classes takes, key by key, the slower value and the smaller
        cap of them (the slowest applies)."""
        grid = np.asarray(ranks, dtype=np.int64)  # [pp][lanes * tp]
        nl = grid.shape[1] // tp if grid.size else 0
        per_lane = grid.reshape(grid.shape[0], nl, tp).transpose(1, 0, 2).reshape(nl, -1)  # [lanes, pp * tp]
        speed = self.rank_speeds(world_size)[per_lane].min(axis=1) if nl else np.ones(0)  # [lanes]
        if not self.device_classes:
            return LaneProfile(cls=np.zeros(nl, dtype=np.int64), speed=speed, models=(self.device(),))
        rc = self.rank_class_index(world_size)[per_lane]  # [lanes, pp * tp]
        lo, hi = rc.min(axis=1), rc.max(axis=1)
        models = [m for _, m in self.device_classes]
        cls = lo.copy()  # [lanes]
        for a, b in sorted({(int(x), int(y)) for x, y in zip(lo, hi) if x != y}):  # mixed lanes (rare)
            mixed = set(rc[(lo == a) & (hi == b)].ravel().tolist())
            models.append(slowest([models[c] for c in sorted(mixed)]))
            cls[(lo == a) & (hi == b)] = len(models) - 1
        return LaneProfile(cls=cls, speed=speed, models=tuple(models))

    def ranks_model(self, ranks: Sequence[int], world_size: int) -> CostModel:
        """The uniform model of one lane made of ``ranks``: its class (the slowest, key by key, if they mix)
        with its times divided by its speed (the smallest of theirs)."""
        prof = self.lanes([list(ranks)], len(ranks), world_size)
        return prof.lane_models()[0]

    def pool_lane_caps(self, tp: int, pp: int, ranks: Sequence[Sequence[int]], world_size: int) -> np.ndarray | None:
        """``[lanes]`` each lane's ``max_tokens_per_lane`` for shape ``(tp, pp)``, or ``None`` when every lane
        has the top level's (what :meth:`balanced_loader.plan.StepPlan.validate` checks memory with)."""
        if not self.device_classes:
            return None
        prof = self.lanes(ranks, tp, world_size)
        caps = np.asarray([m.lane_cap(tp, pp) for m in prof.models], dtype=np.int64)  # [classes]
        return caps[prof.cls]

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


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneProfile:
    """What contract 2 says of each lane of one pool: its device class and its speed."""

    cls: np.ndarray  # [lanes] int64, index into models
    speed: np.ndarray  # [lanes] float64, relative speed (1: as the class's keys say)
    models: tuple[CostModel, ...]  # [classes] uniform cost model of each class (mixed lanes last)

    @property
    def uniform(self) -> bool:
        """One class, every lane at speed 1: the lanes are alike."""
        return len(set(self.cls.tolist())) <= 1 and bool(np.all(self.speed == 1.0))

    def lane_models(self) -> list[CostModel]:
        """``[lanes]`` each lane's cost model with its speed applied (``scaled(1 / speed)``)."""
        return [self.models[c].scaled(1.0 / v) for c, v in zip(self.cls.tolist(), self.speed.tolist())]


def _speed(v: Any, what: str) -> float:
    """A lane speed: a finite number in (0, MAX_SPEED] (one line naming ``what`` otherwise)."""
    x = check_number(v, what, maximum=MAX_SPEED)
    if x <= 0:
        raise ValueError(f"{what} must be > 0 (1 = as its class's keys say, 0.5 = half as fast), got {v!r}")
    return x


def slowest(models: Sequence[CostModel]) -> CostModel:
    """One model that is, key by key, the slowest of ``models`` (largest times, smallest caps and bandwidths)."""
    first = models[0]
    if len(models) == 1:
        return first
    shapes = {}
    for tp, pp in first._shapes:
        scs = [m.shape(tp, pp) for m in models]
        kw = {k: max(getattr(x, k) for x in scs) for k in (*_TIME_KEYS, "comm_bytes_per_token")}
        kw["max_tokens_per_lane"] = min(x.max_tokens_per_lane for x in scs)
        kw["bandwidth_gbs"] = min((x.bandwidth_gbs for x in scs), key=lambda b: b[0][1])
        shapes[(tp, pp)] = replace(scs[0], **kw)
    base = shapes.pop((1, 1))
    return first.replace(strategies=tuple(shapes.values()), name="+".join(m.name for m in models),
                         **{k: getattr(base, k) for k in (*_BASE_KEYS, "bandwidth_gbs")})


def _class_dict(m: CostModel) -> dict[str, Any]:
    """A device class as written in a cost file: its keys (all of them: the file stays readable alone)."""
    d = m.to_dict()
    d.pop("name", None)
    d.pop("gpus_per_node", None)
    return d


Classes = tuple[tuple[str, "CostModel"], ...]  # [classes] (name, uniform model)


def _parse_cluster(d: dict[str, Any], top: CostModel, where: str
                   ) -> tuple[Classes, tuple[tuple[str, int], ...], tuple[tuple[int, float], ...]]:
    """Contract 2's ``device_classes``, ``rank_classes`` and ``lane_speed`` (each one line when wrong).

    A class lists any of the top-level keys and inherits the others; a class without ``strategies`` has
    the top level's shapes with their time keys and caps scaled by the class's own base ratios."""
    raw = d.get("device_classes")
    runs_raw = d.get("rank_classes")
    classes: list[tuple[str, CostModel]] = []
    if raw is not None:
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"{where}: 'device_classes' must be a mapping name -> cost keys")
        if runs_raw is None:
            raise ValueError(f"{where}: 'device_classes' needs 'rank_classes' (runs of ranks: [{{class: NAME, "
                             f"ranks: N}}, ...])")
        for name, keys in raw.items():
            cw = f"{where}: device_classes.{name}"
            if not isinstance(keys, dict):
                raise ValueError(f"{cw}: expected a mapping of cost keys")
            check_keys(keys, (*_BASE_KEYS, "bandwidth_gbs", "strategies"), cw)
            merged = {**top.to_dict(), **keys}
            merged.pop("device_classes", None)
            if "strategies" not in keys:
                merged["strategies"] = _scaled_strategies(top, keys, cw)
            classes.append((str(name), CostModel._uniform_from_dict(merged, cw).replace(name=str(name))))
    elif runs_raw is not None:
        raise ValueError(f"{where}: 'rank_classes' names classes but there is no 'device_classes'")
    runs: list[tuple[str, int]] = []
    if runs_raw is not None:
        if not isinstance(runs_raw, list) or not runs_raw:
            raise ValueError(f"{where}: 'rank_classes' must be a list of {{class: NAME, ranks: N}}")
        names = [n for n, _ in classes]
        for i, run in enumerate(runs_raw):
            rw = f"{where}: rank_classes[{i}]"
            if not isinstance(run, dict):
                raise ValueError(f"{rw}: expected {{class: NAME, ranks: N}}")
            check_keys(run, ("class", "ranks"), rw)
            if run.get("class") not in names:
                raise ValueError(f"{rw}: unknown device class {run.get('class')!r}; device_classes lists: "
                                 f"{', '.join(names)}")
            runs.append((str(run["class"]), number(run, "ranks", rw, integer=True, minimum=1, maximum=1 << 24)))
    speeds: list[tuple[int, float]] = []
    raw_speed = d.get("lane_speed")
    if raw_speed is not None:
        if not isinstance(raw_speed, dict):
            raise ValueError(f"{where}: 'lane_speed' must be a mapping rank -> speed (1 = as its class's keys say)")
        for r, v in raw_speed.items():
            r = int(r) if isinstance(r, str) and r.isdigit() else r  # JSON writes mapping keys as strings
            rank = check_number(r, f"{where}: lane_speed key", integer=True, minimum=0, maximum=1 << 24)
            if any(rank == x for x, _ in speeds):  # 0 and "0" are two YAML keys for one rank
                raise ValueError(f"{where}: lane_speed lists rank {rank} twice")
            speeds.append((rank, _speed(v, f"{where}: lane_speed of rank {r}")))
    return tuple(classes), tuple(runs), tuple(sorted(speeds))


def _scaled_strategies(top: CostModel, keys: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The top level's strategies for a class that lists none: each key scaled by the class's base ratio."""
    out = []
    for sc in top.strategies:
        e: dict[str, Any] = {"tp": sc.tp, "pp": sc.pp}
        for k in (*_TIME_KEYS, "max_tokens_per_lane"):
            mine = keys.get(k, getattr(top, k))
            ratio = float(mine) / getattr(top, k) if getattr(top, k) else 1.0
            e[k] = getattr(sc, k) * ratio if k != "max_tokens_per_lane" else int(getattr(sc, k) * ratio)
        if sc.comm_bytes_per_token != top.comm_bytes_per_token:
            e["comm_bytes_per_token"] = sc.comm_bytes_per_token
        if sc.bandwidth_gbs != top.bandwidth_gbs:
            e["bandwidth_gbs"] = dict(sc.bandwidth_gbs)
        out.append(e)
    return out


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
