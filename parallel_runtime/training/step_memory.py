"""This rank's memory in one step, as one context around the step (the trainer's ``memory`` record).

:meth:`StepMemory.step` opens a step: free heap pages go back and the peak starts afresh
(:class:`~parallel_runtime.training.peaks.PeakProbe`); its exit reads the step's peak. Inside it
:meth:`StepMemory.watch` hooks the model a pass runs (samples before its modules, a counter of the
activations autograd saves), :meth:`StepMemory.between` is the sample and heap trim between phases, and
:meth:`StepMemory.note` keeps the working parameters', gradients' and saved activations' bytes before
the push. :meth:`StepMemory.figures` is this rank's record of the step (keys in docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from parallel_runtime.training.layout import LocalParam, grad_of
from parallel_runtime.training.metrics import SavedActivations, tensor_bytes
from parallel_runtime.training.peaks import PeakProbe


class StepMemory:
    """The peak probe and the memory parts of the step being run."""

    def __init__(self, probe: PeakProbe) -> None:
        self.probe = probe
        self._parts: dict[str, int] = {}  # noted before the push (note)
        self._peak = 0  # read when the last step's context closed

    @contextmanager
    def step(self) -> Iterator[StepMemory]:
        """Around one step: a heap trim and a fresh peak on entry, the peak read on a normal exit."""
        self.between()
        self.probe.reset()
        self._parts = {}
        yield self
        self._peak = self.probe.peak()

    def watch(self, model: nn.Module, params: Sequence[LocalParam]) -> SavedActivations:
        """Samples in ``model``'s hooks; returns the counter of the activations a pass of it saves (its
        parameters left out), to be entered around the forward/backward (:meth:`SavedActivations.hooks`)."""
        self.probe.watch(model)
        return SavedActivations(exclude=[lp.tensor for lp in params])

    def between(self) -> None:
        """Between the step's phases: a memory sample, and freed heap pages back to the OS where that can
        lower the peak (CPU only: see :meth:`PeakProbe.between_phases`)."""
        self.probe.between_phases()

    def note(self, params: Sequence[LocalParam], saved: SavedActivations) -> None:
        """This rank's working parameters, their gradients and the peak of saved activations, before the push."""
        self._parts = {"params_bytes": tensor_bytes(lp.tensor for lp in params),
                       "grads_bytes": tensor_bytes(grad_of(lp.tensor) for lp in params),
                       "activations_bytes": saved.peak}

    def figures(self, **held: int) -> dict[str, int]:
        """This rank's record of the last step: peak, base, the noted parts, ``held`` (bytes the caller
        holds beside them), whether the peak is exact and the heap trims."""
        return {"peak_bytes": self._peak, "base_bytes": self.probe.base, **self._parts, **held,
                "peak_exact": int(self.probe.exact), "heap_trims": self.probe.trims}

    def close(self) -> None:
        self.probe.close()
