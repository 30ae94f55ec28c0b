"""The attention function the runtime registers in transformers: HF attention layers call the CP engines.

``register()`` adds ``"bl_cp"`` to transformers' ``AttentionInterface`` only: an implementation
without a mask function makes transformers build no mask at all (the engines know each doc's
bounds from the microbatch, and no dense ``[T, T]`` mask is ever made). A model whose
``config._attn_implementation`` is ``"bl_cp"`` then calls :func:`cp_attention_forward` in every
layer with ``query [1, H, T, D]`` and ``key``/``value`` ``[1, Hkv, T, D]`` (after RoPE) plus the
keyword arguments of the model's forward; the runtime passes the microbatch's bound attention
callable there as ``bl_attn`` (``(q [T, H, D], k, v [T, Hkv, D]) -> o [T, H, D]``: local varlen
attention, or a ring / Ulysses / nested engine bound to the microbatch's segments). Nothing is
global per microbatch: two models, or two microbatches in flight, never share state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

NAME = "bl_cp"
BOUND_KWARG = "bl_attn"


def register() -> None:
    """Register :data:`NAME` in transformers (idempotent)."""
    from transformers import AttentionInterface  # heavy optional dependency (the hf extra)

    AttentionInterface.register(NAME, cp_attention_forward)


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature on top of the bound engine; returns ``(o [1, T, H, D], None)``."""
    attn = kwargs.get(BOUND_KWARG)
    if attn is None:
        raise ValueError(f"attention '{NAME}' needs the microbatch's engine as the '{BOUND_KWARG}' keyword of the "
                         f"model's forward (run the model through parallel_runtime.hf.model.HFCausalLM)")
    b, h, t, d = query.shape
    if b != 1:
        raise ValueError(f"attention '{NAME}' runs one packed sequence per call (batch 1), got batch {b}")
    if dropout:
        raise ValueError(f"attention '{NAME}' has no attention dropout (got {dropout}); set attention_dropout: 0")
    if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-9):
        raise ValueError(f"attention '{NAME}' scales scores by 1/sqrt(head_dim); the model asks {scaling}")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"attention '{NAME}' is causal only")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention '{NAME}' does not support softcap")
    # [1, H, T, D] -> [T, H, D]: the engines' packed layout (tokens first), as views: local attention reads
    # each doc's [1, H, L, D] slice of the model's own tensors (no copies); CP engines make their input contiguous
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    o = attn(q, k, v)  # [T, H, D]
    return o.unsqueeze(0), None  # [1, T, H, D], as transformers' sdpa/eager return it
