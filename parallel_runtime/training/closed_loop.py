"""The runtime's side of closed-loop planning (``train.calibrate``) and of the measured trace (``train.trace``).

After every step each rank's per-microbatch samples (:class:`~balanced_loader.calibration.Samples`:
the features the cost model uses and the compute and wall time measured for them) are all-gathered,
so every rank holds the same window; every ``calibration.every`` steps the loader's calibrator fits
the cost model and the per-rank speeds, rank 0's fit is broadcast (fits on the same data can differ
in their last bits across hardware; plans must not), and the loaders plan with it from the first step
none of them has planned yet. The compare loaders (``policy.compare``) get the same model, so the
balance report compares policies on one cost model.

With ``train.trace`` every rank's compute blocks (microbatch, forward or backward, wall start and end)
go to rank 0, which writes ``OUT/trace.json`` (trace-event JSON, a track per rank) at the end of the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from balanced_loader.calibration.samples import Samples
from balanced_loader.cost import CostModel
from balanced_loader.loader import BalancedLoader, StepBatch
from parallel_runtime.engines.device import on_gpu
from parallel_runtime.training.step import FBResult

# Test seam: ``(rank, samples) -> samples`` applied to this rank's measurements before they are shared, so
# CI tests the mechanism with injected timings (a slow rank) instead of timing a shared machine.
MEASURED: Callable[[int, Samples], Samples] | None = None


def check_timer(timer: str, *, gpu: bool) -> None:
    """Calibration samples on a GPU must be device time: CPU timers there measure kernel launches (the
    host runs ahead of the device), which would fit a cost model to nothing. Refuse them."""
    if gpu and timer != "cuda-events":
        raise RuntimeError(f"calibration on a GPU needs device time from CUDA events; this step was timed by "
                           f"'{timer}' (set train.calibrate: false, or run the runtime's own step, which times "
                           f"compute with CUDA events)")


class ClosedLoop:
    """Per-step calibration and trace collection for one rank (collective when either is on)."""

    def __init__(self, *, calibrate: bool, trace: bool, rank: int, world_size: int, reference: bool,
                 loader: BalancedLoader, others: Sequence[BalancedLoader], out_dir: str,
                 device: torch.device | None = None) -> None:
        """``device``: where the steps run; on a GPU every sample must be device time (CUDA events)."""
        self.calibrate, self.trace = calibrate, trace
        self.gpu = device is not None and on_gpu(device)
        self.rank, self.world_size, self.reference = rank, world_size, reference
        self.loader, self.others = loader, list(others)
        self.path = os.path.join(out_dir, "trace.json")
        self.records: list[Any] = []  # rank 0: the trace so far (TraceRecord)
        self.step_args: dict[int, dict[str, Any]] = {}
        self.clock_ms = 0.0  # rank 0: where the next step starts on the trace's time axis

    @property
    def active(self) -> bool:
        return self.calibrate or self.trace

    def _gather(self, obj: Any) -> list[Any]:
        if self.reference:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _agree(self, cost: CostModel) -> CostModel:
        """Rank 0's fitted model on every rank."""
        if self.reference:
            return cost
        box = [cost.to_dict()]
        dist.broadcast_object_list(box, src=0)
        return CostModel.from_dict(box[0], where="calibrated cost from rank 0")

    def after_step(self, batch: StepBatch, res: FBResult, step_ms: float) -> dict[str, Any]:
        """Feed this step's measurements; returns what goes into the step's metrics record (with
        ``closed_loop_ms``, this rank's time in it: gathers, fits, trace)."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        if self.calibrate:
            check_timer(res.timer, gpu=self.gpu)
            mine = res.samples if MEASURED is None else MEASURED(self.rank, res.samples)
            rows = self._gather(mine.rows())
            samples = Samples.concat([Samples.from_rows(r) for r in rows])
            up = self.loader.observe(batch.step, samples, gathered=True, agree=self._agree)
            if up is not None:
                first = self.loader.costs.entries[-1][0]
                for ld in self.others:
                    ld.set_cost(self.loader.costs.at(first))
                out["calibration"] = {**up.to_json(), "from_step": first}
        if self.trace:
            spans = self._gather(self._spans(batch, res))
            if self.rank == 0:
                self._add(batch, spans, step_ms)
        out["closed_loop_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return out

    # ---- the measured trace ----------------------------------------------------------------
    def _spans(self, batch: StepBatch, res: FBResult) -> list[tuple]:
        """This rank's compute blocks of the step: (microbatch, F|B, start, end from the step's forward/backward
        start, seconds), with the group's shape, lanes and first segments."""
        mbs = {mb.k: mb for mb in batch.microbatches if not mb.padding}
        out = []
        for k, kind, a, b in res.spans:
            mb = mbs.get(k)
            pool = batch.plan.pools[mb.pool] if mb is not None else None
            out.append((k, kind, a - res.start_s, b - res.start_s,
                        (mb.pool, mb.stage, pool.tp, pool.pp, mb.lanes, tuple(mb.segments[:8])) if mb else None))
        return out

    def _add(self, batch: StepBatch, spans: list[list[tuple]], step_ms: float) -> None:
        from balanced_loader.diagnostics.trace import TraceRecord

        base = self.clock_ms / 1e3  # steps laid end to end by rank 0's step time
        for rank, blocks in enumerate(spans):
            for k, kind, a, b, where in blocks:
                pool, stage, tp, pp, lanes, segs = where if where is not None else (-1, -1, 0, 0, (), ())
                self.records.append(TraceRecord(
                    rank=rank, step=batch.step, start_s=base + a, end_s=base + b, microbatch=k, pool=pool,
                    stage=stage, tp=tp, pp=pp, lanes=tuple(lanes), segments=tuple(tuple(x) for x in segs),
                    name=f"mb{k} {'fwd' if kind == 'F' else 'bwd'} d{len(lanes) or 1}"))
        self.step_args[batch.step] = {"fingerprint": batch.plan.fingerprint(), "measured_step_ms": round(step_ms, 3)}
        self.clock_ms += step_ms

    def close(self) -> None:
        """Rank 0 writes ``OUT/trace.json`` (complete or absent; the format of ``balanced-loader trace``)."""
        if not self.trace or self.rank != 0 or not self.records:
            return
        from balanced_loader.diagnostics.trace import write_trace

        write_trace(self.path, self.records, world_size=self.world_size, step_args=self.step_args, t0_s=0.0,
                    meta={"source": "measured"})
