"""One rank of a real world, on this machine: the fake process group, fake tensors, GPU code paths.

:class:`FakeRank` is the context :mod:`parallel_runtime.diagnostics.estimate` runs a rank's real step in:

* torch's fake process group (``init_process_group("fake", store=FakeStore(), rank=r, world_size=W)``):
  every collective of a 64-rank world returns at once, moving nothing;
* ``FakeTensorMode``: every tensor is a fake CPU tensor (shapes, dtypes and storages, no data), and
  :class:`~parallel_runtime.diagnostics.memtrack.MemoryTracker` inside it counts live bytes by kind;
* the runtime's GPU semantics (:data:`parallel_runtime.engines.device.EMULATION`): GPU branches taken,
  timing events that record nothing, a device synchronize noted in the trace;
* a flash-attention stand-in (:func:`flash_stand_in`) installed as ``flash_attn``: the kernel a CUDA run
  uses, with the tensors it saves for the backward and its backward workspace, on fake tensors;
* every ``torch.distributed`` call the runtime makes is recorded in order (:class:`CommTrace`): kind,
  communicator, peer, bytes, batch, and the waits on its handles, for the NCCL replay
  (:mod:`parallel_runtime.diagnostics.replay`). A handle's ``is_completed()`` answers False (a peer
  may be late: the runtime then goes on without waiting, which is the order the replay must check).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel_runtime.diagnostics.memtrack import MemoryTracker
from parallel_runtime.engines import device as D

# ---- the communication trace ------------------------------------------------------------------------


@dataclass(slots=True)
class CommOp:
    """One communication op a rank posted."""

    index: int  # position in this rank's trace (ops only)
    kind: str  # send | recv | all_reduce | all_gather | all_to_all | barrier | broadcast | ...
    comm: str  # the communicator's label: "world", "exchange" or the group's ranks joined by ","
    group: tuple[int, ...]  # the group's global ranks
    peer: int = -1  # send/recv: the global peer rank
    nbytes: int = 0  # bytes this rank sends (a receive: bytes it receives)
    batch: int = -1  # batch_isend_irecv call this op belongs to (-1: none)
    splits: tuple[int, ...] = ()  # all_to_all: bytes to each group member (in group order)
    phase: str = ""  # the estimate's phase when posted (pull, forward_backward, push, ...)


@dataclass
class CommTrace:
    """A rank's ordered communication: ``events`` are ``("op", CommOp)``, ``("wait", op indices)`` and
    ``("sync", None)`` (a device-wide synchronize)."""

    rank: int
    events: list[tuple[str, Any]] = field(default_factory=list)
    ops: list[CommOp] = field(default_factory=list)
    phase: str = ""
    _batches: int = 0

    def op(self, **kw: Any) -> CommOp:
        o = CommOp(index=len(self.ops), phase=self.phase, **kw)
        self.ops.append(o)
        self.events.append(("op", o))
        return o

    def wait(self, indices: tuple[int, ...]) -> None:
        self.events.append(("wait", indices))

    def sync(self) -> None:
        self.events.append(("sync", None))

    def new_batch(self) -> int:
        self._batches += 1
        return self._batches - 1


class _Work:
    """A recorded handle: ``wait()`` is noted (the ops it covers), ``is_completed()`` says not yet."""

    def __init__(self, work: Any, trace: CommTrace, ops: tuple[int, ...]) -> None:
        self._work, self._trace, self._ops = work, trace, ops

    def wait(self, *a: Any, **k: Any) -> bool:
        self._trace.wait(self._ops)
        if self._work is not None:
            self._work.wait()
        return True

    def is_completed(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recorder:
    """Replacements for the ``torch.distributed`` calls the runtime makes; each records, then runs the fake op."""

    def __init__(self, trace: CommTrace, labels: dict[int, str]) -> None:
        self.trace, self.labels = trace, labels
        self.orig = {n: getattr(c10d, n) for n in _WRAPPED}
        self._batch = -1  # inside batch_isend_irecv: its id

    def _group(self, group: Any) -> tuple[str, tuple[int, ...]]:
        g = group if group is not None else c10d._get_default_group()
        ranks = tuple(dist.get_process_group_ranks(g))
        label = self.labels.get(id(g))
        if label is None:
            label = "world" if g is c10d._get_default_group() else ",".join(map(str, ranks))
        return label, ranks

    def _coll(self, kind: str, group: Any, nbytes: int, async_op: bool, run, splits: tuple[int, ...] = ()) -> Any:
        label, ranks = self._group(group)
        o = self.trace.op(kind=kind, comm=label, group=ranks, nbytes=nbytes, splits=splits)
        work = run()
        if async_op:
            return _Work(work, self.trace, (o.index,))
        self.trace.wait((o.index,))
        return work

    # p2p --------------------------------------------------------------------------------------
    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
        label, ranks = self._group(group)
        o = self.trace.op(kind=kind, comm=label, group=ranks, peer=int(peer), nbytes=_nbytes(tensor),
                          batch=self._batch)
        work = self.orig["isend" if kind == "send" else "irecv"](tensor, peer, group, tag)
        return work if self._batch >= 0 else _Work(work, self.trace, (o.index,))

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._p2p("send", tensor, dst if dst is not None else dist.get_global_rank(group, group_dst), group,
                         tag)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return self._p2p("recv", tensor, src if src is not None else dist.get_global_rank(group, group_src), group,
                         tag)

    def batch_isend_irecv(self, p2p_op_list):
        self._batch = self.trace.new_batch()
        first = len(self.trace.ops)
        try:
            works = self.orig["batch_isend_irecv"](p2p_op_list)
        finally:
            self._batch = -1
        ops = tuple(range(first, len(self.trace.ops)))  # NCCL: one group call, waited as a whole
        return [_Work(w, self.trace, ops) for w in works]

    # collectives ------------------------------------------------------------------------------
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return self._coll("all_reduce", group, _nbytes(tensor), async_op,
                          lambda: self.orig["all_reduce"](tensor, op, group, async_op))

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return self._coll("all_gather", group, _nbytes(tensor), async_op,
                          lambda: self.orig["all_gather"](tensor_list, tensor, group, async_op))

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._coll("all_gather", group, _nbytes(input_tensor), async_op,
                          lambda: self.orig["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        n = dist.get_world_size(group)
        per = input.element_size() * (input.numel() // max(input.shape[0], 1) if input.dim() else 1)
        splits = tuple(int(s) * per for s in input_split_sizes) if input_split_sizes is not None else \
            tuple([_nbytes(input) // n] * n)
        return self._coll("all_to_all", group, _nbytes(input), async_op,
                          lambda: self.orig["all_to_all_single"](output, input, output_split_sizes,
                                                                 input_split_sizes, group, async_op), splits)

    def barrier(self, group=None, async_op=False, device_ids=None):
        return self._coll("barrier", group, 0, async_op, lambda: self.orig["barrier"](group, async_op, device_ids))

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        return self._coll("broadcast", group, _nbytes(tensor), async_op,
                          lambda: self.orig["broadcast"](tensor, src, group, async_op, group_src))


_WRAPPED = ("isend", "irecv", "batch_isend_irecv", "all_reduce", "all_gather", "all_gather_into_tensor",
            "all_to_all_single", "barrier", "broadcast")


@contextlib.contextmanager
def recording(trace: CommTrace, labels: dict[int, str]) -> Iterator[_Recorder]:
    """``torch.distributed``'s calls recorded into ``trace`` (both the package's and c10d's names: ``P2POp``
    checks its op against c10d's). ``labels``: id(group) -> communicator label for groups that share ranks."""
    rec = _Recorder(trace, labels)
    saved = {n: (getattr(dist, n), getattr(c10d, n)) for n in _WRAPPED}
    fns = {n: getattr(rec, n) for n in _WRAPPED}  # one object per name: batch_isend_irecv tests `op is isend`
    try:
        for n in _WRAPPED:
            setattr(dist, n, fns[n])
            setattr(c10d, n, fns[n])
        yield rec
    finally:
        for n, (a, b) in saved.items():
            setattr(dist, n, a)
            setattr(c10d, n, b)


# ---- GPU semantics on fake tensors ---------------------------------------------------------------


class _NoEvent:
    def record(self, *a: Any) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Emulation:
    def __init__(self, trace: CommTrace) -> None:
        self.trace = trace

    def event(self) -> _NoEvent:
        return _NoEvent()

    def synchronize(self) -> None:
        self.trace.sync()


# ---- the flash-attention stand-in ------------------------------------------------------------------


def _attention_workspace(tracker: MemoryTracker | None, q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """What flash-attention 2's varlen backward allocates beside its outputs: an fp32 dq accumulator
    ``[T, H, D]`` and softmax row sums ``[H, T]``, and for grouped-query attention dK/dV for every query
    head before they are summed (``[T_k, H, D]`` each)."""
    ctx = tracker.kind("attention") if tracker is not None else contextlib.nullcontext()
    with ctx:
        t, h, d = q.shape
        ws = [torch.empty((t, h, d), dtype=torch.float32), torch.empty((h, t), dtype=torch.float32)]
        if k.shape[1] != h:
            ws += [torch.empty((k.shape[0], h, d), dtype=q.dtype) for _ in range(2)]
    return ws


def flash_stand_in(tracker: MemoryTracker | None) -> types.ModuleType:
    """A ``flash_attn`` module whose kernels return empty tensors of flash-attention 2's shapes and keep what it
    keeps: the varlen function saves q, k, v, the output and the fp32 log-sum-exp ``[H, T]``; the backward
    allocates its workspace (:func:`_attention_workspace`) and the three gradients."""

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                alibi_slopes=None, return_softmax=False):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)  # [H, T]
        return out, lse, None, torch.empty(2, dtype=torch.int64)

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1,
                 window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None):
        ws = _attention_workspace(tracker, q, k)
        del ws
        return softmax_lse

    class _Varlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
            out, lse, _, _ = forward(q, k, v, cu_q, cu_k, max_q, max_k)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 0, 0)
            return dq, dk, dv, None, None, None, None, None, None

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, **_: Any):
        return _Varlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)

    mod = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_varlen_forward = forward
    iface._flash_attn_varlen_backward = backward
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.flash_attn_interface = iface
    mod.__version__ = "2.6-stand-in"
    return mod


@contextlib.contextmanager
def flash_installed(tracker: MemoryTracker | None) -> Iterator[None]:
    """The stand-in importable as ``flash_attn`` (and ``flash_available()`` true) inside the context."""
    from parallel_runtime.engines.flash import flash_available

    mod = flash_stand_in(tracker)
    saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn.flash_attn_interface")}
    sys.modules["flash_attn"] = mod
    sys.modules["flash_attn.flash_attn_interface"] = mod.flash_attn_interface
    flash_available.cache_clear()
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        flash_available.cache_clear()


# ---- one rank ------------------------------------------------------------------------------------


class FakeRank:
    """Rank ``rank`` of a ``world_size`` world in this process (see the module docstring); ``flash``: whether
    the GPU runs flash-attention (else the runtime's fallback kernels run, on fake tensors)."""

    def __init__(self, rank: int, world_size: int, *, flash: bool = True) -> None:
        self.rank, self.world_size, self.flash = rank, world_size, flash
        self.trace = CommTrace(rank)
        self.tracker = MemoryTracker()
        self.labels: dict[int, str] = {}  # id(group) -> label, for groups whose ranks another group shares
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> FakeRank:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("a process group is initialized already; the estimate needs its own fake world")
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        s = self._stack
        s.callback(dist.destroy_process_group)
        if self.flash:
            s.enter_context(flash_installed(self.tracker))
        s.enter_context(recording(self.trace, self.labels))
        saved, D.EMULATION = D.EMULATION, _Emulation(self.trace)
        s.callback(setattr, D, "EMULATION", saved)
        s.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        s.enter_context(self.tracker)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def label(self, group: Any, name: str) -> None:
        """Call the communicator of ``group`` ``name`` in the trace (the exchange group has the world's ranks)."""
        if group is not None:
            self.labels[id(group)] = name
