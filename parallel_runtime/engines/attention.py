"""Local attention kernels on packed (varlen) batches: causal inside each doc, never across docs.

Two families:

* :func:`varlen_attention` -- the model's attention when a lane holds whole docs
  (``cu_seqlens`` marks them). Differentiable through torch autograd. Implementations:
  ``masked`` (one dense block-diagonal causal mask: the textbook formula, used as the
  reference), ``loop`` (per-doc causal SDPA, CPU default), ``sdpa`` (SDPA with a dense mask,
  CUDA fallback), ``flash`` (flash-attention varlen, CUDA default when installed and the
  dtype is fp16/bf16).
* :func:`block_forward` / :func:`block_backward` -- one (queries x keys) block with an
  explicit mask, returning / consuming the log-sum-exp. Ring attention merges these blocks
  with online softmax and runs the matching backward (the flash-attention identities), so
  they are plain tensor functions, not autograd ops.

Shapes: ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]`` with ``H % Hkv == 0`` (grouped-query
attention: query head ``h`` reads KV head ``h // (H // Hkv)``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMPLS = ("auto", "masked", "loop", "sdpa", "flash")


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, H, D] by repeating each KV head for its query heads."""
    rep = num_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_kv(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [T, Hkv, D]: sum the gradients of the query heads sharing a KV head."""
    t, h, d = x.shape
    return x if h == num_kv_heads else x.view(t, num_kv_heads, h // num_kv_heads, d).sum(2)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] index of the doc each token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                   output_size=total)


def causal_doc_mask(q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor,
                    k_pos: torch.Tensor) -> torch.Tensor:
    """[Tq, Tk] True where query may read key: same doc, key not after query, both real (pos >= 0)."""
    return ((q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            & (k_pos[None, :] >= 0) & (q_pos[:, None] >= 0))


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, q: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl '{impl}'; choose one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if q.is_cuda:
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) and _flash_available() else "sdpa"
    return "loop"  # per-doc work (sum of L^2), not one dense T x T mask


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     impl: str = "auto", max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention inside each doc of a packed batch. Returns ``[T, H, D]``."""
    t, h, d = q.shape
    if int(cu_seqlens[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the batch has {t} tokens")
    impl = resolve_impl(impl, q)
    scale = 1.0 / math.sqrt(d)
    if impl == "flash":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        ms = max_seqlen if max_seqlen is not None else int((cu[1:] - cu[:-1]).max())
        return flash_attn_varlen_func(q, k, v, cu, cu, ms, ms, softmax_scale=scale, causal=True)
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    if impl == "loop":
        outs = []
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                # [1, H, L, D]: with a batch dim CPU SDPA takes its fused (flash) kernel, not the
                # materialized [H, L, L] math path (3-4x faster at L = 1024, the same result)
                o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], kx[a:b].transpose(0, 1)[None],
                                                   vx[a:b].transpose(0, 1)[None], is_causal=True, scale=scale)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)
    docs = doc_ids_from_cu_seqlens(cu_seqlens.to(q.device), t)  # [T]
    pos = torch.arange(t, device=q.device)
    mask = causal_doc_mask(docs, pos, docs, pos)  # [T, T]
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kx.transpose(0, 1), vx.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        return o.transpose(0, 1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale  # [H, T, T]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vx)


# ---- blocks with log-sum-exp (ring attention) -----------------------------------------


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block. Returns ``out [Tq, H, D]`` and ``lse [Tq, H]``.

    Rows whose mask is all False get ``out = 0`` and ``lse = -inf`` (they merge as no-ops).
    """
    h = q.shape[1]
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale  # [H, Tq, Tk]
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1)  # [H, Tq]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe[..., None])
    den = p.sum(dim=-1)  # [H, Tq]
    nonempty = den > 0
    out = torch.einsum("hqk,khd->qhd", p, vx) / torch.where(nonempty, den, torch.ones_like(den)).T[..., None]
    lse = torch.where(nonempty, m_safe + torch.log(torch.where(nonempty, den, torch.ones_like(den))),
                      torch.full_like(den, float("-inf")))
    return out, lse.T.contiguous()


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   delta: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* (merged) ``lse [Tq, H]`` and
    ``delta = rowsum(dout * out_final) [Tq, H]``. Returns ``dq, dk, dv`` (dk/dv ``[Tk, Hkv, D]``)."""
    h, hkv = q.shape[1], k.shape[1]
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale  # [H, Tq, Tk]
    lse_t = lse.T  # [H, Tq]
    finite = torch.isfinite(lse_t)
    keep = mask[None] & finite[..., None]  # [H, Tq, Tk]; rows with no key anywhere get no gradient
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s - torch.where(finite, lse_t, torch.zeros_like(lse_t))[..., None])
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, vx)
    ds = p * (dp - delta.T[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kx) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    return dq, _reduce_kv(dk, hkv), _reduce_kv(dv, hkv)


def merge_block(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (``-inf`` lse = empty)."""
    new = torch.logaddexp(lse, lse_b)  # [Tq, H]
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    w_a = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(new))
    return out * w_a[..., None] + out_b * w_b[..., None], new
