"""Hydraulis candidate strategies: a DP over a length histogram (papers/hydraulis.md §2).

A *candidate* is a multiset of pipelines, each a ``(tp, pp)`` shape from the cost file,
using together exactly ``world_size`` GPUs. Lengths are binned on a grid of ``delta_s``
tokens (empty bins dropped); the DP state ``t[n][b]`` is the smallest achievable slowest
pipeline time covering every doc in bins ``1..b`` with at most ``n`` GPU units (``delta_n``
GPUs each; a shape takes ``ceil(tp*pp / delta_n)`` units):

    t[n][b] = min( t[n-1][b],                                   # a unit stays idle
                   min_{k, lo < b, d} max(t[n - d*units_k][lo], C_k(lo, b] / d, pp_k T_k(longest)) )

where shape ``k`` holds the interval's longest doc, its ``d`` replicas split the interval
evenly but none is faster than the interval's longest doc alone (the paper's ``C / d`` lets a
32K doc's time be shared by replicas; the floor stops that), and
``C_k(lo, b] = sum_docs T_k(len) + (pp_k - 1) * T_k(longest)`` with ``T_k`` one stage's time
(contract-2 whole-model time / pp). ``fixed_cost`` says how ``microbatch_ms`` enters ``T_k``:
``doc`` charges it per doc (the paper's code, no packing at this level); ``packed`` charges
``microbatch_ms * len / max_tokens_per_lane`` (a share of a full microbatch), which is what
the per-step packing pays.

Candidates are the distinct pipeline multisets of ``t[N][b]`` over every ``b`` (each is the
best plan for batches whose longest doc is in bin ``b``), GPUs left idle by the DP are given
to the slowest interval's shape (or any shape that fits them), and the homogeneous
strategy (the single shape, ``world / (tp*pp)`` replicas, holding the longest length with the
lowest DP time) comes first, followed by the other homogeneous strategies (a per-step
fallback that costs one stage-1 run each). Kernel :func:`dp_table` has a pure-Python twin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from balanced_loader.cost import CostModel, ShapeCost
from balanced_loader.simulate import solo_stage_ms
from balanced_loader.strict import check_keys, number, read_yaml

CANDIDATES_FORMAT = "balanced-loader/candidates"
CANDIDATES_VERSION = 1
FIXED_COST_MODES = ("doc", "packed")


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A heterogeneous strategy: ``(tp, pp, count)`` pipelines, largest first."""

    pipelines: tuple[tuple[int, int, int], ...]  # [(tp, pp, replicas)]
    covers: int = 0  # longest doc length the DP built it for
    dp_ms: float = 0.0  # the DP's slowest-pipeline time on the histogram

    @property
    def gpus(self) -> int:
        return sum(tp * pp * n for tp, pp, n in self.pipelines)

    def expand(self) -> list[tuple[int, int]]:
        """One ``(tp, pp)`` per pipeline, in rank order."""
        return [(tp, pp) for tp, pp, n in self.pipelines for _ in range(n)]

    def max_tokens(self, cost: CostModel) -> int:
        return max(cost.shape(tp, pp).max_tokens_per_lane for tp, pp, _ in self.pipelines)

    def label(self) -> str:
        return " + ".join(f"{n}x(tp{tp},pp{pp})" for tp, pp, n in self.pipelines)

    def to_json(self) -> dict:
        return {"pipelines": [{"tp": tp, "pp": pp, "count": n} for tp, pp, n in self.pipelines],
                "covers": int(self.covers), "dp_ms": round(float(self.dp_ms), 3)}


def normalize(pipes: Sequence[tuple[int, int]] | dict[tuple[int, int], int], covers: int = 0,
              dp_ms: float = 0.0) -> Candidate:
    """A candidate from pipelines, sorted by GPUs then tp, largest first (ranks: TP inside a node)."""
    counts: dict[tuple[int, int], int] = {}
    if isinstance(pipes, dict):
        counts = {k: int(v) for k, v in pipes.items() if v > 0}
    else:
        for tp, pp in pipes:
            counts[(tp, pp)] = counts.get((tp, pp), 0) + 1
    order = sorted(counts, key=lambda s: (-s[0] * s[1], -s[0], s[1]))
    return Candidate(pipelines=tuple((tp, pp, counts[(tp, pp)]) for tp, pp in order), covers=covers, dp_ms=dp_ms)


# ---------------------------------------------------------------------------------------------
# Histogram on the length grid
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Grid:
    """Non-empty length bins and per-shape interval costs."""

    upper: np.ndarray  # [B] longest doc in each non-empty bin, ascending
    prefix: np.ndarray  # [K, B+1] prefix sums of sum_docs T_k(len)
    tmax: np.ndarray  # [K, B] T_k of each bin's longest doc (one stage)
    fits: np.ndarray  # [K, B] shape k holds bin b's longest doc
    units: np.ndarray  # [K] GPU units per pipeline of shape k
    ppm1: np.ndarray  # [K] pp - 1
    shapes: tuple[tuple[int, int], ...]  # [K]


def stage_ms(sc: ShapeCost, lengths: np.ndarray, fixed_cost: str) -> np.ndarray:
    """One stage's time per doc (``[n]``) under ``fixed_cost`` (see module docstring)."""
    ln = np.asarray(lengths, dtype=np.float64)
    # "doc": a group per doc; "packed": the doc's token share of one full microbatch's fixed cost
    fixed = sc.microbatch_ms if fixed_cost == "doc" else sc.microbatch_ms * ln / sc.max_tokens_per_lane
    return solo_stage_ms(sc, ln, fixed)


def build_grid(lengths: np.ndarray, weights: np.ndarray, shapes: Sequence[ShapeCost], delta_s: int,
               delta_n: int, fixed_cost: str = "packed") -> Grid:
    """Bin ``lengths`` (``[m]`` distinct or not, each counted ``weights[i]`` times) on the ``delta_s`` grid."""
    if fixed_cost not in FIXED_COST_MODES:
        raise ValueError(f"fixed_cost must be one of {', '.join(FIXED_COST_MODES)}, got '{fixed_cost}'")
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    keep = weights > 0
    lengths, weights = lengths[keep], weights[keep]
    b_of = (lengths - 1) // delta_s  # [m] grid bin of each length
    bins, inv = np.unique(b_of, return_inverse=True)  # non-empty bins ascending
    nb = len(bins)
    upper = np.zeros(nb, dtype=np.int64)
    np.maximum.at(upper, inv, lengths)
    k = len(shapes)
    prefix = np.zeros((k, nb + 1))
    tmax = np.zeros((k, nb))
    fits = np.zeros((k, nb), dtype=np.bool_)
    for j, sc in enumerate(shapes):
        per_bin = np.bincount(inv, weights=weights * stage_ms(sc, lengths, fixed_cost), minlength=nb)
        prefix[j, 1:] = np.cumsum(per_bin)
        tmax[j] = stage_ms(sc, upper, fixed_cost)
        fits[j] = upper <= sc.max_tokens_per_lane
    units = np.asarray([math.ceil(sc.tp * sc.pp / delta_n) for sc in shapes], dtype=np.int64)
    ppm1 = np.asarray([sc.pp - 1 for sc in shapes], dtype=np.float64)
    return Grid(upper=upper, prefix=prefix, tmax=tmax, fits=fits, units=units, ppm1=ppm1,
                shapes=tuple((sc.tp, sc.pp) for sc in shapes))


# ---------------------------------------------------------------------------------------------
# The DP
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def _dp_kernel(prefix: np.ndarray, tmax: np.ndarray, fits: np.ndarray, units: np.ndarray, ppm1: np.ndarray,
               n_units: int) -> tuple[np.ndarray, np.ndarray]:
    k_shapes = prefix.shape[0]
    nb = prefix.shape[1] - 1
    t = np.full((n_units + 1, nb + 1), np.inf)  # [N+1][B+1]
    trace = np.full((n_units + 1, nb + 1, 3), -1, dtype=np.int64)  # (k, lo, d); k = -1: idle unit
    for n in range(n_units + 1):
        t[n, 0] = 0.0
    for n in range(1, n_units + 1):
        for b in range(1, nb + 1):
            best = t[n - 1, b]
            bk, blo, bd = -1, -1, -1
            for k in range(k_shapes):
                if not fits[k, b - 1]:
                    continue
                dmax = n // units[k]
                one = (ppm1[k] + 1.0) * tmax[k, b - 1]  # a replica is never faster than its longest doc
                for lo in range(b):
                    # interval (lo, b] on shape k: its docs' stage times plus (pp - 1) x its longest (fill
                    # and drain), split over d replicas; never below the longest doc alone (`one`)
                    c = prefix[k, b] - prefix[k, lo] + ppm1[k] * tmax[k, b - 1]
                    for d in range(1, dmax + 1):
                        prev = t[n - d * units[k], lo]
                        v = c / d
                        if one > v:
                            v = one
                        if prev > v:
                            v = prev
                        if v < best:
                            best = v
                            bk, blo, bd = k, lo, d
            t[n, b] = best
            trace[n, b, 0] = bk
            trace[n, b, 1] = blo
            trace[n, b, 2] = bd
    return t, trace


def dp_table_reference(grid: Grid, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    """Pure-Python twin of :func:`dp_table` (same loop order, strict improvement wins)."""
    k_shapes, nb = grid.prefix.shape[0], grid.prefix.shape[1] - 1
    t = [[math.inf] * (nb + 1) for _ in range(n_units + 1)]
    trace = np.full((n_units + 1, nb + 1, 3), -1, dtype=np.int64)
    for n in range(n_units + 1):
        t[n][0] = 0.0
    for n in range(1, n_units + 1):
        for b in range(1, nb + 1):
            best, arg = t[n - 1][b], (-1, -1, -1)
            for k in range(k_shapes):
                if not grid.fits[k, b - 1]:
                    continue
                one = (grid.ppm1[k] + 1.0) * grid.tmax[k, b - 1]
                for lo in range(b):
                    c = grid.prefix[k, b] - grid.prefix[k, lo] + grid.ppm1[k] * grid.tmax[k, b - 1]
                    for d in range(1, n // int(grid.units[k]) + 1):
                        v = max(t[n - d * int(grid.units[k])][lo], c / d, one)
                        if v < best:
                            best, arg = v, (k, lo, d)
            t[n][b] = best
            trace[n, b] = arg
    return np.asarray(t), trace


def dp_table(grid: Grid, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    """``t [N+1, B+1]`` and ``trace [N+1, B+1, 3]`` (shape, interval start, replicas; -1 = idle unit)."""
    return _dp_kernel(grid.prefix, grid.tmax, grid.fits, grid.units, grid.ppm1, int(n_units))


def extract(grid: Grid, trace: np.ndarray, n_units: int, b: int) -> list[tuple[int, int, int, int]]:
    """``(shape, replicas, lo, hi)`` intervals of the DP solution covering bins ``1..b`` with ``n_units``."""
    out = []
    n = n_units
    while b > 0:
        k, lo, d = (int(x) for x in trace[n, b])
        if k < 0:
            n -= 1
            assert n >= 0
            continue
        out.append((k, d, lo, b))
        n -= d * int(grid.units[k])
        b = lo
    return out


# ---------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------


def usable_shapes(cost: CostModel, world_size: int) -> list[ShapeCost]:
    """Shapes of the cost file that hydraulis may use (usable, at most ``world_size`` GPUs)."""
    if not cost.strategies:
        raise ValueError("hydraulis needs per-(tp, pp) shapes: add a 'strategies' list to the cost file "
                         "(e.g. - {tp: 4, pp: 1, quadratic_ms: ..., max_tokens_per_lane: ...})")
    shapes = [s for s in cost.shapes() if s.gpus <= world_size]
    if not shapes:
        raise ValueError(f"no usable shape in the cost file fits {world_size} GPUs "
                         f"(every shape has max_tokens_per_lane 0 or more GPUs)")
    return shapes


def _fill(counts: dict[int, int], loads: dict[int, float], left: int, grid: Grid, shapes: Sequence[ShapeCost]
          ) -> bool:
    """Give ``left`` idle GPUs to pipelines: the slowest shape's intervals first, else any shape that fits."""
    gpus = [s.tp * s.pp for s in shapes]
    while left > 0:
        order = sorted(counts, key=lambda k: (-loads[k] / counts[k], k))
        pick = next((k for k in order if gpus[k] <= left), None)
        if pick is None:
            pick = next((k for k in sorted(range(len(shapes)), key=lambda k: (gpus[k], k)) if gpus[k] <= left), None)
            if pick is None:
                return False
            counts[pick] = 0
            loads[pick] = 0.0
        counts[pick] += 1
        left -= gpus[pick]
    return True


MAX_BINS = 1024  # length bins of the grid: the DP's time grows with their square
MAX_UNITS = 4096  # GPU units (world_size / delta_n): the DP's time grows with their square, its table linearly
MAX_DP_STEPS = 2e9  # inner-loop steps of the DP (about 10 s of numba on one core)


def check_dp_size(grid: Grid, n_units: int, *, world_size: int, delta_s: int, delta_n: int, longest: int) -> None:
    """Refuse a grid whose DP would run for minutes or fill memory, naming the knob that fixes it."""
    nb = len(grid.upper)
    if nb > MAX_BINS:
        raise ValueError(f"delta_s {delta_s} (--delta-s) cuts the lengths into {nb:,} bins, over {MAX_BINS:,} (the DP "
                         f"time grows with their square); use a delta_s of at least {-(-longest // MAX_BINS):,}")
    if n_units > MAX_UNITS:
        raise ValueError(f"world size {world_size:,} / delta_n {delta_n} (--delta-n) is {n_units:,} GPU units, over "
                         f"{MAX_UNITS:,} (the DP time grows with their square); use a delta_n of at least "
                         f"{-(-world_size // MAX_UNITS):,} that divides the world size")
    steps = n_units * n_units / 2 * nb * nb / 2 * len(grid.shapes) / max(1, int(grid.units.min()))
    if steps > MAX_DP_STEPS:
        raise ValueError(f"{n_units:,} GPU units x {nb:,} length bins x {len(grid.shapes)} shapes is about {steps:.1e} "
                         f"DP steps, over {MAX_DP_STEPS:.0e} (minutes of work); raise delta_s (--delta-s) or "
                         f"delta_n (--delta-n)")


def generate(lengths: np.ndarray, weights: np.ndarray | None, cost: CostModel, world_size: int, *,
             delta_s: int = 128, delta_n: int = 1, fixed_cost: str = "packed") -> list[Candidate]:
    """Candidates for a histogram: ``lengths`` ``[m]`` each seen ``weights[i]`` times (default 1).

    Lengths must be positive and held by some shape; the first candidate is homogeneous.
    """
    shapes = usable_shapes(cost, world_size)
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = np.ones(len(lengths)) if weights is None else np.asarray(weights, dtype=np.float64)
    if lengths.size == 0 or weights.sum() <= 0:
        raise ValueError("the length histogram is empty")
    if delta_s < 1 or delta_n < 1:
        raise ValueError(f"delta_s and delta_n must be >= 1, got {delta_s} and {delta_n}")
    if world_size % delta_n:
        raise ValueError(f"world size {world_size} is not a multiple of delta_n {delta_n}")
    longest = int(lengths[weights > 0].max())
    cap = max(s.max_tokens_per_lane for s in shapes)
    if longest > cap:
        raise ValueError(f"a {longest}-token doc fits no shape (largest max_tokens_per_lane {cap}); "
                         f"split long docs (--max-len) or add a larger shape under 'strategies'")
    grid = build_grid(lengths, weights, shapes, delta_s, delta_n, fixed_cost)
    n_units = world_size // delta_n
    check_dp_size(grid, n_units, world_size=world_size, delta_s=delta_s, delta_n=delta_n, longest=longest)
    t, trace = dp_table(grid, n_units)
    nb = len(grid.upper)
    # homogeneous first: a shape dividing the world that holds the longest doc, fastest on the whole histogram
    homo: Candidate | None = None
    for k, sc in enumerate(shapes):
        g = sc.tp * sc.pp
        if world_size % g or not grid.fits[k, nb - 1]:
            continue
        ms = (grid.prefix[k, nb] + grid.ppm1[k] * grid.tmax[k, nb - 1]) / (world_size // g)
        if homo is None or ms < homo.dp_ms - 1e-9:
            homo = normalize({(sc.tp, sc.pp): world_size // g}, covers=int(grid.upper[-1]), dp_ms=ms)
    out: list[Candidate] = [homo] if homo is not None else []
    for k, sc in enumerate(shapes):  # every other homogeneous strategy too (cheap, and a safe fallback)
        g = sc.tp * sc.pp
        if world_size % g == 0 and (homo is None or (sc.tp, sc.pp) != homo.pipelines[0][:2]):
            ms = (grid.prefix[k, nb] + grid.ppm1[k] * grid.tmax[k, nb - 1]) / (world_size // g)
            out.append(normalize({(sc.tp, sc.pp): world_size // g}, covers=int(grid.upper[-1] if grid.fits[k, nb - 1]
                                                                                else sc.max_tokens_per_lane),
                                 dp_ms=ms))
    seen = {c.pipelines for c in out}
    for b in range(1, nb + 1):
        if not np.isfinite(t[n_units, b]):
            continue
        counts: dict[int, int] = {}
        loads: dict[int, float] = {}
        for k, d, lo, hi in extract(grid, trace, n_units, b):
            counts[k] = counts.get(k, 0) + d
            c = grid.prefix[k, hi] - grid.prefix[k, lo] + grid.ppm1[k] * grid.tmax[k, hi - 1]
            loads[k] = loads.get(k, 0.0) + c
        used = sum(counts[k] * shapes[k].tp * shapes[k].pp for k in counts)
        if not _fill(counts, loads, world_size - used, grid, shapes):
            continue
        cand = normalize({grid.shapes[k]: n for k, n in counts.items()}, covers=int(grid.upper[b - 1]),
                         dp_ms=float(t[n_units, b]))
        if cand.pipelines not in seen:
            seen.add(cand.pipelines)
            out.append(cand)
    if not out:
        raise ValueError(f"no combination of the cost file's shapes covers exactly {world_size} GPUs")
    return out


def histogram_of(spec: object) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, weights)`` from a list/array of lengths or a mapping length -> count."""
    if isinstance(spec, dict):
        try:
            ln = np.asarray([int(k) for k in spec], dtype=np.int64)
            w = np.asarray([float(v) for v in spec.values()], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError("length_histogram must map integer lengths to counts") from None
    else:
        ln = np.asarray(spec, dtype=np.int64).reshape(-1)
        w = np.ones(len(ln))
    if ln.size and (ln.min() <= 0 or w.min() < 0):
        raise ValueError("length_histogram needs positive lengths and non-negative counts")
    return ln, w


# ---------------------------------------------------------------------------------------------
# File
# ---------------------------------------------------------------------------------------------


def dumps(cands: Sequence[Candidate], *, world_size: int, max_len: int, delta_s: int, delta_n: int,
          fixed_cost: str, cost_name: str = "") -> str:
    import yaml

    body = {"format": CANDIDATES_FORMAT, "version": CANDIDATES_VERSION, "world_size": world_size,
            "max_len": int(max_len), "delta_s": delta_s, "delta_n": delta_n, "fixed_cost": fixed_cost}
    if cost_name:
        body["cost"] = cost_name
    body["candidates"] = [c.to_json() for c in cands]
    return yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


_TOP_KEYS = {"format", "version", "world_size", "max_len", "delta_s", "delta_n", "fixed_cost", "cost", "candidates"}


def load(path: str, world_size: int, cost: CostModel | None = None) -> list[Candidate]:
    """Read a candidates file, checking its world size and (with ``cost``) that every shape is usable."""
    data = read_yaml(path, "candidates file", mapping=True)
    where = f"candidates file {path}"
    if not isinstance(data, dict) or data.get("format") != CANDIDATES_FORMAT:
        raise ValueError(f"{where}: expected \"format: {CANDIDATES_FORMAT}\" "
                         f"(write it with balanced-loader candidates)")
    if data.get("version") != CANDIDATES_VERSION:
        raise ValueError(f"{where}: version {data.get('version')} is not supported (this reader knows "
                         f"{CANDIDATES_VERSION})")
    check_keys(data, _TOP_KEYS, where)
    if data.get("world_size") != world_size:
        raise ValueError(f"{where} was made for world size {data.get('world_size')}, not {world_size}; "
                         f"regenerate it with --world-size {world_size}")
    raw = data.get("candidates")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: 'candidates' must be a non-empty list")
    out = []
    for i, c in enumerate(raw):
        cw = f"{where}: candidates[{i}]"
        if not isinstance(c, dict) or "pipelines" not in c:
            raise ValueError(f"{cw}: expected {{pipelines: [...], covers: N, dp_ms: X}}")
        check_keys(c, ("pipelines", "covers", "dp_ms"), cw)
        counts: dict[tuple[int, int], int] = {}
        for j, p in enumerate(c["pipelines"] or []):
            pw = f"{cw}: pipelines[{j}]"
            if not isinstance(p, dict):
                raise ValueError(f"{pw}: expected {{tp, pp, count}}, got {p!r}")
            check_keys(p, ("tp", "pp", "count"), pw)
            tp, pp, n = (number(p, k, pw, integer=True, minimum=1) for k in ("tp", "pp", "count"))
            counts[(tp, pp)] = counts.get((tp, pp), 0) + n
        cand = normalize(counts, covers=number(c, "covers", cw, integer=True, minimum=0, default=0),
                         dp_ms=number(c, "dp_ms", cw, minimum=0, default=0.0))
        if cand.gpus != world_size:
            raise ValueError(f"{cw}: pipelines use {cand.gpus} GPUs, not the world size {world_size}")
        if cost is not None:
            for tp, pp, _ in cand.pipelines:
                if not cost.shape(tp, pp).usable:
                    raise ValueError(f"{cw}: shape tp={tp}, pp={pp} is unusable in the cost file")
        out.append(cand)
    return out
