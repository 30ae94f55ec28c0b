"""Fixed optimizer shards, the global gradient norm and AdamW (Hydraulis's optimize/compute split, ZeRO-1 style).

One coordinate system for parameters: the full (unsharded) model's parameters, in a fixed
order, concatenated into one flat fp32 buffer, padded to a multiple of ``world_size`` and cut
into equal contiguous shards (:class:`~parallel_runtime.training.layout.FlatLayout`). Rank r owns
shard r (fp32 master weights and AdamW moments) for the whole run, whatever (tp, pp) shapes the pools
take in a step. No rank ever holds more than its shard plus its working slice plus one bucket:
nothing full-model-sized is allocated on the training path.

What moves slices between the shards and the working parameters (pull, push, their buckets and
buffers) is :class:`~parallel_runtime.training.transport.ShardExchange`; this class keeps the shards.

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

:meth:`gather_full` and :meth:`gather_grad` allocate the full flat buffer: test and debugging helpers only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel_runtime.training.layout import FlatLayout, LocalParam, ParamSpec

__all__ = ["AdamWConfig", "FlatLayout", "LocalParam", "ParamSpec", "ShardedOptimizer"]

STEP_CHUNK = 1 << 20  # elements of the shard the optimizer step updates at a time (bounded temporaries)
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


class ShardedOptimizer:
    """fp32 master shard + AdamW moments of this rank, in the coordinates of any local layout's slices."""

    def __init__(self, layout: FlatLayout, full_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 config: AdamWConfig, *, rank: int = 0, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        """``full_params``: every full parameter's initial value, as a mapping or as ``(name, tensor)``
        pairs (a generator keeps only one piece of the model in memory at a time); only the part
        inside this rank's shard is kept. Shards and moments live on ``device`` (the device of the working
        parameters; NCCL needs CUDA tensors); ``group``: the process group of the optimizer's collectives
        (the norm, and the :class:`~parallel_runtime.training.transport.ShardExchange` over this optimizer)."""
        self.layout = layout
        self.config = config
        self.rank = rank
        self.group = group
        self.device = torch.device(device)
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
        self.norm_comm_s = 0.0  # seconds this rank was blocked in the last norm's all-reduce (exposed communication)
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
        self.norm_comm_s = 0.0
        if self.distributed:
            t0 = time.perf_counter()
            dist.all_reduce(sq, group=self.group)
            self.norm_comm_s = time.perf_counter() - t0
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

