"""Fixed optimizer shards with pull/push (Hydraulis's optimize/compute split, ZeRO-1 style).

One coordinate system for parameters: the full (unsharded) model's parameters, in a fixed
order, concatenated into one flat fp32 buffer, padded to a multiple of ``world_size`` and cut
into equal contiguous shards. Rank r owns shard r (fp32 master weights and AdamW moments) for
the whole run, whatever (tp, pp) shapes the pools take in a step.

* **pull**: all-gather the master shards into the full flat buffer; every rank copies the
  slices its (pool, stage, tp index) needs into its working parameters.
* **push**: every rank adds its local gradients into a zero full-size flat buffer at their
  global offsets (TP slices at their place; parameters replicated inside a TP group only
  from tp index 0) and a reduce-scatter sums them into the owners' shards. This is correct
  for any mix of shapes because every contribution lands in the same coordinates; ranks idle
  in a step contribute zeros.
* **step**: global gradient-norm clipping (one all-reduce of the shards' squared norms), then
  AdamW on the owned shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One parameter of the full model: its name, full shape and the dim split across TP ranks."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # None: replicated inside a TP group
    decay: bool = True  # weight decay applies (False for norms and biases)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalParam:
    """A working parameter on this rank: which full parameter it is and which TP slice."""

    spec: ParamSpec
    tensor: torch.Tensor  # the module's parameter (slice of the full one)
    tp_index: int = 0
    tp_size: int = 1


class FlatLayout:
    """Offsets of every full parameter in the flat buffer, padded to ``world_size`` shards."""

    def __init__(self, specs: Sequence[ParamSpec], world_size: int) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        self.specs = tuple(specs)
        self.index = {s.name: i for i, s in enumerate(self.specs)}
        offsets = [0]
        for s in self.specs:
            offsets.append(offsets[-1] + s.numel)
        self.offsets = offsets  # [num_params + 1]
        self.numel = offsets[-1]
        self.world_size = world_size
        # all-gather and reduce-scatter need equal shards: ceil(numel / world) each, the tail padded with zeros
        self.shard_size = -(-self.numel // world_size)
        self.padded = self.shard_size * world_size

    def full_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        i = self.index[name]
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.specs[i].shape)

    def slice_view(self, flat: torch.Tensor, lp: LocalParam) -> torch.Tensor:
        """The part of the full parameter that ``lp`` holds, as a view into ``flat``."""
        full = self.full_view(flat, lp.spec.name)
        if lp.spec.tp_dim is None or lp.tp_size == 1:
            return full
        n = full.shape[lp.spec.tp_dim]
        if n % lp.tp_size:
            raise ValueError(f"{lp.spec.name}: dim {lp.spec.tp_dim} of size {n} is not divisible by tp={lp.tp_size}")
        step = n // lp.tp_size  # TP rank t holds the t-th of tp equal blocks along tp_dim (engines/tensor.shard)
        return full.narrow(lp.spec.tp_dim, lp.tp_index * step, step)

    def decay_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.padded, dtype=torch.bool)  # [padded]
        for i, s in enumerate(self.specs):
            if s.decay:
                mask[self.offsets[i] : self.offsets[i + 1]] = True
        return mask


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


class ShardedOptimizer:
    """fp32 master shard + AdamW moments of this rank; pull/push against any local layout."""

    def __init__(self, layout: FlatLayout, full_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 config: AdamWConfig, *, rank: int = 0, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        """``full_params``: every full parameter's initial value, as a mapping or as ``(name, tensor)``
        pairs (a generator keeps only one piece of the model in memory at a time); only the part
        inside this rank's shard is kept. Shards, moments and the pull/push buffers live on ``device``
        (the device of the working parameters; NCCL needs CUDA tensors)."""
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
        self.decay = layout.decay_mask()[lo:hi].to(self.device)
        self.grad = torch.zeros_like(self.master)
        self.steps = 0
        self.bytes_pulled = 0
        self.bytes_pushed = 0

    def _bounds(self) -> tuple[int, int]:
        lo = self.rank * self.layout.shard_size
        return lo, lo + self.layout.shard_size

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    # ---- pull --------------------------------------------------------------
    def gather_full(self) -> torch.Tensor:
        """The full flat fp32 parameter buffer (``[padded]``), gathered from every owner."""
        if not self.distributed:
            return self.master.clone()
        full = torch.empty(self.layout.padded, dtype=torch.float32, device=self.device)
        _all_gather(full, self.master, self.group)
        self.bytes_pulled += full.numel() * 4
        return full

    @torch.no_grad()
    def pull(self, local: Iterable[LocalParam]) -> None:
        full = self.gather_full()
        for lp in local:
            lp.tensor.copy_(self.layout.slice_view(full, lp).to(lp.tensor.dtype))

    # ---- push --------------------------------------------------------------
    @torch.no_grad()
    def push(self, local: Iterable[LocalParam]) -> None:
        """Sum every rank's local gradients into the owners' shards (``self.grad``)."""
        # every rank writes its slices into a zero full-size buffer at their global offsets; summing the
        # buffers (reduce-scatter) is then right for any mix of pool shapes: each slice lands in one place
        full = torch.zeros(self.layout.padded, dtype=torch.float32, device=self.device)
        for lp in local:
            if lp.tensor.grad is None:
                continue
            if lp.spec.tp_dim is None and lp.tp_index != 0:
                continue  # replicated inside the TP group: tp index 0 contributes it once
            self.layout.slice_view(full, lp).add_(lp.tensor.grad.float())
        if self.distributed:
            _reduce_scatter(self.grad, full, self.group)
            self.bytes_pushed += full.numel() * 4
        else:
            self.grad.copy_(full[: self.layout.shard_size])

    def gather_grad(self) -> torch.Tensor:
        """The full flat gradient (``[padded]``) after :meth:`push`, gathered from every owner (checks, debugging)."""
        if not self.distributed:
            return self.grad.clone()
        full = torch.empty(self.layout.padded, dtype=torch.float32, device=self.device)
        _all_gather(full, self.grad, self.group)
        return full

    # ---- step --------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> float:
        # shards are disjoint, so the global squared norm is the sum of the shards' (padding is zero)
        sq = torch.sum(self.grad.double() ** 2).reshape(1)
        if self.distributed:
            dist.all_reduce(sq, group=self.group)
        return float(sq.sqrt())

    @torch.no_grad()
    def step(self) -> float:
        """Clip by the global norm, AdamW on the owned shard; returns the pre-clip norm."""
        c = self.config
        lr = c.lr_at(self.steps)
        norm = self.grad_norm()
        g = self.grad
        if c.max_grad_norm > 0 and norm > c.max_grad_norm:
            g = g * (c.max_grad_norm / (norm + 1e-6))
        self.steps += 1
        b1, b2 = c.betas
        self.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - b1**self.steps  # bias corrections: the moments start at zero
        bc2 = 1 - b2**self.steps
        if c.weight_decay:  # decoupled (AdamW): shrink the weights, not the gradient; norms are masked out
            self.master.sub_(self.master * self.decay * (lr * c.weight_decay))
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(c.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bc1)
        self.grad.zero_()
        return norm

    # ---- checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": 1, "rank": self.rank, "world_size": self.layout.world_size, "steps": self.steps,
                "numel": self.layout.numel, "master": self.master.cpu().clone(), "exp_avg": self.exp_avg.cpu().clone(),
                "exp_avg_sq": self.exp_avg_sq.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"optimizer checkpoint version {state.get('version')} is not supported")
        if state["world_size"] != self.layout.world_size or state["numel"] != self.layout.numel:
            raise ValueError(f"optimizer checkpoint is for world size {state['world_size']} and "
                             f"{state['numel']} parameters; this run has {self.layout.world_size} and "
                             f"{self.layout.numel}")
        self.steps = int(state["steps"])
        self.master.copy_(state["master"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather equal shards into ``out`` (the newer single-tensor name where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``full`` over the ranks and keep this rank's shard in ``out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, op=dist.ReduceOp.SUM, group=group)
