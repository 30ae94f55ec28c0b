"""Tensor parallelism (Megatron style) with explicit autograd.

* :class:`ColumnParallelLinear`: weight split along the output dim; the input is copied into
  the TP region (identity forward, all-reduce of its gradient backward).
* :class:`RowParallelLinear`: weight split along the input dim; the partial outputs are
  all-reduced (gradient passes through unchanged).
* :class:`VocabParallelEmbedding`: vocab rows split; each rank looks up the ids it owns and
  the results are all-reduced.
* :func:`vocab_parallel_cross_entropy`: cross-entropy over vocab-split logits without
  gathering them (max, sum-exp and target logit all-reduced).

With ``tp.size == 1`` every op is the plain torch op, so the same model code is the
single-process reference. Each sharded parameter carries ``tp_dim`` (the split dim), so the
full parameter a shard belongs to is known: see :func:`shard`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """One lane's TP group: ``size`` ranks, this rank's tp ``index`` (its shard), the process group."""

    size: int = 1
    index: int = 0
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"tp index {self.index} is outside 0..{self.size - 1}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor parallel size {self.size} needs a process group")

    def split(self, n: int, what: str) -> int:
        """``n / size``, or a clear error naming ``what``."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


NO_TP = TensorParallel()


def shard(full: torch.Tensor, dim: int | None, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard of a full parameter (``dim is None``: replicated, the whole tensor)."""
    if dim is None or tp.size == 1:
        return full
    n = full.shape[dim] // tp.size
    return full.narrow(dim, tp.index * n, n)


def mark(param: nn.Parameter, dim: int | None) -> nn.Parameter:
    param.tp_dim = dim  # type: ignore[attr-defined]
    return param


# ---- communication with autograd ------------------------------------------------------


def via_host(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """gloo moves only CPU tensors: a CUDA tensor on a gloo group is staged through host memory."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce; CUDA tensors on a gloo group go through host memory."""
    if via_host(x, group):
        host = x.cpu()
        dist.all_reduce(host, op=op, group=group)
        x.copy_(host)
    else:
        dist.all_reduce(x, op=op, group=group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()
        _all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over the TP group backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce forward over the TP group; identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


# ---- layers --------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local.T`` with ``W`` split along its output dim (no bias)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = NO_TP, *,
                 copy_input: bool = True, what: str = "output features", device=None, dtype=None) -> None:
        super().__init__()
        self.tp = tp
        self.copy_input = copy_input
        local = tp.split(out_features, what)
        self.weight = mark(nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype)), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.tp)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = sum_tp x_local @ W_local.T`` with ``W`` split along its input dim (no bias)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = NO_TP, *,
                 what: str = "input features", device=None, dtype=None) -> None:
        super().__init__()
        self.tp = tp
        local = tp.split(in_features, what)
        self.weight = mark(nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocab rows are split over the TP group."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel = NO_TP, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = tp.split(vocab_size, "vocab_size")
        self.start = tp.index * self.local_vocab
        self.weight = mark(nn.Parameter(torch.empty(self.local_vocab, dim, device=device, dtype=dtype)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(out, self.tp)


# ---- loss --------------------------------------------------------------------------


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are reduced in fp32; fp32/fp64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        # logits [N, V_local], labels [N] (global ids, IGNORE_INDEX for no loss)
        logits = _upcast(logits)
        m = logits.amax(dim=-1)  # [N]
        _all_reduce(m, group, dist.ReduceOp.MAX)
        e = torch.exp(logits - m[:, None])  # [N, V_local]
        den = e.sum(dim=-1)
        _all_reduce(den, group)
        local = labels - start
        valid = labels != IGNORE_INDEX
        mine = valid & (local >= 0) & (local < logits.shape[-1])
        idx = local.clamp(0, logits.shape[-1] - 1)
        target = torch.where(mine, logits.gather(1, idx[:, None]).squeeze(1) - m, torch.zeros_like(m))
        _all_reduce(target, group)
        loss = torch.where(valid, torch.log(den) - target, torch.zeros_like(m))
        ctx.save_for_backward(e / den[:, None], idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax * (g * valid)[:, None]
        grad.scatter_add_(1, idx[:, None], -(g * mine)[:, None])
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 tp: TensorParallel = NO_TP) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ``labels == IGNORE_INDEX``) from vocab-split ``logits [N, V/tp]``."""
    if tp.size == 1:
        return F.cross_entropy(_upcast(logits), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return _VocabParallelCE.apply(logits, labels, tp.index * logits.shape[-1], tp.group)
