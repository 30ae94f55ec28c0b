"""What a rank measured, per microbatch, in the features the cost model uses.

One **sample** is one rank's part of one group in one microbatch: the group's pool shape
``(tp, pp)``, its degree ``d``, the engine that ran it, its tokens ``sum s`` and ``sum s^2`` over
its segments (unpadded), and two measured times of the same compute:

* ``compute_ms``: the contention-free cost (thread CPU time on CPU, CUDA events on GPU): what
  the device needs for the work, whatever else runs beside it;
* ``wall_ms``: wall time of the same compute blocks (what a slow or shared device really takes;
  the waits between microbatches on pipeline peers are outside the blocks).

**Which samples count.** A sample is kept only when both its times are finite and within
``MIN_SAMPLE_MS`` .. ``MAX_SAMPLE_MS`` (1 microsecond .. 10^7 ms, about 2.8 hours): a zero time is no
measurement (a CPU timer around asynchronous GPU work reads about 0, and such rows would pull the
fit's fixed and quadratic costs to 0), and 1e-300 or 1e300 ms are no device's; and when its features
are a group's (``0 < tokens <= 2**40``, ``tokens <= sumsq <= tokens**2``, degree, tp, pp in 1..2**20).
Dropped samples are counted (``Update.dropped``, the runtime's ``calibration`` metrics). A sample of a step outside the
calibrator's window (``(step - window, step]`` of the step it is observed at) is ignored too.

Contract 2 predicts one stage's share of a group as ``(beta + (q sum s^2 + l sum s) / d +
[d > 1] B sum s / (d bw(d) 1e6)) / pp``; :mod:`balanced_loader.calibration.fit` fits ``beta, q, l, B``
from these samples. :class:`Samples` keeps them as columns (a window of a few thousand rows).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

ENGINES = ("local", "ring", "ulysses", "nested")  # engine codes in Samples.engine
MIN_SAMPLE_MS = 1e-3  # a measured time below this is no measurement (module docstring)
MAX_SAMPLE_MS = 1e7  # nor one above this (about 2.8 hours for one microbatch)
MAX_STEP = 1 << 53  # steps are stored in float64 rows: exact below this
MAX_GROUP_TOKENS = float(1 << 40)  # tokens of one group (a plan's segment limit)
MAX_DEGREE = 1 << 20  # lanes of a group, tp, pp: a world's ranks at most


def engine_of(degree: int, cp_inner: int) -> str:
    """The CP engine that runs a group of ``degree`` lanes laid out with Ulysses size ``cp_inner``."""
    if degree <= 1:
        return "local"
    if cp_inner <= 1:
        return "ring"
    return "ulysses" if cp_inner == degree else "nested"


@dataclass(frozen=True, kw_only=True, slots=True)
class Samples:
    """Samples as columns, every array ``[n]``."""

    step: np.ndarray  # int64, global step
    rank: np.ndarray  # int64
    tp: np.ndarray  # int64, the pool's shape
    pp: np.ndarray  # int64
    degree: np.ndarray  # int64, lanes of the group
    engine: np.ndarray  # int64, index into ENGINES
    tokens: np.ndarray  # float64, sum of the group's segment lengths
    sumsq: np.ndarray  # float64, sum of their squares
    compute_ms: np.ndarray  # float64, contention-free time of this rank's part
    wall_ms: np.ndarray  # float64, wall time of the same compute

    _INT = ("step", "rank", "tp", "pp", "degree", "engine")

    def __len__(self) -> int:
        return len(self.step)

    @staticmethod
    def empty() -> Samples:
        return Samples.from_rows([])

    @staticmethod
    def from_rows(rows: Iterable[Sequence[float]]) -> Samples:
        """From rows in field order (what :meth:`rows` gives back)."""
        names = [f.name for f in fields(Samples)]
        arr = np.asarray(list(rows), dtype=np.float64).reshape(-1, len(names))  # [n, fields]
        return Samples(**{n: arr[:, i].astype(np.int64) if n in Samples._INT else arr[:, i].copy()
                          for i, n in enumerate(names)})

    def rows(self) -> list[list[float]]:
        """Rows in field order, as plain numbers (JSON and ``all_gather_object`` friendly)."""
        cols = [getattr(self, f.name) for f in fields(self)]
        return np.stack(cols, axis=1).tolist() if len(self) else []

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Samples.empty()
        return Samples(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Samples)})

    def select(self, mask: np.ndarray) -> Samples:
        return Samples(**{f.name: getattr(self, f.name)[mask] for f in fields(self)})

    def plausible(self) -> np.ndarray:
        """``[n]`` bool: both times finite and within ``MIN_SAMPLE_MS .. MAX_SAMPLE_MS``, and features a group can
        have (``0 < tokens <= 2**40``, ``tokens <= sumsq <= tokens**2``, degree, tp and pp in 1..2**20): the
        module docstring's rule."""
        ok = np.ones(len(self), dtype=bool)
        with np.errstate(invalid="ignore", over="ignore"):
            for t in (self.compute_ms, self.wall_ms):
                ok &= np.isfinite(t) & (t >= MIN_SAMPLE_MS) & (t <= MAX_SAMPLE_MS)
            ok &= (self.tokens > 0) & (self.tokens <= MAX_GROUP_TOKENS)
            ok &= (self.sumsq >= self.tokens) & (self.sumsq <= self.tokens * self.tokens)
            for c in (self.degree, self.tp, self.pp):
                ok &= (c >= 1) & (c <= MAX_DEGREE)
        return ok

    def check(self, where: str, world_size: int) -> None:
        """Every column in range for a world of ``world_size`` ranks (one ValueError naming the first bad row)."""
        if not len(self):
            return
        bad = [("step", (self.step < 0) | (self.step >= MAX_STEP), "an integer in 0..2**53"),
               ("rank", (self.rank < 0) | (self.rank >= world_size), f"a rank of the world (0..{world_size - 1})"),
               ("tp", (self.tp < 1) | (self.tp > MAX_DEGREE), "an integer in 1..2**20"),
               ("pp", (self.pp < 1) | (self.pp > MAX_DEGREE), "an integer in 1..2**20"),
               ("degree", (self.degree < 1) | (self.degree > MAX_DEGREE), "an integer in 1..2**20"),
               ("engine", (self.engine < 0) | (self.engine >= len(ENGINES)), f"0..{len(ENGINES) - 1}")]
        for col in ("tokens", "sumsq", "compute_ms", "wall_ms"):
            v = getattr(self, col)
            with np.errstate(invalid="ignore"):
                bad.append((col, ~(np.isfinite(v) & (v >= 0)), "a finite number >= 0"))
        with np.errstate(invalid="ignore", over="ignore"):
            bad.append(("tokens", self.tokens > MAX_GROUP_TOKENS, "at most 2**40 (one group's tokens)"))
            bad.append(("sumsq", (self.sumsq < self.tokens) | (self.sumsq > self.tokens * self.tokens),
                        "between tokens and tokens**2 (a sum of squared segment lengths)"))
        for col, mask, want in bad:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                raise ValueError(f"{where}: row {i} has {col} {getattr(self, col)[i].item()!r}; expected {want}")

    def to_json(self) -> dict[str, Any]:
        return {"fields": [f.name for f in fields(self)], "rows": self.rows()}

    @staticmethod
    def from_json(d: Any, where: str = "calibration samples", world_size: int | None = None) -> Samples:
        """Samples from :meth:`to_json`: numbers only (no bools or strings), integers where the column is one,
        and with ``world_size`` every column in range (:meth:`check`); one ValueError line otherwise."""
        names = [f.name for f in fields(Samples)]
        if not isinstance(d, dict) or d.get("fields") != names or not isinstance(d.get("rows"), list):
            raise ValueError(f"{where}: expected {{'fields': {names}, 'rows': [...]}}")
        for i, row in enumerate(d["rows"]):
            if not isinstance(row, list) or len(row) != len(names) or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) for x in row):
                raise ValueError(f"{where}: row {i} must be a list of {len(names)} numbers, got {str(row)[:80]}")
            for name, x in zip(names, row):
                if abs(x) >= 1e308 or (name in Samples._INT and not (
                        math.isfinite(x) and x == int(x) and abs(x) < MAX_STEP)):
                    raise ValueError(f"{where}: row {i} has {name} {str(x)[:40]}; expected "
                                     f"{'an integer' if name in Samples._INT else 'a finite number'}")
        out = Samples.from_rows(d["rows"])
        if len(out) and not (np.isfinite(out.compute_ms).all() and np.isfinite(out.wall_ms).all()):
            raise ValueError(f"{where}: measured times must be finite")
        if world_size is not None:
            out.check(where, world_size)
        return out


def sample_rows(step: int, rank: int, groups: Sequence[tuple[int, int, int, int, Sequence[int]]],
                compute_ms: Sequence[float], wall_ms: Sequence[float]) -> Samples:
    """Samples of one rank's step: ``groups[i] = (tp, pp, degree, cp_inner, segment lengths)`` of the i-th
    microbatch it ran, with its measured times."""
    if not len(groups) == len(compute_ms) == len(wall_ms):
        raise ValueError(f"{len(groups)} microbatches but {len(compute_ms)} compute and {len(wall_ms)} wall times")
    rows = []
    for (tp, pp, d, inner, lengths), c, w in zip(groups, compute_ms, wall_ms):
        s = np.asarray(lengths, dtype=np.float64)
        rows.append([step, rank, tp, pp, d, ENGINES.index(engine_of(d, inner)), float(s.sum()),
                     float(s @ s), float(c), float(w)])
    return Samples.from_rows(rows)


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (never imports torch, never initializes CUDA itself)."""
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


class MicrobatchTimer:
    """Times a user's microbatches: ``with timer(mb): forward and backward``, then :meth:`samples`.

    Compute is this thread's CPU time (``time.thread_time``) or, with ``cuda=True``, CUDA events
    around the block; wall time is ``time.perf_counter`` (after a synchronize on CUDA). ``cuda=None``
    (the default): CUDA events when this process has initialized CUDA (its work is on a GPU), else CPU
    time; ``cuda=False`` in such a process is refused in one line (a CPU timer around asynchronous GPU
    work reads about 0). Padding microbatches (``mb.padding``, from ``cp=1``) are not recorded: they are
    not work the plan made.
    """

    def __init__(self, step: int, rank: int, *, tp: int = 1, pp: int = 1, cuda: bool | None = None) -> None:
        gpu = _cuda_in_use()
        if cuda is False and gpu:
            raise ValueError("MicrobatchTimer(cuda=False) in a process that runs CUDA work: a CPU timer around "
                             "asynchronous GPU kernels reads about 0; pass cuda=True (CUDA events) or leave cuda unset")
        self.step, self.rank, self.tp, self.pp = int(step), int(rank), tp, pp
        self.cuda = gpu if cuda is None else bool(cuda)
        self._groups: list[tuple[int, int, int, int, tuple[int, ...]]] = []
        self._compute: list[float] = []
        self._wall: list[float] = []
        self._events: list[Any] = []

    def __call__(self, mb: Any) -> MicrobatchTimer:
        self._mb = mb
        return self

    def __enter__(self) -> MicrobatchTimer:
        if self.cuda:
            import torch  # only when CUDA timing is asked for

            torch.cuda.synchronize()
            self._ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._ev[0].record()
        self._t = (time.thread_time(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            import torch

            self._ev[1].record()
            torch.cuda.synchronize()
        cpu, wall = time.thread_time() - self._t[0], time.perf_counter() - self._t[1]
        mb = self._mb
        if exc[0] is not None or getattr(mb, "padding", False):
            return
        self._groups.append((self.tp, self.pp, mb.degree, getattr(mb, "cp_inner", 1), tuple(mb.seq_lengths)))
        self._compute.append(self._ev[0].elapsed_time(self._ev[1]) if self.cuda else cpu * 1e3)
        self._wall.append(wall * 1e3)

    def samples(self) -> Samples:
        return sample_rows(self.step, self.rank, self._groups, self._compute, self._wall)


def gather_samples(mine: Samples, comm: Any = None) -> Samples:
    """Every rank's samples, the same on every rank: one ``all_gather_object`` through ``comm`` (what the
    caller's loop uses for collectives: ``torch.distributed`` in a DDP / accelerate loop; passed in, never
    imported here: ``balanced_loader`` has no route to ``torch.distributed``); ``mine`` alone without one or
    in a world of one process."""
    if comm is None or comm.get_world_size() == 1:
        return mine
    out: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(out, mine.rows())
    return Samples.concat([Samples.from_rows(r) for r in out])


def agree_cost(cost: Any, comm: Any = None) -> Any:
    """Rank 0's cost model on every rank (one ``broadcast_object_list`` through ``comm``, as
    :func:`gather_samples`): fits on identical data may still differ in their last bits on different hardware,
    and plans must not."""
    from balanced_loader.cost import CostModel

    if comm is None or comm.get_world_size() == 1:
        return cost
    box = [cost.to_dict()]
    comm.broadcast_object_list(box, src=0)
    return CostModel.from_dict(box[0], where="calibrated cost from rank 0")
