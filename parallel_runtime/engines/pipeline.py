"""Pipeline parallelism: layers split into stages, 1F1B over a pool's uneven microbatches.

Every rank of a pool runs the *pool's* 1F1B order over all its microbatch indices
``0..m-1`` (warmup ``pp - stage - 1`` forwards, then one forward one backward, then the
remaining backwards) and skips the microbatches its lane is in no group of. Because the
order at a stage depends only on ``(m, pp, stage)``, the lanes of a CP group meet every shared
forward and backward in the same order, and with sends posted asynchronously (waited at the
end of the step) no rank waits on an op its peer has not reached: one order for all lanes is
what keeps CP groups inside a pipeline deadlock-free (per-lane 1F1B over each lane's own
microbatches can cross two groups' collectives).

Stages exchange activations ``[tokens, hidden]`` forward and their gradients backward with
point-to-point ops between neighbouring stages of the same lane and tp index. The shapes come
from the plan on both sides (a lane's tokens of a group: padded segment lengths / degree), so
there is no shape handshake. Only the first stage embeds tokens and only the last computes
the loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_runtime.engines.tensor import via_host
from parallel_runtime.model import Transformer

FORWARD, BACKWARD = "F", "B"
_TAG_ACT, _TAG_GRAD = 11, 12


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of ``stage``: contiguous, sizes differ by at most one (earlier stages larger)."""
    if not 0 <= stage < pp or num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers into {pp} stages (stage {stage})")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def schedule_1f1b(num_microbatches: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: ``[(F|B, k)]``, every k forward once and backward once."""
    m = num_microbatches
    warmup = min(pp - stage - 1, m)
    ops: list[tuple[str, int]] = [(FORWARD, k) for k in range(warmup)]
    for i in range(m - warmup):
        ops.append((FORWARD, warmup + i))
        ops.append((BACKWARD, i))
    ops.extend((BACKWARD, k) for k in range(m - warmup, m))
    return ops


@dataclass
class StageLink:
    """Point-to-point link of one rank to its previous and next stage (same lane, same tp index)."""

    prev: int | None
    next: int | None
    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    _pending: list = field(default_factory=list)  # (work, tensor) of sends not yet waited

    def _send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        buf = t.detach().contiguous()
        if via_host(buf, self.group):  # gloo moves CPU tensors only: CUDA tensors go through host memory
            buf = buf.cpu()
        self._pending.append((dist.isend(buf, peer, group=self.group, tag=tag), buf))
        self.bytes_sent += buf.numel() * buf.element_size()

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, peer: int,
              tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        buf = torch.empty(shape, dtype=dtype) if via_host(out, self.group) else out
        dist.irecv(buf, peer, group=self.group, tag=tag).wait()
        if buf is not out:
            out.copy_(buf)
        return out

    def send_forward(self, h: torch.Tensor) -> None:
        assert self.next is not None
        self._send(h, self.next, _TAG_ACT)

    def recv_forward(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert self.prev is not None
        return self._recv(shape, dtype, device, self.prev, _TAG_ACT)

    def send_backward(self, g: torch.Tensor) -> None:
        assert self.prev is not None
        self._send(g, self.prev, _TAG_GRAD)

    def recv_backward(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert self.next is not None
        return self._recv(shape, dtype, device, self.next, _TAG_GRAD)

    def finish(self) -> None:
        """Wait for every posted send (end of the step)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


@dataclass(frozen=True, kw_only=True)
class StageInput:
    """What one stage needs to run one microbatch (tensors already on the device)."""

    num_tokens: int  # this lane's tokens of the group (padded lengths / degree)
    position_ids: torch.Tensor  # [T]
    input_ids: torch.Tensor | None  # [T], first stage only
    labels: torch.Tensor | None  # [T], last stage only
    attn: Callable  # (q, k, v) -> o bound to the microbatch (local or a CP engine)


class Clock:
    """Accumulates compute time: thread CPU time on CPU (blocked waits cost none), CUDA events on GPU (the
    device's own time); both the contention-free cost of the work. Per microbatch (``with clock.on(k)``) it
    also keeps that cost and the wall time of the same blocks (what a slow or shared device really took;
    waits between the blocks, on pipeline peers, are outside them), and with ``spans`` every block's wall
    start and end (``time.perf_counter`` seconds) for the measured trace."""

    def __init__(self, device: torch.device, *, spans: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.total_s = 0.0
        self.cost_ms: dict[int, float] = {}  # microbatch -> compute ms (CUDA: after finish())
        self.wall_ms: dict[int, float] = {}  # microbatch -> wall ms of the same blocks
        self.spans: list[tuple[int, str, float, float]] | None = [] if spans else None  # (k, kind, t0, t1)
        self._key: tuple[int, str] = (-1, "")
        self._t0 = self._w0 = 0.0
        self._events: list[tuple[int, object, object]] = []  # (k, start, end) CUDA events

    def on(self, k: int, kind: str = "") -> Clock:
        """The next block belongs to microbatch ``k`` (``kind``: F or B, for the trace)."""
        self._key = (k, kind)
        return self

    def __enter__(self) -> Clock:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((self._key[0], start, end))
        else:
            self._t0 = time.thread_time()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        k, kind = self._key
        if self.cuda:
            self._events[-1][2].record()
            torch.cuda.synchronize()
        else:
            dt = time.thread_time() - self._t0
            self.total_s += dt
            self.cost_ms[k] = self.cost_ms.get(k, 0.0) + dt * 1e3
        w1 = time.perf_counter()
        self.wall_ms[k] = self.wall_ms.get(k, 0.0) + (w1 - self._w0) * 1e3
        if self.spans is not None:
            self.spans.append((k, kind, self._w0, w1))
        self._key = (-1, "")

    def finish(self) -> Clock:
        """Resolve the CUDA events into compute times (one synchronize per step, not per block)."""
        if self._events:
            torch.cuda.synchronize()
            for k, start, end in self._events:
                ms = float(start.elapsed_time(end))
                self.total_s += ms / 1e3
                self.cost_ms[k] = self.cost_ms.get(k, 0.0) + ms
            self._events.clear()
        return self


def _nothing() -> None:
    pass


class PipelineStage:
    """Runs the forward and backward of microbatches on one stage of one lane."""

    def __init__(self, model: Transformer, link: StageLink, *, num_valid_tokens: int, dtype: torch.dtype,
                 device: torch.device, clock: Clock, sync_point: Callable[[], None] | None = None,
                 after_backward: Callable[[], None] | None = None) -> None:
        """``sync_point``: called after every forward and before every wait on a peer (a receive from a
        neighbouring stage, a barrier), e.g. to finish parameter pulls in flight there;
        ``after_backward``: called after every microbatch's backward (e.g. to release freed memory)."""
        self.model = model
        self.sync_point = sync_point or _nothing
        self.after_backward = after_backward or _nothing
        self.link = link
        self.first = model.first_stage
        self.last = model.last_stage
        self.hidden = model.config.hidden
        self.num_valid_tokens = num_valid_tokens
        self.dtype, self.device, self.clock = dtype, device, clock
        self.loss_sum = 0.0  # this rank's share of the step loss (last stage)
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def forward(self, k: int, inp: StageInput) -> None:
        shape = (inp.num_tokens, self.hidden)
        x = None
        if not self.first:
            self.sync_point()
            x = self.link.recv_forward(shape, self.dtype, self.device).requires_grad_()
        with self.clock.on(k, FORWARD):
            h = self.model.embed_tokens(inp.input_ids) if self.first else x
            h = self.model.run_layers(h, inp.position_ids, inp.attn)
            if self.last:
                out = self.model.head_loss(h, inp.labels, self.num_valid_tokens)
                self.loss_sum += float(out.detach())
            else:
                out = h
        self.sync_point()
        if not self.last:
            self.link.send_forward(out)
        self._saved[k] = (x, out)

    def backward(self, k: int) -> None:
        x, out = self._saved.pop(k)
        grad = None
        if not self.last:
            self.sync_point()
            grad = self.link.recv_backward(tuple(out.shape), self.dtype, self.device)
        with self.clock.on(k, BACKWARD):
            out.backward(grad)
        if not self.first:
            self.link.send_backward(x.grad)
        del x, out, grad
        self.after_backward()

    def run(self, num_microbatches: int, stage: int, pp: int, inputs: dict[int, Callable[[], StageInput]],
            barriers: Sequence[int] = (), barrier: Callable[[], None] | None = None) -> int:
        """1F1B over the pool's microbatches; ``inputs[k]`` builds microbatch k's input (absent: skip).

        ``barriers`` (contract 1, sorted): before microbatch ``k`` every rank of the pool waits
        (``barrier()``), members of a group in ``k`` or not. A 1F1B pipeline cannot stop in its
        steady state, so each stretch between barriers runs as its own 1F1B schedule and drains
        before the barrier (gradients only accumulate, so the result is the same).
        Returns the number of microbatches this rank ran."""
        edges = [0, *barriers, num_microbatches]
        for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
            if i:
                assert barrier is not None, "a plan with barriers needs the pool's barrier"
                self.sync_point()
                barrier()
            for kind, j in schedule_1f1b(hi - lo, pp, stage):
                k = lo + j
                if k not in inputs:
                    continue
                if kind == FORWARD:
                    self.forward(k, inputs[k]())
                else:
                    self.backward(k)
            self.link.finish()
        assert not self._saved
        return len(inputs)
