"""What the runtime asks of a GPU, in one place: is a tensor on one, timing events, host-to-device copies.

Every CUDA-only branch of the engines goes through these functions, so that
:mod:`parallel_runtime.diagnostics.estimate` can run the GPU code paths on fake CPU tensors: it sets
:data:`EMULATION` for the duration of an estimate (nothing else ever does), and then :func:`on_gpu` is
true for every tensor, events are the emulation's (no device), and a device synchronize is reported to
it (the NCCL replay treats one as "block until this rank's queued work is done").

Host-to-device copies (:func:`to_device`): on CUDA a plain ``.to(device)`` of pageable host memory
makes the host wait for the stream; the runtime's per-microbatch index arrays go through pinned memory
with ``non_blocking=True`` instead (the pinned block is kept by torch's host allocator until the copy
ran). On CPU the numpy array is wrapped, no copy, as before.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class Emulation(Protocol):
    """GPU semantics on fake CPU tensors (``diagnostics.estimate``)."""

    def event(self) -> Any: ...  # an object with record() and elapsed_time(other) -> ms

    def synchronize(self) -> None: ...  # a device-wide synchronize was asked for


EMULATION: Emulation | None = None  # set only by diagnostics.estimate, for the duration of one estimate


def on_gpu(x: torch.Tensor | torch.device) -> bool:
    """Whether ``x`` (a tensor or a device) is on a CUDA device (always, under the estimate's emulation)."""
    if EMULATION is not None:
        return True
    return (x.type if isinstance(x, torch.device) else x.device.type) == "cuda"


def new_event() -> Any:
    """A timing event on the current stream's device."""
    if EMULATION is not None:
        return EMULATION.event()
    return torch.cuda.Event(enable_timing=True)


def synchronize() -> None:
    """Wait for all the device's queued work (never inside a step: see the NCCL notes in docs/runtime.md)."""
    if EMULATION is not None:
        EMULATION.synchronize()
        return
    torch.cuda.synchronize()


def to_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on ``device``: on CUDA through pinned memory without blocking the host, else as is."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if EMULATION is not None:
        return t.clone()  # the device copy, a (fake) tensor of its own
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
