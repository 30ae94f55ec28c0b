"""Pipeline parallelism: layers split into stages, 1F1B over a pool's uneven microbatches.

Every rank of a pool runs the *pool's* 1F1B order over all its microbatch indices
``0..m-1`` (warmup ``pp - stage - 1`` forwards, then one forward one backward, then the
remaining backwards) and skips the microbatches its lane is in no group of. Because the
order at a stage depends only on ``(m, pp, stage)``, the lanes of a CP group meet every shared
forward and backward in the same order: one order for all lanes is what keeps CP groups inside a
pipeline deadlock-free (per-lane 1F1B over each lane's own microbatches can cross two groups'
collectives).

Stages exchange activations ``[tokens, hidden]`` forward and their gradients backward with
point-to-point ops between neighbouring stages of the same lane and tp index. The shapes come
from the plan on both sides (a lane's tokens of a group: padded segment lengths / degree), so
there is no shape handshake. The send an op leaves and the receive the next op needs go out as
one batch when they are with one peer (Megatron's ``send_forward_recv_backward``): on NCCL a
send completes only when its receive is posted and both directions of a rank pair share one
stream, so separate sends and receives of two stages cross and block (the replay of
``python -m parallel_runtime estimate`` checks every plan's order). Nothing in a step waits for
the device (:class:`Clock`). Only the first stage embeds tokens and only the last computes
the loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_runtime.engines.device import new_event, on_gpu, synchronize
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


# Test switch: True restores the order before pairing (every send and receive a separate ``isend`` / ``irecv``,
# sends posted right after their compute), which deadlocks on NCCL with pp >= 2 and 2+ microbatches (see
# diagnostics.estimate's replay); never set outside tests and the estimate's demonstration.
UNPAIRED = False

# Test switch: True restores the old CUDA clock, a device synchronize around every compute block, which
# deadlocks on NCCL with train.overlap and pp >= 2 (a stage waits there for a gradient bucket that its
# pipeline peer joins only after this stage's next send). Never set outside tests and the estimate.
SYNC_EACH_BLOCK = False

Send = tuple[torch.Tensor, int, int]  # (tensor, global peer, tag)
Recv = tuple[tuple[int, ...], int, int]  # (shape, global peer, tag)


@dataclass
class StageLink:
    """Point-to-point link of one rank to its previous and next stage (same lane, same tp index).

    NCCL runs both directions of a rank pair in order on one stream and a send completes only when its
    receive is posted, so two stages that each send before they receive block each other. Every
    transfer therefore goes through :meth:`post`: the send an op leaves behind and the receive the next
    op needs, when both are with one peer, go out as one ``batch_isend_irecv`` (Megatron's
    ``send_forward_recv_backward`` and ``send_backward_recv_forward``: one NCCL group, which
    completes as a whole); otherwise each is a batch of its own, in that order. Every batch uses the
    pipeline group's own communicator (batched NCCL point-to-point ops do), so all of a lane's
    transfers keep one order on one stream."""

    prev: int | None
    next: int | None
    group: dist.ProcessGroup | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    bytes_sent: int = 0
    _pending: list = field(default_factory=list)  # (works, buffers) of sends not yet waited

    def post(self, send: Send | None, recv: Recv | None) -> torch.Tensor | None:
        """Send ``send`` (not waited: sends are waited in :meth:`finish`) and receive ``recv``
        (waited, and returned on the device); one batch when both are with one peer."""
        if UNPAIRED:
            return self._unpaired(send, recv)
        ops: list[dist.P2POp] = []
        if send is not None:
            buf = self._send_buffer(send)
            ops.append(dist.P2POp(dist.isend, buf, send[1], group=self.group, tag=send[2]))
            if recv is None or recv[1] != send[1]:  # a batch of its own, before the receive's
                self._pending.append((dist.batch_isend_irecv(ops), buf))
                ops = []
            else:
                self._pending.append(([], buf))  # waited with the receive below: the buffer stays alive
        if recv is None:
            return None
        out = torch.empty(recv[0], dtype=self.dtype, device=self.device)
        rbuf = torch.empty(recv[0], dtype=self.dtype) if via_host(out, self.group) else out
        ops.append(dist.P2POp(dist.irecv, rbuf, recv[1], group=self.group, tag=recv[2]))
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        if rbuf is not out:
            out.copy_(rbuf)
        return out

    def _send_buffer(self, send: Send) -> torch.Tensor:
        buf = send[0].detach().contiguous()
        if via_host(buf, self.group):  # gloo moves CPU tensors only: CUDA tensors go through host memory
            buf = buf.cpu()
        self.bytes_sent += buf.numel() * buf.element_size()
        return buf

    def _unpaired(self, send: Send | None, recv: Recv | None) -> torch.Tensor | None:
        """The old order (test switch :data:`UNPAIRED`): separate ``isend`` and ``irecv`` calls."""
        if send is not None:
            buf = self._send_buffer(send)
            self._pending.append(([dist.isend(buf, send[1], group=self.group, tag=send[2])], buf))
        if recv is None:
            return None
        out = torch.empty(recv[0], dtype=self.dtype, device=self.device)
        rbuf = torch.empty(recv[0], dtype=self.dtype) if via_host(out, self.group) else out
        dist.irecv(rbuf, recv[1], group=self.group, tag=recv[2]).wait()
        if rbuf is not out:
            out.copy_(rbuf)
        return out

    def finish(self) -> None:
        """Wait for every posted send (end of a stretch of the schedule)."""
        for reqs, _ in self._pending:
            for r in reqs:
                r.wait()
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
    start and end (``time.perf_counter`` seconds) for the measured trace.

    On GPU nothing here waits for the device: a block only records two events on the stream, and
    :meth:`finish`, called once after the step, synchronizes once and reads them (a synchronize inside the
    step would wait for the collectives in flight, e.g. a gradient bucket that a pipeline peer joins only
    after this rank's next send: a deadlock on NCCL). There the device time of a block is also its wall
    time, and spans are placed from an event recorded when the clock was made."""

    timer = "thread-cpu"  # what measured the blocks: "thread-cpu" or "cuda-events" (calibration checks it)

    def __init__(self, device: torch.device, *, spans: bool = False) -> None:
        self.cuda = on_gpu(device)
        if self.cuda:
            self.timer = "cuda-events"
        self.total_s = 0.0
        self.cost_ms: dict[int, float] = {}  # microbatch -> compute ms (CUDA: after finish())
        self.wall_ms: dict[int, float] = {}  # microbatch -> wall ms of the same blocks (CUDA: after finish())
        self.spans: list[tuple[int, str, float, float]] | None = [] if spans else None  # (k, kind, t0, t1)
        self._key: tuple[int, str] = (-1, "")
        self._t0 = self._w0 = 0.0
        self._events: list[tuple[int, str, object, object]] = []  # (k, kind, start, end) CUDA events
        self._origin = None  # CUDA: an event at the clock's start, and the host time then
        self._origin_s = time.perf_counter()
        if self.cuda:
            self._origin = new_event()
            self._origin.record()

    def on(self, k: int, kind: str = "") -> Clock:
        """The next block belongs to microbatch ``k`` (``kind``: F or B, for the trace)."""
        self._key = (k, kind)
        return self

    def __enter__(self) -> Clock:
        if self.cuda:
            if SYNC_EACH_BLOCK:
                synchronize()
            start, end = new_event(), new_event()
            start.record()
            self._events.append((*self._key, start, end))
            return self
        self._t0 = time.thread_time()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        k, kind = self._key
        self._key = (-1, "")
        if self.cuda:
            self._events[-1][3].record()
            if SYNC_EACH_BLOCK:
                synchronize()
            return
        dt = time.thread_time() - self._t0
        self.total_s += dt
        self.cost_ms[k] = self.cost_ms.get(k, 0.0) + dt * 1e3
        w1 = time.perf_counter()
        self.wall_ms[k] = self.wall_ms.get(k, 0.0) + (w1 - self._w0) * 1e3
        if self.spans is not None:
            self.spans.append((k, kind, self._w0, w1))

    def finish(self) -> Clock:
        """Resolve the CUDA events into compute times: one synchronize, after the step (idempotent)."""
        if self._events:
            synchronize()
            for k, kind, start, end in self._events:
                ms = float(start.elapsed_time(end))
                self.total_s += ms / 1e3
                self.cost_ms[k] = self.cost_ms.get(k, 0.0) + ms
                self.wall_ms[k] = self.wall_ms.get(k, 0.0) + ms
                if self.spans is not None:
                    a = self._origin_s + float(self._origin.elapsed_time(start)) / 1e3
                    self.spans.append((k, kind, a, a + ms / 1e3))
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
        self._loss: torch.Tensor | None = None  # this rank's share of the step loss (last stage), on the device
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @property
    def loss_sum(self) -> float:
        """This rank's share of the step loss (last stage; read after the step: a host read waits for it)."""
        return 0.0 if self._loss is None else float(self._loss)

    @property
    def loss_tensor(self) -> torch.Tensor | None:
        """The same, unread (the step reads it once, after its last collective)."""
        return self._loss

    def _needs(self, kind: str, k: int, inp: StageInput | None) -> Recv | None:
        """The receive op ``kind`` of microbatch ``k`` starts with: activations from the previous stage
        before a forward, their gradient from the next stage before a backward (shapes from the plan)."""
        if kind == FORWARD:
            return None if self.first else ((inp.num_tokens, self.hidden), self.link.prev, _TAG_ACT)
        return None if self.last else (tuple(self._saved[k][1].shape), self.link.next, _TAG_GRAD)

    def forward(self, k: int, inp: StageInput, x: torch.Tensor | None) -> Send | None:
        """Microbatch ``k``'s forward on the received activations ``x`` (None on the first stage); returns
        the send it leaves (its output to the next stage), posted with the next op's receive."""
        if x is not None:
            x.requires_grad_()
        with self.clock.on(k, FORWARD):
            h = self.model.embed_tokens(inp.input_ids) if self.first else x
            h = self.model.run_layers(h, inp.position_ids, inp.attn)
            if self.last:
                out = self.model.head_loss(h, inp.labels, self.num_valid_tokens)
                loss = out.detach().double()  # summed in fp64, as Python floats were (the same bits)
                self._loss = loss if self._loss is None else self._loss + loss
            else:
                out = h
        self.sync_point()
        self._saved[k] = (x, out)
        return None if self.last else (out, self.link.next, _TAG_ACT)

    def backward(self, k: int, grad: torch.Tensor | None) -> Send | None:
        """Microbatch ``k``'s backward from the received output gradient (None on the last stage); returns
        the send it leaves (its input's gradient to the previous stage)."""
        x, out = self._saved.pop(k)
        with self.clock.on(k, BACKWARD):
            out.backward(grad)
        send = None if self.first else (x.grad, self.link.prev, _TAG_GRAD)
        del x, out, grad
        self.after_backward()
        return send

    def run(self, num_microbatches: int, stage: int, pp: int, inputs: dict[int, Callable[[], StageInput]],
            barriers: Sequence[int] = (), barrier: Callable[[], None] | None = None) -> int:
        """1F1B over the pool's microbatches; ``inputs[k]`` builds microbatch k's input (absent: skip).

        The send each op leaves goes out with the next op's receive (:meth:`StageLink.post`), so two
        neighbouring stages always meet in matching batches, whatever microbatches their lane skips
        (both stages of a lane skip the same ones).

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
            pending: Send | None = None  # the last op's send, not posted yet
            for kind, j in schedule_1f1b(hi - lo, pp, stage):
                k = lo + j
                if k not in inputs:
                    continue
                inp = inputs[k]() if kind == FORWARD else None
                need = self._needs(kind, k, inp)
                if need is not None:
                    self.sync_point()
                got = self.link.post(pending, need) if pending is not None or need is not None else None
                pending = self.forward(k, inp, got) if kind == FORWARD else self.backward(k, got)
            if pending is not None:
                self.link.post(pending, None)
            self.link.finish()
        assert not self._saved
        return len(inputs)
