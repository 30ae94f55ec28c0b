"""Fewer saved activations for the transformers models the runtime trains: the same math, the same gradients.

What autograd keeps for backward per token of a Llama-family decoder layer (hidden ``H``, MLP width ``I``,
fp32): each RMSNorm keeps its input, its normalized input and (through the projection that reads it) its
weighted output; the SwiGLU MLP keeps ``gate``, ``silu(gate)``, ``up`` and (through ``down_proj``) their
product. Two of these are made again cheaply in backward:

* **SwiGLU**: ``down_proj(silu(gate) * up)`` as one autograd function (:class:`SwiGLUDown`) keeping
  ``gate`` and ``up`` only; backward makes ``silu(gate)`` and the product again (elementwise, no matmul)
  and runs the ops autograd would (``down_proj``'s two ``mm``, then ``silu_backward`` of ``grad * up``,
  ``grad * silu(gate)``): ``2 I`` floats per token and layer fewer (``silu(gate)`` and the product
  ``down_proj`` would keep), the same gradients.
* **RMSNorm**: each norm keeps its input only (and its ``[..., 1]`` inverse root mean square) and makes its
  normalized input again in backward (its weighted output is kept by the projections anyway): ``H`` floats
  per token and norm fewer. transformers' own formula (:data:`EXACT_NORMS`: ``weight * (x * rsqrt(mean(x^2)
  + eps))`` in fp32, cast back) runs as one autograd function (:class:`RMSNormKeepInput`) whose backward is
  the ops autograd runs for that forward, in its order (bit for bit the same gradients, fp32 and half); any
  other norm runs under non-reentrant activation checkpointing of its own forward (exact for any formula,
  at the cost of its forward again in backward and the checkpoint's bookkeeping).

On the benchmark's 27.5M Llama (``H`` 512, ``I`` 1,536, 8 layers) a 1,024-token microbatch keeps 375.8 MB
for backward, 245.8 MB with both (-35%; 293.8 MB when the product was still kept), for ~1% more CPU with the
norms checkpointed (``docs/results/hf_speed.md``); the norm function costs what the plain norm does (one
fp32 norm on ``[1, 1024, 512]``, forward and backward: plain 3.53 ms, checkpointed 4.67, the function 3.59;
whole microbatches: ``tools/bench_hf_lean.py``). Under
``train.recompute`` the model's own forwards run: a recomputed layer keeps its input only anyway.

The MLP is replaced only in the classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
with a SiLU (:data:`SWIGLU_MLPS`); any other module whose class name holds ``RMSNorm`` is checkpointed.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# transformers' SwiGLU MLP classes of the supported model types (parallel_runtime.hf.config.SUPPORTED)
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
# transformers' RMSNorm classes whose forward is weight * (x.float() * rsqrt(x.float()^2 mean + eps)).to(x.dtype)
# with the epsilon as ``variance_epsilon`` (the same source in transformers 5 for all four)
EXACT_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


class SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)`` keeping ``gate``, ``up`` and the weight for backward (not
    ``silu(gate)`` nor the product): ``gate, up [..., I]``, ``weight [H, I]`` -> ``[..., H]``."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # [T, H]
        silu = F.silu(gate)  # made again
        # what autograd runs for linear (matmul folded to mm) and then MulBackward0 and SiluBackward0; each
        # [T, I] temporary dropped as soon as it is used (the product right after its mm): this backward's
        # high mark is 4 of them, not 6
        grad_w = g2.t().mm((silu * up).reshape(-1, up.shape[-1])) if ctx.needs_input_grad[2] else None  # [H, I]
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_w, grad_b
        grad_act = g2.mm(weight).view(up.shape)
        grad_up = grad_act * silu
        del silu
        return torch.ops.aten.silu_backward(grad_act * up, gate), grad_up, grad_w, grad_b


class RMSNormKeepInput(torch.autograd.Function):
    """transformers' RMSNorm ``weight * (xf * rsqrt(xf.pow(2).mean(-1) + eps)).to(x.dtype)`` (``xf``: ``x`` in
    fp32) keeping ``x``, ``weight`` and the ``[..., 1]`` fp32 ``rsqrt`` for backward; ``x [..., H]``,
    ``weight [H]``; call it as ``apply(x, x, weight, eps)``. Backward is what autograd runs for that forward,
    op for op (``MulBackward0``, ``ToCopyBackward0``, ``RsqrtBackward0``, ``MeanBackward1``, ``PowBackward0``),
    so the gradients are the same bit for bit; only the normalized input is made again.

    Why ``x`` twice: autograd gives an fp32 ``x`` two gradients of its own (through ``x * r`` and through
    ``x.pow(2)``), which it adds, in that order, to whatever ``x`` already has (the residual stream's): the
    two inputs return them as two pieces, so the engine adds them to ``x`` in the same order (fp32 sums
    are not associative). A half ``x`` goes through the cast to fp32, where the two meet first: one piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_again: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        xn = xf * r  # [..., H], made again
        grad_w = (grad * xn.to(x.dtype)).sum_to_size(weight.shape) if ctx.needs_input_grad[2] else None
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_w, None
        g = (grad * weight).to(torch.float32)  # into the cast back
        grad_r = (g * xf).sum(-1, keepdim=True)  # [..., 1]: x * r's MulBackward0 to r
        grad_mean = -0.5 * grad_r * r.pow(3)  # RsqrtBackward0 (the + eps passes it on)
        grad_pow = grad_mean.expand_as(xf) / xf.shape[-1]  # MeanBackward1
        direct, through_pow = g * r, grad_pow * (2 * xf)  # MulBackward0 to x; PowBackward0 (exponent 2)
        if x.dtype == torch.float32:
            return direct, through_pow, grad_w, None
        return (direct + through_pow).to(x.dtype), None, grad_w, None


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def install(model: nn.Module, active: Callable[[], bool]) -> int:
    """Make ``model``'s SwiGLU MLPs and RMSNorms keep fewer activations while ``active()`` and autograd records
    (their instance ``forward``; every module is still called as a module, so its hooks run: the overlap's wait
    for a pulled weight, the peak sampler); returns how many modules changed."""
    n = 0
    for mod in model.modules():
        if type(mod).__name__ in SWIGLU_MLPS and _is_silu(getattr(mod, "act_fn", None)):
            mod.forward = types.MethodType(_swiglu_forward(mod.forward, active), mod)
            down = mod.down_proj
            down.forward = types.MethodType(_down_forward(down.forward), down)
            n += 1
        elif type(mod).__name__ in EXACT_NORMS and hasattr(mod, "variance_epsilon"):
            mod.forward = types.MethodType(_norm_forward(mod.forward, active), mod)
            n += 1
        elif "RMSNorm" in type(mod).__name__:
            mod.forward = _checkpointed(mod.forward, active)
            n += 1
    return n


def _swiglu_forward(own: Callable, active: Callable[[], bool]) -> Callable:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (active() and torch.is_grad_enabled()):
            return own(x)
        return self.down_proj(self.gate_proj(x), self.up_proj(x))  # called as a module: its hooks run

    return forward


def _down_forward(own: Callable) -> Callable:
    """``down_proj``'s forward: its own on one input, :class:`SwiGLUDown` on ``(gate, up)``."""

    def forward(self: nn.Module, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is None:
            return own(x)
        return SwiGLUDown.apply(x, up, self.weight, self.bias)

    return forward


def _norm_forward(own: Callable, active: Callable[[], bool]) -> Callable:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (active() and torch.is_grad_enabled()):
            return own(x)
        return RMSNormKeepInput.apply(x, x, self.weight, self.variance_epsilon)

    return forward


def _checkpointed(own: Callable, active: Callable[[], bool]) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (active() and torch.is_grad_enabled()):
            return own(x)
        return checkpoint(own, x, use_reentrant=False, preserve_rng_state=False)

    return forward
