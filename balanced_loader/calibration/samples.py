"""What a rank measured, per microbatch, in the features the cost model uses.

One **sample** is one rank's part of one group in one microbatch: the group's pool shape
``(tp, pp)``, its degree ``d``, the engine that ran it, its tokens ``sum s`` and ``sum s^2`` over
its segments (unpadded), and two measured times of the same compute:

* ``compute_ms``: the contention-free cost (thread CPU time on CPU, CUDA events on GPU): what
  the device needs for the work, whatever else runs beside it;
* ``wall_ms``: wall time of the same compute blocks (what a slow or shared device really takes;
  the waits between microbatches on pipeline peers are outside the blocks).

Contract 2 predicts one stage's share of a group as ``(beta + (q sum s^2 + l sum s) / d +
[d > 1] B sum s / (d bw(d) 1e6)) / pp``; :mod:`balanced_loader.calibration.fit` fits ``beta, q, l, B``
from these samples. :class:`Samples` keeps them as columns (a window of a few thousand rows).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

ENGINES = ("local", "ring", "ulysses", "nested")  # engine codes in Samples.engine


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

    def to_json(self) -> dict[str, Any]:
        return {"fields": [f.name for f in fields(self)], "rows": self.rows()}

    @staticmethod
    def from_json(d: Any, where: str = "calibration samples") -> Samples:
        names = [f.name for f in fields(Samples)]
        if not isinstance(d, dict) or d.get("fields") != names or not isinstance(d.get("rows"), list):
            raise ValueError(f"{where}: expected {{'fields': {names}, 'rows': [...]}}")
        try:
            out = Samples.from_rows(d["rows"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: every row must hold {len(names)} numbers") from None
        if len(out) and not (np.isfinite(out.compute_ms).all() and np.isfinite(out.wall_ms).all()):
            raise ValueError(f"{where}: measured times must be finite")
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


class MicrobatchTimer:
    """Times a user's microbatches: ``with timer(mb): forward and backward``, then :meth:`samples`.

    Compute is this thread's CPU time (``time.thread_time``) or, with ``cuda=True``, CUDA events
    around the block; wall time is ``time.perf_counter`` (after a synchronize on CUDA). Padding
    microbatches (``mb.padding``, from ``cp=1``) are not recorded: they are not work the plan made.
    """

    def __init__(self, step: int, rank: int, *, tp: int = 1, pp: int = 1, cuda: bool = False) -> None:
        self.step, self.rank, self.tp, self.pp, self.cuda = int(step), int(rank), tp, pp, cuda
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


def gather_samples(mine: Samples) -> Samples:
    """Every rank's samples, the same on every rank: one ``all_gather_object`` over the initialized default
    process group (a DDP / accelerate loop); ``mine`` alone when there is none or one process."""
    import sys

    # never imported for this (balanced_loader does not depend on torch.distributed): a DDP loop has it already
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine.rows())
    return Samples.concat([Samples.from_rows(r) for r in out])


def agree_cost(cost: Any) -> Any:
    """Rank 0's cost model on every rank (one ``broadcast_object_list`` when a default process group of
    several processes is initialized): fits on identical data may still differ in their last bits on
    different hardware, and plans must not."""
    import sys

    from balanced_loader.cost import CostModel

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return cost
    box = [cost.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return CostModel.from_dict(box[0], where="calibrated cost from rank 0")
