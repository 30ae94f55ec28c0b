"""Fixed optimizer shards with slice-exact pull/push (Hydraulis's optimize/compute split, ZeRO-1 style).

One coordinate system for parameters: the full (unsharded) model's parameters, in a fixed
order, concatenated into one flat fp32 buffer, padded to a multiple of ``world_size`` and cut
into equal contiguous shards. Rank r owns shard r (fp32 master weights and AdamW moments) for
the whole run, whatever (tp, pp) shapes the pools take in a step. No rank ever holds more
than its shard plus its working slice plus one bucket: nothing full-model-sized is allocated
on the training path.

* **slices as runs**: a working parameter is one (pool, stage, tp index) slice of a full
  parameter; in flat coordinates it is a list of *runs* (the whole parameter when replicated
  inside its TP group, else the strided blocks of its ``narrow`` along the TP dim), in the
  slice's own element order.
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
  into ``self.grad`` (which push overwrites). Parameters replicated inside a TP group are
  contributed by tp index 0 only; parameters without a gradient (a rank idle in a step)
  contribute nothing.
* **step**: global gradient-norm clipping (one all-reduce of the shards' squared norms), then
  AdamW on the owned shard.
* **the gradient shard's home** (:meth:`ShardedOptimizer.share_grad`): a buffer of its own, or, where
  this rank's working gradients are one flat buffer laid out as the layout (a whole fp32 model), this
  rank's own window of that buffer. The push then writes each bucket's sum over the window after the
  bucket's send buffer took the local gradients there, so nothing else reads them: one shard of fp32
  bytes less per rank (why: the peak of a whole-model rank is the largest of the run).
* **the master shard's home** (:meth:`ShardedOptimizer.share_master`): likewise, this rank's window of
  a whole fp32 working model's flat parameter buffer, once such a model exists: every pull writes the
  master values there anyway, so the working copy of the own shard *is* the master (one more shard of
  fp32 bytes). It stays there for the run, whatever model a later step uses: only pulls write those
  parameters, and what a pull writes into the own window is the master itself.

``bytes_pulled`` / ``bytes_pushed`` count the bytes this rank received in pulls / sent in
pushes (its own shard's part included: exactly 4 bytes per element of its slices), and
``bytes_pull_sent`` / ``bytes_push_received`` the owner's side. :meth:`gather_full` and
:meth:`gather_grad` allocate the full flat buffer: test and debugging helpers only.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parallel_runtime.engines.device import on_gpu
from parallel_runtime.training.exchange import Bucket, ExchangePlan, plan_exchange, put, take, uncovered
from parallel_runtime.training.layout import FlatLayout, LocalParam, ParamSpec, grad_of

__all__ = ["AdamWConfig", "FlatLayout", "LocalParam", "ParamSpec", "ShardedOptimizer"]

STEP_CHUNK = 1 << 20  # elements of the shard the optimizer step updates at a time (bounded temporaries)
PEER_BYTES = 256 << 10  # a full bucket carries at least this much to (or from) each peer: see bucket_limit
PEER_BYTES_GPU = 1 << 20  # ... on GPUs (NCCL's all-to-all: fewer, larger messages; 64 MiB buckets at 64 ranks)
NORM_CHUNK = 1 << 16  # elements per piece of the gradient norm (fp64 copies of 512 kB)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    """AdamW on fixed fp32 shards, global-norm clipping, linear warmup then constant lr (recipe key ``optimizer``)."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps, then constant

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr



# torch's fused AdamW kernel (CPU, CUDA); absent in old builds: the chunked step instead
_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


@dataclass(slots=True)
class InFlight:
    """One bucket's collective, started by :meth:`ShardedOptimizer.launch`."""

    bucket: Bucket
    push: bool
    work: Any  # the collective's handle (None: done already)
    mine: torch.Tensor  # this rank's buffer: a pull's receive buffer, a push's send buffer
    peer: torch.Tensor  # the owner's side: a pull's send buffer (or a view of the shard), a push's receive buffer
    flats: Sequence[torch.Tensor]  # the working slices (pull) or their gradients (push), flat


_MAX_PLANS = 64  # exchange plans kept (distinct layout sets seen); oldest dropped first, on every rank alike


class ShardedOptimizer:
    """fp32 master shard + AdamW moments of this rank; pull/push against any local layout."""

    # False only in diagnostics.estimate: its fake tensors hold no values, so the copies between slices and
    # bucket buffers (views into buffers that exist anyway; tens of thousands of ops a step) are skipped
    copy_slices = True

    def __init__(self, layout: FlatLayout, full_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 config: AdamWConfig, *, rank: int = 0, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", bucket_elems: int | None = None) -> None:
        """``full_params``: every full parameter's initial value, as a mapping or as ``(name, tensor)``
        pairs (a generator keeps only one piece of the model in memory at a time); only the part
        inside this rank's shard is kept. Shards, moments and the pull/push buckets live on ``device``
        (the device of the working parameters; NCCL needs CUDA tensors). ``bucket_elems`` bounds
        the send and the receive buffer of every pull/push collective (default 8 MB of fp32, raised in
        worlds over 8 ranks to :data:`PEER_BYTES` per peer: :func:`bucket_limit`)."""
        if bucket_elems is not None and bucket_elems < 1:
            raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems}")
        self.layout = layout
        self.config = config
        self.rank = rank
        self.group = group
        self.device = torch.device(device)
        self.bucket_elems = bucket_elems if bucket_elems is not None else bucket_limit(
            2 << 20, layout.world_size, gpu=on_gpu(self.device))
        lo, hi = self._bounds()
        self.master = torch.zeros(layout.shard_size, dtype=torch.float32, device=self.device)  # [shard_size]
        pairs = full_params.items() if isinstance(full_params, Mapping) else full_params
        seen: set[str] = set()
        for name, value in pairs:
            if name not in layout.index:
                raise ValueError(f"initial value given for '{name}', which is not a parameter of the layout")
            i = layout.index[name]
            a, b = layout.offsets[i], layout.offsets[i + 1]
            if tuple(value.shape) != layout.specs[i].shape:
                raise ValueError(f"initial value of '{name}' has shape {tuple(value.shape)}, the layout "
                                 f"{layout.specs[i].shape}")
            seen.add(name)
            x, y = max(a, lo), min(b, hi)  # the part of parameter [a, b) inside this rank's shard [lo, hi)
            if x < y:
                self.master[x - lo:y - lo].copy_(value.detach().reshape(-1)[x - a:y - a].float())
        missing = [s.name for s in layout.specs if s.name not in seen]
        if missing:
            raise ValueError(f"initial value of parameter '{missing[0]}' is missing")
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.master_shared = False  # the master shard is a window of a working model's parameters (share_master)
        self._own_grad: torch.Tensor | None = None  # [shard_size] the gradient shard's own buffer, made on first use
        self._grad: torch.Tensor | None = None  # where the gradient shard lives now (own buffer or a shared window)
        self.steps = 0
        self.bytes_pulled = 0  # received in pulls (4 bytes per element of this rank's slices)
        self.bytes_pushed = 0  # sent in pushes (4 bytes per element of its contributed slices)
        self.bytes_pull_sent = 0  # sent in pulls as an owner
        self.bytes_push_received = 0  # received in pushes as an owner
        self.exchanges = 0  # pull/push collectives (buckets) run
        self.peak_bucket_elems = 0  # the largest send or receive buffer of one of them
        self.plans_built = 0  # exchange plans derived (cache misses)
        self.comm_s = 0.0  # seconds this rank was blocked in the optimizer's collectives (exposed communication)
        self._plans: dict[tuple[int, ...], ExchangePlan] = {}
        self._buffers: list[torch.Tensor] = []  # reusable bucket buffers: (receive/send, send/receive) per slot
        self._decay_runs = _decay_runs(layout, lo, hi)  # shard-relative [a, b) runs with / without weight decay

    @property
    def grad(self) -> torch.Tensor:
        """``[shard_size]`` fp32: the sum of every rank's gradients in this rank's shard after a push."""
        if self._grad is None:
            if self._own_grad is None:
                self._own_grad = torch.zeros_like(self.master)
            self._grad = self._own_grad
        return self._grad

    @property
    def grad_shared(self) -> bool:
        """Whether the gradient shard is a window of the working gradients' buffer (:meth:`share_grad`)."""
        return self._grad is not None and self._grad is not self._own_grad

    def share_grad(self, full: torch.Tensor | None) -> None:
        """Where the next push writes the gradient shard: ``full`` (``[padded]`` fp32, the rank's working
        gradients as one flat buffer in layout order, padding zero) holds it in this rank's window;
        ``None``: a buffer of its own. Sharing needs every gradient final before its bucket's push and
        nothing but the push reading them afterwards (the trainer's step; not the compare policies'
        extra passes, which zero the working gradients before the optimizer step)."""
        if full is None:
            self._grad = None
            return
        self._check_full(full, "gradient")
        lo, hi = self._bounds()
        self._grad = full[lo:hi]
        self._own_grad = None  # the own buffer's bytes go back

    def share_master(self, full: torch.Tensor) -> None:
        """Keep the master shard in this rank's window of ``full`` (``[padded]`` fp32: a working model's flat
        parameter buffer in layout order) from now on: its values are copied there and the own buffer
        goes (once; later calls do nothing). The caller must never write those parameters but by pulls."""
        if self.master_shared:
            return
        self._check_full(full, "parameter")
        lo, hi = self._bounds()
        window = full[lo:hi]
        window.copy_(self.master)
        self.master = window
        self.master_shared = True

    def _check_full(self, full: torch.Tensor, what: str) -> None:
        if full.dtype != torch.float32 or full.numel() != self.layout.padded or full.device != self.device:
            raise ValueError(f"a shared {what} buffer must be [{self.layout.padded}] float32 on {self.device}, "
                             f"got [{full.numel()}] {full.dtype} on {full.device}")

    @property
    def state_bytes(self) -> int:
        """Bytes the optimizer holds of its own: the moments, and master and gradient shards unless shared."""
        own = [self.exp_avg, self.exp_avg_sq] + ([] if self.master_shared else [self.master])
        own += [self._own_grad] if self._own_grad is not None else []
        return sum(t.numel() * t.element_size() for t in own)

    def _bounds(self) -> tuple[int, int]:
        lo = self.rank * self.layout.shard_size
        return lo, lo + self.layout.shard_size

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    # ---- test and debugging helpers (allocate the full flat buffer) ------------------------
    def gather_full(self) -> torch.Tensor:
        """The full flat fp32 parameter buffer (``[padded]``), gathered from every owner. Allocates the
        whole model on this rank: checks and tests only, never the training path."""
        return self._gather(self.master)

    def gather_grad(self) -> torch.Tensor:
        """The full flat gradient (``[padded]``) after :meth:`push`, gathered from every owner. Allocates
        the whole model on this rank: checks and tests only, never the training path."""
        return self._gather(self.grad)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return shard.clone()
        full = torch.empty(self.layout.padded, dtype=torch.float32, device=self.device)
        _all_gather(full, shard, self.group)
        return full

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
        """Sum every rank's local gradients into the owners' shards (``self.grad``, overwritten; collective)."""
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
        if not self.grad_shared:
            self.grad.zero_()
            return
        for a, b in uncovered(tuple(buckets), self.layout.shard_size):
            self.grad[a:b].zero_()

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
        self.plans_built += 1
        return plan

    def _gather_key(self, fp: int, n: int) -> tuple[int, ...]:
        """Every rank's (fingerprint, rows) of its description, flat (collective)."""
        meta = torch.tensor([fp, n], dtype=torch.int64, device=self.device)
        metas = [torch.empty_like(meta) for _ in range(self.layout.world_size)]
        t0 = time.perf_counter()
        dist.all_gather(metas, meta, group=self.group)
        self.comm_s += time.perf_counter() - t0
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
        if push:
            for j, off, loc, n in bk.parts if self.copy_slices else ():  # gradients of parameter j -> send buffer
                put(mine, off, off + n, take(flats[j], loc, loc + n), add=False)
            peer = self._buffer(2 * slot + 1, sum(bk.peer_n))
            work = self._all_to_all(peer, bk.peer_n, mine, bk.mine_n, async_op)
            self.bytes_pushed += mine.numel() * 4
            self.bytes_push_received += peer.numel() * 4
        else:
            peer = self._buffer(2 * slot + 1, sum(bk.peer_n))
            if self.copy_slices:
                peer = take(self.master, bk.ps, bk.pe, out=peer)
            work = self._all_to_all(mine, bk.mine_n, peer, bk.peer_n, async_op)
            self.bytes_pulled += mine.numel() * 4
            self.bytes_pull_sent += peer.numel() * 4
        return InFlight(bucket=bk, push=push, work=work, mine=mine, peer=peer, flats=flats)

    @torch.no_grad()
    def complete(self, f: InFlight) -> float:
        """Wait for ``f``'s collective and take its result (pull: into the slices; push: summed into
        ``self.grad``); returns the seconds waited."""
        t0 = time.perf_counter()
        if f.work is not None:
            f.work.wait()
        waited = time.perf_counter() - t0
        self.comm_s += waited
        bk = f.bucket
        if not self.copy_slices:
            return waited
        if f.push:
            if self.grad_shared:  # the window's local gradients are in the send buffer by now: the sum goes there
                self.grad[bk.a:bk.b].zero_()
            put(self.grad, bk.ps, bk.pe, f.peer, add=True)
        else:
            for j, off, loc, n in bk.parts:  # receive buffer -> local parameter j
                put(f.flats[j], loc, loc + n, take(f.mine, off, off + n), add=False)
        return waited

    def _all_to_all(self, out: torch.Tensor, out_n: list[int], inp: torch.Tensor, inp_n: list[int],
                    async_op: bool):
        self.exchanges += 1
        self.peak_bucket_elems = max(self.peak_bucket_elems, out.numel(), inp.numel())
        if self.distributed:
            t0 = time.perf_counter()
            work = dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=out_n, input_split_sizes=inp_n,
                                          group=self.group, async_op=async_op)
            if not async_op:
                self.comm_s += time.perf_counter() - t0
            return work
        out.copy_(inp)
        return None

    # ---- step --------------------------------------------------------------
    def _chunks(self, size: int = STEP_CHUNK) -> Iterator[slice]:
        # the step works on the shard in pieces so that its temporaries stay a bounded size (not the shard's)
        for a in range(0, self.layout.shard_size, size):
            yield slice(a, min(a + size, self.layout.shard_size))

    @torch.no_grad()
    def grad_norm(self) -> float:
        # shards are disjoint, so the global squared norm is the sum of the shards' (padding is zero)
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for c in self._chunks(NORM_CHUNK):
            d = self.grad[c].double()  # fp64 sums; small pieces: the temporaries stay a few hundred kB
            sq += torch.dot(d, d)
        if self.distributed:
            t0 = time.perf_counter()
            dist.all_reduce(sq, group=self.group)
            self.comm_s += time.perf_counter() - t0
        return float(sq.sqrt())

    @torch.no_grad()
    def step(self) -> float:
        """Clip by the global norm, AdamW on the owned shard; returns the pre-clip norm."""
        c = self.config
        lr = c.lr_at(self.steps)
        norm = self.grad_norm()
        if c.max_grad_norm > 0 and norm > c.max_grad_norm:
            self.grad.mul_(c.max_grad_norm / (norm + 1e-6))  # in place: the gradient shard is zeroed below
        self.steps += 1
        if _FUSED_ADAMW is not None:
            self._fused_step(lr)
        else:
            self._chunked_step(lr)
        if not self.grad_shared:  # a shared shard is zeroed with the working gradients when they are attached
            self.grad.zero_()
        return norm

    def _fused_step(self, lr: float) -> None:
        """torch's fused AdamW kernel over the shard: one pass, no temporaries. Runs of the shard with and
        without weight decay (norms, biases) are separate views of the same buffers."""
        c = self.config
        b1, b2 = c.betas
        step = torch.tensor(float(self.steps), dtype=torch.float32, device=self.device)
        for wd, runs in ((c.weight_decay, self._decay_runs[True]), (0.0, self._decay_runs[False])):
            if not runs:
                continue
            views = [[buf[a:b] for a, b in runs] for buf in (self.master, self.grad, self.exp_avg, self.exp_avg_sq)]
            _FUSED_ADAMW(*views, [], [step] * len(runs), lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=c.eps,
                         amsgrad=False, maximize=False)

    def _chunked_step(self, lr: float) -> None:
        """AdamW by chunks of the shard with bounded temporaries (where torch has no fused kernel)."""
        c = self.config
        b1, b2 = c.betas
        bc1 = 1 - b1**self.steps  # bias corrections: the moments start at zero
        bc2 = 1 - b2**self.steps
        lo = self._bounds()[0]
        for k in self._chunks():
            g, m, v, w = self.grad[k], self.exp_avg[k], self.exp_avg_sq[k], self.master[k]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if c.weight_decay:  # decoupled (AdamW): shrink the weights, not the gradient; norms are masked out
                decay = self.layout.decay_mask(lo + k.start, lo + k.stop).to(self.device)  # [chunk], made per chunk
                w.sub_(w * decay * (lr * c.weight_decay))
            denom = (v.sqrt() / math.sqrt(bc2)).add_(c.eps)
            w.addcdiv_(m, denom, value=-lr / bc1)


def bucket_limit(bucket_elems: int, world_size: int, *, gpu: bool = False) -> int:
    """The elements of one bucket's send or receive buffer: ``bucket_elems``, or more in a large world, so that
    a rank exchanging with every peer (a whole-model rank pulls from every owner) still moves
    :data:`PEER_BYTES` (:data:`PEER_BYTES_GPU` on a GPU) per peer per collective. Why: a fixed buffer cut
    ``world_size`` ways gave 32 KiB messages and 2,163 all-to-alls per step at 64 GPUs; 1 MiB per peer makes
    that 136 of 64 MiB buffers (256 MiB with two in flight), and on CPU (256 KiB per peer) nothing changes
    up to 8 ranks."""
    return max(bucket_elems, world_size * (PEER_BYTES_GPU if gpu else PEER_BYTES) // 4)


def _decay_runs(layout: FlatLayout, lo: int, hi: int) -> dict[bool, list[tuple[int, int]]]:
    """The shard ``[lo, hi)`` as shard-relative runs ``[a, b)`` of parameters with (True) and without (False)
    weight decay, adjacent runs of one kind joined. The zero padding counts as decayed (it stays zero)."""
    segs = []
    for i, spec in enumerate(layout.specs):
        a, b = max(layout.offsets[i], lo), min(layout.offsets[i + 1], hi)
        if a < b:
            segs.append((a - lo, b - lo, spec.decay))
    pad = max(layout.numel, lo)
    if pad < hi:
        segs.append((pad - lo, hi - lo, True))
    out: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for a, b, decay in segs:
        runs = out[decay]
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return out


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather equal shards into ``out`` (the newer single-tensor name where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)

