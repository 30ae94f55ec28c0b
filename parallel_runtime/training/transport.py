"""Moving slices between the optimizer's fixed shards and the working parameters: :class:`ShardExchange`.

The shards are :class:`~parallel_runtime.training.optimizer.ShardedOptimizer`'s; what a slice is in flat
coordinates, the buckets and the copies are :mod:`parallel_runtime.training.exchange` (pure). This module
owns what moves them: the reusable send and receive buffers, the exchange plans' cache and the collectives
(on the optimizer's process group).

* **exchange plan** (once per distinct set of local layouts, cached): each rank all-gathers a
  fingerprint of its description (per parameter: index, tp index, tp size); on a miss the
  descriptions themselves, ``[n, 3]`` int64 per rank. Every rank then derives its own runs and
  every other rank's runs inside its shard, and the buckets: the shard-relative space is cut
  into cells, each rank counts the elements it would send or receive per cell, a MAX
  all-reduce makes the counts common, and cells are grouped greedily into windows whose send
  and receive buffers hold at most ``bucket_elems`` elements on every rank. A bucket is the
  same window ``[a, b)`` of every shard at once, so all owners send in every collective, and
  windows no rank needs are skipped.
* **pull**: per bucket one ``all_to_all_single`` with per-rank split sizes: owners send the
  elements of each rank's runs inside the window (in flat order), receivers copy them into
  their working parameters.
* **push**: the reverse; each rank sends the gradient elements of its runs, owners sum them
  into the optimizer's gradient shard (which push overwrites). Parameters replicated inside a TP group
  are contributed by tp index 0 only; parameters without a gradient (a rank idle in a step)
  contribute nothing. Where the gradient shard is a window of the working gradients
  (:meth:`~parallel_runtime.training.optimizer.ShardedOptimizer.share_grad`), each bucket's sum is
  written over the window after the bucket's send buffer took the local gradients there.

:meth:`ShardExchange.take_stats` returns what moved since its last call as one frozen
:class:`ExchangeStats` (bytes both ways, collectives, plans derived, seconds blocked): the trainer takes
one per step, nothing is zeroed by hand. :mod:`parallel_runtime.training.overlap` drives the same
buckets one at a time (:meth:`ShardExchange.describe`, :meth:`~ShardExchange.plan_for`,
:meth:`~ShardExchange.begin_push`, :meth:`~ShardExchange.launch`, :meth:`~ShardExchange.complete`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parallel_runtime.engines.device import on_gpu
from parallel_runtime.launch import new_group
from parallel_runtime.training.exchange import Bucket, ExchangePlan, plan_exchange, put, take, uncovered
from parallel_runtime.training.layout import LocalParam, grad_of
from parallel_runtime.training.optimizer import ShardedOptimizer

__all__ = ["ExchangeStats", "InFlight", "ShardExchange", "bucket_limit", "exchange_group"]

BUCKET_ELEMS = 2 << 20  # elements of one bucket's send or receive buffer by default (8 MB of fp32)
PEER_BYTES = 256 << 10  # a full bucket carries at least this much to (or from) each peer: see bucket_limit
PEER_BYTES_GPU = 1 << 20  # ... on GPUs (NCCL's all-to-all: fewer, larger messages; 64 MiB buckets at 64 ranks)
_MAX_PLANS = 64  # exchange plans kept (distinct layout sets seen); oldest dropped first, on every rank alike


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeStats:
    """What a :class:`ShardExchange` moved between two :meth:`~ShardExchange.take_stats` calls."""

    bytes_pulled: int = 0  # received in pulls (4 bytes per element of this rank's slices)
    bytes_pushed: int = 0  # sent in pushes (4 bytes per element of its contributed slices)
    bytes_pull_sent: int = 0  # sent in pulls as an owner
    bytes_push_received: int = 0  # received in pushes as an owner
    exchanges: int = 0  # pull/push collectives (buckets) run
    peak_bucket_elems: int = 0  # the largest send or receive buffer of one of them
    plans_built: int = 0  # exchange plans derived (cache misses)
    comm_s: float = 0.0  # seconds this rank was blocked in the exchange's collectives (exposed communication)

    def __add__(self, other: ExchangeStats) -> ExchangeStats:
        """Both periods as one: the sums, and the larger peak."""
        return ExchangeStats(bytes_pulled=self.bytes_pulled + other.bytes_pulled,
                             bytes_pushed=self.bytes_pushed + other.bytes_pushed,
                             bytes_pull_sent=self.bytes_pull_sent + other.bytes_pull_sent,
                             bytes_push_received=self.bytes_push_received + other.bytes_push_received,
                             exchanges=self.exchanges + other.exchanges,
                             peak_bucket_elems=max(self.peak_bucket_elems, other.peak_bucket_elems),
                             plans_built=self.plans_built + other.plans_built, comm_s=self.comm_s + other.comm_s)


@dataclass(slots=True)
class _Tally:
    """The counts behind the next :class:`ExchangeStats` (private: only the exchange writes them)."""

    bytes_pulled: int = 0
    bytes_pushed: int = 0
    bytes_pull_sent: int = 0
    bytes_push_received: int = 0
    exchanges: int = 0
    peak_bucket_elems: int = 0
    plans_built: int = 0
    comm_s: float = 0.0


@dataclass(slots=True)
class InFlight:
    """One bucket's collective, started by :meth:`ShardExchange.launch`."""

    bucket: Bucket
    push: bool
    work: Any  # the collective's handle (None: done already)
    mine: torch.Tensor  # this rank's buffer: a pull's receive buffer, a push's send buffer
    peer: torch.Tensor  # the owner's side: a pull's send buffer (or a view of the shard), a push's receive buffer
    flats: Sequence[torch.Tensor]  # the working slices (pull) or their gradients (push), flat


class ShardExchange:
    """Pull and push between ``optimizer``'s shards and any local layout, on the optimizer's process group."""

    # False only in diagnostics.estimate: its fake tensors hold no values, so the copies between slices and
    # bucket buffers (views into buffers that exist anyway; tens of thousands of ops a step) are skipped
    copy_slices = True

    def __init__(self, optimizer: ShardedOptimizer, *, bucket_elems: int | None = None) -> None:
        """``bucket_elems`` bounds the send and the receive buffer of every pull/push collective (default
        :data:`BUCKET_ELEMS`, raised in worlds over 8 ranks to :data:`PEER_BYTES` per peer: :func:`bucket_limit`).
        The buffers live on the optimizer's device (NCCL needs CUDA tensors)."""
        if bucket_elems is not None and bucket_elems < 1:
            raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems}")
        self.optimizer = optimizer
        # the optimizer's coordinates, process group and device: one group for all of its collectives
        self.layout, self.rank, self.group, self.device = (optimizer.layout, optimizer.rank, optimizer.group,
                                                           optimizer.device)
        self.bucket_elems = bucket_elems if bucket_elems is not None else bucket_limit(
            BUCKET_ELEMS, self.layout.world_size, gpu=on_gpu(self.device))
        self._plans: dict[tuple[int, ...], ExchangePlan] = {}
        self._buffers: list[torch.Tensor] = []  # reusable bucket buffers: (receive/send, send/receive) per slot
        self._tally = _Tally()

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    def take_stats(self) -> ExchangeStats:
        """What moved since the last call (or since the exchange was made); the next record starts empty."""
        t, self._tally = self._tally, _Tally()
        return ExchangeStats(bytes_pulled=t.bytes_pulled, bytes_pushed=t.bytes_pushed,
                             bytes_pull_sent=t.bytes_pull_sent, bytes_push_received=t.bytes_push_received,
                             exchanges=t.exchanges, peak_bucket_elems=t.peak_bucket_elems,
                             plans_built=t.plans_built, comm_s=t.comm_s)

    # ---- pull / push -----------------------------------------------------------------------
    @torch.no_grad()
    def pull(self, local: Iterable[LocalParam]) -> None:
        """Copy this rank's slices of the master parameters into its working parameters (collective:
        every rank of the group calls it, with whatever local layout it has)."""
        rows, flats = self.describe(local, push=False)
        plan = self.plan_for(rows)
        flats = [t.detach().view(-1) for t in flats]
        for bk in plan.buckets:
            self.complete(self.launch(bk, flats, push=False))

    @torch.no_grad()
    def push(self, local: Iterable[LocalParam]) -> None:
        """Sum every rank's local gradients into the owners' gradient shards (overwritten; collective)."""
        rows, grads = self.describe(local, push=True)
        plan = self.plan_for(rows)
        self.begin_push(plan.buckets)
        flats = [g.reshape(-1) for g in grads]
        for bk in plan.buckets:
            self.complete(self.launch(bk, flats, push=True))

    @torch.no_grad()
    def begin_push(self, buckets: Sequence[Bucket]) -> None:
        """Before a push's first bucket: the gradient shard zeroed where no bucket will write it (all of it
        when it has its own buffer; a shared one keeps the local gradients its buckets still send and is
        zeroed window by window in :meth:`complete`)."""
        opt = self.optimizer
        if not opt.grad_shared:
            opt.grad.zero_()
            return
        for a, b in uncovered(tuple(buckets), self.layout.shard_size):
            opt.grad[a:b].zero_()

    def describe(self, local: Iterable[LocalParam], *, push: bool,
                 contributes: bool | None = None) -> tuple[np.ndarray, list[torch.Tensor]]:
        """``[n, 3]`` int64 rows (parameter index, tp index, tp size) and the tensors they fill or read;
        for a push only the contributing parameters and their gradients. ``contributes`` (push only):
        whether this rank's parameters have gradients this step, where they are not attached yet
        (default: those whose ``.grad`` is set); the tensors are then the parameters themselves."""
        rows, tensors = [], []
        for lp in local:
            spec = lp.spec
            has_grad = grad_of(lp.tensor) is not None if contributes is None else contributes
            if push and (not has_grad or (spec.tp_dim is None and lp.tp_index != 0)):
                continue  # no gradient here, or replicated inside the TP group: tp index 0 contributes it once
            p = self.layout.index.get(spec.name)
            if p is None:
                raise ValueError(f"local parameter '{spec.name}' is not a parameter of the optimizer's layout")
            if not 0 <= lp.tp_index < lp.tp_size:
                raise ValueError(f"{spec.name}: tp index {lp.tp_index} is outside tp size {lp.tp_size}")
            shape = list(self.layout.specs[p].shape)
            if spec.tp_dim is not None and lp.tp_size > 1:
                if shape[spec.tp_dim] % lp.tp_size:
                    raise ValueError(f"{spec.name}: dim {spec.tp_dim} of size {shape[spec.tp_dim]} is not divisible "
                                     f"by tp={lp.tp_size}")
                shape[spec.tp_dim] //= lp.tp_size
            if tuple(lp.tensor.shape) != tuple(shape):
                raise ValueError(f"{spec.name}: the working tensor has shape {tuple(lp.tensor.shape)}, its slice "
                                 f"(tp {lp.tp_index}/{lp.tp_size}) has {tuple(shape)}")
            rows.append((p, lp.tp_index, lp.tp_size))
            tensors.append(grad_of(lp.tensor) if push and contributes is None else lp.tensor)
        return np.array(rows, dtype=np.int64).reshape(-1, 3), tensors

    def plan_for(self, rows: np.ndarray) -> ExchangePlan:
        """The cached exchange for every rank's current description: one all-gather of 16 bytes per rank
        per call; on a miss also one of the descriptions and a MAX all-reduce of the cell loads. The key
        is every rank's (fingerprint, length), so all ranks hit or miss together."""
        fp = int.from_bytes(hashlib.blake2b(rows.tobytes(), digest_size=8).digest(), "little", signed=True)
        key = self._gather_key(fp, len(rows)) if self.distributed else (fp, len(rows))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        every = self._gather_rows(rows, key) if self.distributed else [rows]
        plan = plan_exchange(self.layout, rows, every, self.rank, self.bucket_elems, self._reduce_max)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        self._tally.plans_built += 1
        return plan

    def _gather_key(self, fp: int, n: int) -> tuple[int, ...]:
        """Every rank's (fingerprint, rows) of its description, flat (collective)."""
        meta = torch.tensor([fp, n], dtype=torch.int64, device=self.device)
        metas = [torch.empty_like(meta) for _ in range(self.layout.world_size)]
        t0 = time.perf_counter()
        dist.all_gather(metas, meta, group=self.group)
        self._tally.comm_s += time.perf_counter() - t0
        return tuple(int(v) for m in metas for v in m.tolist())

    def _gather_rows(self, rows: np.ndarray, key: tuple[int, ...]) -> list[np.ndarray]:
        """Every rank's description, padded to the longest for the all-gather (collective)."""
        longest = max(key[1::2])
        mine = torch.full((longest, 3), -1, dtype=torch.int64, device=self.device)
        mine[:len(rows)] = torch.from_numpy(rows).to(self.device)
        got = [torch.empty_like(mine) for _ in range(self.layout.world_size)]
        dist.all_gather(got, mine, group=self.group)
        return [g[:n].cpu().numpy() for g, n in zip(got, key[1::2])]

    def _reduce_max(self, load: np.ndarray) -> np.ndarray:
        if not self.distributed:
            return load
        t = torch.from_numpy(load).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().numpy()

    # ---- one bucket: launch (optionally asynchronous) and complete ---------------------------
    def _buffer(self, slot: int, n: int) -> torch.Tensor:
        """``[n]`` fp32 view of reusable buffer ``slot`` (grown to the largest bucket, then steady)."""
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.float32, device=self.device))
        if self._buffers[slot].numel() < n:
            self._buffers[slot] = torch.empty(0, dtype=torch.float32, device=self.device)  # free before growing
            self._buffers[slot] = torch.empty(n, dtype=torch.float32, device=self.device)
        return self._buffers[slot][:n]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the reusable bucket buffers (send and receive buffers of the exchanges in flight)."""
        return sum(b.numel() for b in self._buffers) * 4

    @torch.no_grad()
    def launch(self, bk: Bucket, flats: Sequence[torch.Tensor], *, push: bool, slot: int = 0,
               async_op: bool = False) -> InFlight:
        """Start bucket ``bk``'s collective: a pull (owners -> slices ``flats``) or a push (the gradients
        ``flats`` -> owners). ``slot``: which pair of reusable buffers it uses (one per bucket in flight)."""
        mine = self._buffer(2 * slot, sum(bk.mine_n))
        t = self._tally
        if push:
            for j, off, loc, n in bk.parts if self.copy_slices else ():  # gradients of parameter j -> send buffer
                put(mine, off, off + n, take(flats[j], loc, loc + n), add=False)
            peer = self._buffer(2 * slot + 1, sum(bk.peer_n))
            work = self._all_to_all(peer, bk.peer_n, mine, bk.mine_n, async_op)
            t.bytes_pushed += mine.numel() * 4
            t.bytes_push_received += peer.numel() * 4
        else:
            peer = self._buffer(2 * slot + 1, sum(bk.peer_n))
            if self.copy_slices:
                peer = take(self.optimizer.master, bk.ps, bk.pe, out=peer)
            work = self._all_to_all(mine, bk.mine_n, peer, bk.peer_n, async_op)
            t.bytes_pulled += mine.numel() * 4
            t.bytes_pull_sent += peer.numel() * 4
        return InFlight(bucket=bk, push=push, work=work, mine=mine, peer=peer, flats=flats)

    @torch.no_grad()
    def complete(self, f: InFlight) -> float:
        """Wait for ``f``'s collective and take its result (pull: into the slices; push: summed into the
        optimizer's gradient shard); returns the seconds waited."""
        t0 = time.perf_counter()
        if f.work is not None:
            f.work.wait()
        waited = time.perf_counter() - t0
        self._tally.comm_s += waited
        bk = f.bucket
        if not self.copy_slices:
            return waited
        if f.push:
            grad = self.optimizer.grad
            if self.optimizer.grad_shared:  # its local gradients went into the send buffer: the sum goes there
                grad[bk.a:bk.b].zero_()
            put(grad, bk.ps, bk.pe, f.peer, add=True)
        else:
            for j, off, loc, n in bk.parts:  # receive buffer -> local parameter j
                put(f.flats[j], loc, loc + n, take(f.mine, off, off + n), add=False)
        return waited

    def _all_to_all(self, out: torch.Tensor, out_n: list[int], inp: torch.Tensor, inp_n: list[int],
                    async_op: bool):
        t = self._tally
        t.exchanges += 1
        t.peak_bucket_elems = max(t.peak_bucket_elems, out.numel(), inp.numel())
        if self.distributed:
            t0 = time.perf_counter()
            work = dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=out_n, input_split_sizes=inp_n,
                                          group=self.group, async_op=async_op)
            if not async_op:
                t.comm_s += time.perf_counter() - t0
            return work
        out.copy_(inp)
        return None


def bucket_limit(bucket_elems: int, world_size: int, *, gpu: bool = False) -> int:
    """The elements of one bucket's send or receive buffer: ``bucket_elems``, or more in a large world, so that
    a rank exchanging with every peer (a whole-model rank pulls from every owner) still moves
    :data:`PEER_BYTES` (:data:`PEER_BYTES_GPU` on a GPU) per peer per collective. Why: a fixed buffer cut
    ``world_size`` ways gave 32 KiB messages and 2,163 all-to-alls per step at 64 GPUs; 1 MiB per peer makes
    that 136 of 64 MiB buffers (256 MiB with two in flight), and on CPU (256 KiB per peer) nothing changes
    up to 8 ranks."""
    return max(bucket_elems, world_size * (PEER_BYTES_GPU if gpu else PEER_BYTES) // 4)


def exchange_group(world: int) -> dist.ProcessGroup | None:
    """A process group over the whole world for the optimizer's collectives alone: asynchronous buckets in
    flight during forward/backward must never interleave with the world group's CP or barrier collectives."""
    return new_group(range(world)) if world > 1 else None
