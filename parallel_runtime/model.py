"""A small LLaMA-style decoder on packed batches (RMSNorm, RoPE, SwiGLU, grouped-query attention).

Inputs are flat packed microbatches: ``input_ids``/``labels``/``position_ids`` ``[T]``. RoPE
reads ``position_ids`` (the position inside each segment); attention is causal inside each
doc and never crosses docs. Attention itself is a callable ``attn(q, k, v) -> o`` bound to
the microbatch: :func:`parallel_runtime.engines.attention.varlen_attention` when a lane holds whole
docs, a context-parallel engine (:mod:`parallel_runtime.engines.context`) otherwise.

Pieces for a pipeline: a :class:`Transformer` may hold only a range of layers, with the
embedding (``first_stage``) and the head (``last_stage``) where they belong;
``embed`` -> ``run_layers`` -> ``head_loss`` is the forward. Parameter names are those of
the full model (``layers.<global index>...``) and every sharded parameter carries
``tp_dim``, so :meth:`Transformer.full_shapes` / :func:`~parallel_runtime.engines.tensor.shard`
place any shard in full-model coordinates. Initialisation is a function of (seed, name) on
the full shape, so every layout starts from the same model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel_runtime.engines.attention import host_bounds, varlen_attention
from parallel_runtime.engines.tensor import (
    NO_TP,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    copy_to_tp,
    mark,
    shard,
    vocab_parallel_cross_entropy,
)

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> o


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the decoder. The defaults are tiny enough for exact fp32 CPU tests."""

    vocab_size: int = 256  # byte-level tokens
    hidden: int = 64  # residual width
    num_layers: int = 4
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int = 0  # 0: hidden // num_heads
    ffn_hidden: int = 128  # SwiGLU inner width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # head reuses the embedding matrix
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim == 0 and self.hidden % self.num_heads:
            raise ValueError(f"ModelConfig.hidden ({self.hidden}) is not divisible by num_heads "
                             f"({self.num_heads}); set head_dim explicitly")
        if self.dim_per_head % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.dim_per_head}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    def check_parallel(self, *, tp: int = 1, ulysses: int = 1) -> None:
        """ValueError unless this shape splits over ``tp`` TP ranks and a Ulysses degree ``ulysses``."""
        for name in ("num_heads", "num_kv_heads", "vocab_size", "ffn_hidden"):
            if getattr(self, name) % tp:
                raise ValueError(f"ModelConfig.{name} ({getattr(self, name)}) is not divisible by tp={tp}")
        kv_local = self.num_kv_heads // tp
        if kv_local % ulysses:
            raise ValueError(f"Ulysses degree {ulysses} must divide the KV heads per TP rank "
                             f"({self.num_kv_heads} / tp {tp} = {kv_local}); use ring attention or a "
                             f"nested engine with a smaller inner size")


# ---- building blocks -------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mark(nn.Parameter(torch.ones(dim, device=device, dtype=dtype)), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim/2]`` for the given positions."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float64) / head_dim)
    ang = position_ids.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, H, D]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention; q/k/v column-parallel (heads split over TP), o row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **kw) -> None:
        super().__init__()
        hd = cfg.dim_per_head
        self.tp = tp
        self.head_dim = hd
        self.num_heads = tp.split(cfg.num_heads, "num_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_kv_heads")
        self.q_proj = ColumnParallelLinear(cfg.hidden, cfg.num_heads * hd, tp, copy_input=False, **kw)
        self.k_proj = ColumnParallelLinear(cfg.hidden, cfg.num_kv_heads * hd, tp, copy_input=False, **kw)
        self.v_proj = ColumnParallelLinear(cfg.hidden, cfg.num_kv_heads * hd, tp, copy_input=False, **kw)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden, tp, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attn) -> torch.Tensor:
        t = x.shape[0]
        x = copy_to_tp(x, self.tp)
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        o = attn(q, k, v)  # [T, H_local, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **kw) -> None:
        super().__init__()
        self.tp = tp
        self.gate = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, tp, copy_input=False, what="ffn_hidden", **kw)
        self.up = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, tp, copy_input=False, what="ffn_hidden", **kw)
        self.down = RowParallelLinear(cfg.ffn_hidden, cfg.hidden, tp, what="ffn_hidden", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **kw) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, **kw)
        self.attn = Attention(cfg, tp, **kw)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, **kw)
        self.mlp = MLP(cfg, tp, **kw)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attn) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, attn)
        return h + self.mlp(self.mlp_norm(h))


# ---- the model -------------------------------------------------------------------------


class Transformer(nn.Module):
    """The decoder, or the part of it one pipeline stage runs.

    ``layers``: global indices of the blocks this stage holds (default: all).
    ``first_stage`` holds the embedding, ``last_stage`` the final norm and head (with tied
    embeddings a last stage that is not also first holds its own copy of ``embed.weight``,
    used only by the head; summing both copies' gradients gives the tied gradient).
    """

    def __init__(self, config: ModelConfig, *, tp: TensorParallel = NO_TP, layers: Iterable[int] | None = None,
                 first_stage: bool = True, last_stage: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0) -> None:
        super().__init__()
        config.check_parallel(tp=tp.size)
        self.config = config
        self.tp = tp
        self.first_stage = first_stage
        self.last_stage = last_stage
        self.recompute = False  # activation checkpointing per block (train.recompute); the math is unchanged
        kw = {"device": device, "dtype": dtype}
        idx = list(range(config.num_layers)) if layers is None else [int(i) for i in layers]
        if any(not 0 <= i < config.num_layers for i in idx):
            raise ValueError(f"layer indices {idx} outside 0..{config.num_layers - 1}")
        self.embed = (VocabParallelEmbedding(config.vocab_size, config.hidden, tp, **kw)
                      if first_stage or (last_stage and config.tie_embeddings) else None)
        self.layers = nn.ModuleDict({str(i): Block(config, tp, **kw) for i in idx})
        self.norm = RMSNorm(config.hidden, config.norm_eps, **kw) if last_stage else None
        self.head = (ColumnParallelLinear(config.hidden, config.vocab_size, tp, what="vocab_size", **kw)
                     if last_stage and not config.tie_embeddings else None)
        if seed is not None:
            self.reset_parameters(seed)

    # ---- parameters in full-model coordinates -------------------------------------------
    def full_shapes(self) -> dict[str, tuple[tuple[int, ...], int | None]]:
        """name -> (full shape, tp_dim) for every local parameter."""
        out = {}
        for name, p in self.named_parameters():
            dim = getattr(p, "tp_dim", None)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= self.tp.size
            out[name] = (tuple(shape), dim)
        return out

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise every parameter from (seed, name) on its full shape, then take this rank's shard."""
        std = self.config.init_std
        out_std = std / (2 * self.config.num_layers) ** 0.5
        params = dict(self.named_parameters())
        for name, (shape, dim) in self.full_shapes().items():
            p = params[name]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 1_000_003 * seed) % 2**63)
            s = out_std if name.endswith(("o_proj.weight", "down.weight")) else std
            full = torch.randn(shape, generator=g, dtype=torch.float32) * s
            p.copy_(shard(full, dim, self.tp))

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of each full-model tensor in ``state``."""
        for name, p in self.named_parameters():
            if name not in state:
                raise ValueError(f"full state dict has no '{name}'")
            p.copy_(shard(state[name], getattr(p, "tp_dim", None), self.tp))

    # ---- forward pieces ---------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]`` (first stage)."""
        if self.embed is None or not self.first_stage:
            raise ValueError("embed_tokens needs a first-stage model (first_stage=True)")
        return self.embed(input_ids)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor, attn: Attn) -> torch.Tensor:
        """Run this stage's blocks on ``h [T, hidden]``."""
        cfg = self.config
        cos, sin = rope_tables(position_ids, cfg.dim_per_head, cfg.rope_theta, h.dtype)
        for block in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                # keep only the block's input; its inside (attention engine collectives included) runs
                # again in backward, in the same block order on every rank of a group
                h = checkpoint(block, h, cos, sin, attn, use_reentrant=False)
            else:
                h = block(h, cos, sin, attn)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, vocab/tp]`` this rank's vocab shard of the logits (last stage)."""
        if self.norm is None:
            raise ValueError("logits/head_loss need a last-stage model (last_stage=True)")
        return self._project(self.norm(h))

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """The head on normed ``h [T, hidden]``: ``[T, vocab/tp]``."""
        if self.head is not None:
            return self.head(h)
        return F.linear(copy_to_tp(h, self.tp), self.embed.weight)

    def _token_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self._project(h), labels, self.tp).sum()

    def head_loss(self, h: torch.Tensor, labels: torch.Tensor, num_valid_tokens: int) -> torch.Tensor:
        """Sum of token losses divided by the step's global number of valid tokens; the logits are made
        (and reduced in fp32) a chunk of tokens at a time (:func:`chunked_loss_sum`)."""
        if num_valid_tokens < 1:
            raise ValueError(f"num_valid_tokens must be >= 1, got {num_valid_tokens}")
        if self.norm is None:
            raise ValueError("logits/head_loss need a last-stage model (last_stage=True)")
        vocab = self.config.vocab_size // self.tp.size
        return chunked_loss_sum(self._token_loss_sum, self.norm(h), labels, vocab) / num_valid_tokens

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *,
                attn: Attn, num_valid_tokens: int) -> torch.Tensor:
        """Loss of a whole-model pass (first and last stage)."""
        h = self.run_layers(self.embed_tokens(input_ids), position_ids, attn)
        return self.head_loss(h, labels, num_valid_tokens)


LOSS_CHUNK_BYTES = 256 << 20  # fp32 logits of one chunk of the loss head: [tokens, vocab / tp] x 4 bytes


def chunked_loss_sum(loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], h: torch.Tensor,
                     labels: torch.Tensor, vocab: int, chunk_bytes: int | None = None) -> torch.Tensor:
    """``loss_sum(h, labels)`` (the head and the sum of its token losses on ``h [T, hidden]``, ``labels [T]``)
    over chunks of tokens whose fp32 logits ``[C, vocab]`` fit ``chunk_bytes``, added up.

    Why: the head's logits are ``[T, vocab]``, reduced in fp32: at 16K tokens and a 128K vocabulary 8 GiB
    for the upcast alone, and as much again kept for backward. Chunk by chunk only one chunk's logits
    live at a time: each chunk runs under non-reentrant activation checkpointing (it keeps its slice of
    ``h`` only and makes its logits again in backward: one more head matmul per chunk, its collectives,
    a TP head's included, replayed in the same order on every rank). The autograd graph is the one of
    the unchunked head, so every parameter's gradient is still accumulated once per backward. Where all
    ``T`` tokens fit one chunk (small vocabularies, short microbatches) it is the plain call, no recompute.
    ``chunk_bytes``: default :data:`LOSS_CHUNK_BYTES` (read at the call)."""
    per = max(1, (LOSS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab))  # tokens per chunk
    if h.shape[0] <= per:
        return loss_sum(h, labels)
    run = partial(checkpoint, loss_sum, use_reentrant=False, preserve_rng_state=False) \
        if torch.is_grad_enabled() else loss_sum
    parts = [run(hc, lc) for hc, lc in zip(h.split(per), labels.split(per), strict=True)]
    return torch.stack(parts).sum()


def local_attention(cu_seqlens: torch.Tensor, impl: str = "auto", *,
                    host_cu_seqlens: np.ndarray | None = None) -> Attn:
    """The attention callable of a lane that holds whole docs (no context parallelism); ``host_cu_seqlens``:
    the bounds on the host, so no layer reads lengths or the longest doc from the device."""
    host = host_bounds(cu_seqlens, host_cu_seqlens)  # [docs + 1], read once per microbatch at most
    max_seqlen = int(np.diff(host).max(initial=0))
    return partial(_local, cu_seqlens=cu_seqlens, impl=impl, host=host, max_seqlen=max_seqlen)


def _local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, impl: str,
           host: np.ndarray, max_seqlen: int) -> torch.Tensor:
    return varlen_attention(q, k, v, cu_seqlens, impl=impl, max_seqlen=max_seqlen, host_cu_seqlens=host)
