"""Ring blocks on CUDA through flash-attention's varlen kernels (forward returns, backward consumes the LSE).

Selected only when the tensors are on CUDA in fp16/bf16 and ``flash_attn`` imports; everywhere
else the ring runs :func:`parallel_runtime.engines.attention.tiled_forward`. A ring block holds,
segment after segment, the query rows and key rows of the segments where something is visible,
and in THE zigzag layout each such (query run, key run) pair is either fully visible (off-diagonal
steps) or causal with bottom-right alignment on padded positions (the diagonal blocks), which is
exactly flash-attention's ``causal`` for ``seqlen_q <= seqlen_k``. Padding sits at the end of every
segment, so a real query never sees a padding key; padding rows get junk outputs that nothing
reads (their gradients are zero because nothing downstream reads them).

The private ``_flash_attn_varlen_forward/backward`` functions changed arguments across releases
(``window_size`` vs ``window_size_left/right``, ``softcap``, ...), so the call passes the values by
name to whichever parameters the installed version declares. Not exercised by the CPU test suite.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from parallel_runtime.engines.device import on_gpu


@functools.cache  # asked per ring block and attention call: a failed import is not cached by Python
def flash_available() -> bool:
    """True when the optional ``flash_attn`` package imports."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_blocks_usable(q: torch.Tensor) -> bool:
    """True when a ring block of ``q`` runs through flash-attention (CUDA, fp16/bf16, installed)."""
    return on_gpu(q) and q.dtype in (torch.float16, torch.bfloat16) and flash_available()


def _call(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call ``fn`` with the entries of ``values`` its signature names (the rest keep their defaults)."""
    # flash-attn >= 2.7 wraps these in torch custom ops: the signature is the wrapped function's
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise RuntimeError(f"this flash_attn version's {getattr(fn, '__name__', fn)} needs {missing}; ring "
                           f"blocks support flash-attn 2.x (uninstall it to use the tiled torch kernels)")
    return fn(**{n: values[n] for n in params if n in values})


def _common(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
            scale: float) -> dict[str, Any]:
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
            "dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "window_size": (-1, -1),
            "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
            "deterministic": False, "rng_state": None, "return_softmax": False, "block_table": None,
            "leftpad_k": None, "seqused_k": None}


def flash_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Tq, H, D]`` and ``lse [Tq, H]`` (fp32) of one ring block."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward  # optional CUDA dependency

    res = _call(_flash_attn_varlen_forward, {"q": q, "k": k, "v": v, **_common(cu_q, cu_k, max_q, max_k, causal,
                                                                                  scale)})
    lse = res[5] if len(res) >= 6 else res[1]  # < 2.6: (out, q, k, v, out_padded, lse, ...); later (out, lse, ...)
    return res[0], lse.T  # lse: [H, Tq] -> [Tq, H]


def flash_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                         causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one ring block given the final (merged) ``out`` and ``lse [Tq, H]``."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward  # optional CUDA dependency

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call(_flash_attn_varlen_backward, {"dout": dout, "q": q, "k": k, "v": v, "out": out,
                                        "softmax_lse": lse.float().T.contiguous(), "dq": dq, "dk": dk, "dv": dv,
                                        **_common(cu_q, cu_k, max_q, max_k, causal, scale)})
    return dq, dk, dv
