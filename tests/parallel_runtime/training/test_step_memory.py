"""One step's memory record as one context: a fresh peak per step, the parts noted before the push."""

from __future__ import annotations

import torch

from parallel_runtime.training.layout import LocalParam, ParamSpec
from parallel_runtime.training.peaks import PeakProbe
from parallel_runtime.training.step_memory import StepMemory


def test_the_step_context_reads_the_peak_and_keeps_the_noted_parts() -> None:
    mem = StepMemory(PeakProbe(torch.device("cpu"), interval_s=None))
    model = torch.nn.Linear(64, 64, bias=False)
    params = [LocalParam(spec=ParamSpec(name="w", shape=(64, 64)), tensor=model.weight)]
    try:
        with mem.step():
            saved = mem.watch(model, params)
            x = torch.randn(32, 64, requires_grad=True)
            with saved.hooks():
                model(x).pow(2).sum().backward()
            mem.between()
            mem.note(params, saved)
        rec = mem.figures(optimizer_bytes=7)
        assert list(rec) == ["peak_bytes", "base_bytes", "params_bytes", "grads_bytes", "activations_bytes",
                             "optimizer_bytes", "peak_exact", "heap_trims"]
        assert rec["params_bytes"] == rec["grads_bytes"] == 64 * 64 * 4 and rec["optimizer_bytes"] == 7
        assert rec["activations_bytes"] >= 32 * 64 * 4  # the input autograd kept for the weight's gradient
        assert rec["peak_bytes"] >= rec["base_bytes"] > 0
        with mem.step():  # the next step starts without the last one's parts
            pass
        assert "params_bytes" not in mem.figures()
    finally:
        mem.close()
