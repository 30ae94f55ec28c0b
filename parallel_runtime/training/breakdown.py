"""Where a step's time goes on each rank: the ``time_ms`` record of ``metrics.jsonl``.

Wall milliseconds per rank (lists by rank, like the other per-rank keys):

* ``data_wait``: waiting for the step's batch before the step (its plan and this rank's tokens);
* ``plan_check``: the plan fingerprints across ranks, contract 1, groups the plan lacks;
* ``pull``: the parameter pull outside forward/backward (overlapped: planning it and starting the
  first buckets; the rest arrives during the first forward and its waits are in ``exposed_comm``);
* ``forward_backward``: this rank's microbatches, pipeline and CP waits and the hooks' pulls and pushes
  included;
* ``push``: after forward/backward, the gradient buckets not yet sent and the wait for all of them;
* ``optimizer``: global-norm clipping (an all-reduce) and AdamW on the rank's shard;
* ``closed_loop``: ``train.calibrate`` / ``train.trace``: gathering the samples, the fits, the trace;
* ``exposed_comm``: time blocked on the optimizer's collectives anywhere in the step (pull and push
  buckets, exchange plans, the norm's all-reduce): the part of the communication not hidden;
* ``other``: the rest of the step (stats, the memory report, freeing memory, a compared policy's run).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from parallel_runtime.training.metrics import gather_rows

PHASES = ("data_wait", "plan_check", "pull", "forward_backward", "push", "optimizer", "closed_loop")
KEYS = (*PHASES, "exposed_comm", "other")


class StepTimes:
    """This rank's phase times in the step being run (milliseconds)."""

    def __init__(self) -> None:
        self.ms = dict.fromkeys(KEYS, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] += (time.perf_counter() - t0) * 1e3

    def add(self, name: str, seconds: float) -> None:
        self.ms[name] += seconds * 1e3

    def record(self, step_ms: float, comm_device: torch.device | None) -> dict[str, list[float]]:
        """Every rank's times by key (collective unless ``comm_device`` is None), then reset for the next
        step. ``step_ms``: this rank's step time so far (``other`` is what the phases leave of it)."""
        self.ms["other"] = max(0.0, step_ms - sum(self.ms[k] for k in PHASES if k != "data_wait"))
        mine = [self.ms[k] for k in KEYS]
        rows = [mine] if comm_device is None else gather_rows(mine, comm_device).tolist()  # [world][keys]
        self.ms = dict.fromkeys(KEYS, 0.0)
        return {k: [round(float(r[i]), 3) for r in rows] for i, k in enumerate(KEYS)}
