"""The optimizer's coordinates: every full parameter at a fixed offset of one flat buffer, cut into shards.

:class:`ParamSpec` is one parameter of the full (unsharded) model, :class:`LocalParam` a working
parameter of this rank (a TP slice of a full parameter), :class:`FlatLayout` the offsets of every full
parameter in the flat buffer, padded to ``world_size`` equal contiguous shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


def grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """A working parameter's accumulated gradient: its fp32 ``main_grad`` where it has one (half-precision
    parameters, :class:`~parallel_runtime.training.runtime.GradBuffer`), else its ``.grad``."""
    g = getattr(t, "main_grad", None)
    return g if g is not None else t.grad


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

    def decay_mask(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Whether weight decay applies, for flat positions ``[lo, hi)`` (default: all of ``[0, padded)``)."""
        hi = self.padded if hi is None else hi
        mask = torch.zeros(hi - lo, dtype=torch.bool)  # [hi - lo]
        for i, s in enumerate(self.specs):
            a, b = max(self.offsets[i], lo), min(self.offsets[i + 1], hi)
            if s.decay and a < b:
                mask[a - lo : b - lo] = True
        return mask

