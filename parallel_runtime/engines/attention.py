"""Local attention kernels on packed (varlen) batches: causal inside each doc, never across docs.

Three families:

* :func:`varlen_attention` -- the model's attention when a lane holds whole docs
  (``cu_seqlens`` marks them). Differentiable through torch autograd. Implementations:
  ``masked`` (one dense block-diagonal causal mask: the textbook formula, used as the
  reference), ``loop`` (per-doc causal fused SDPA: the CPU default and the CUDA fallback), ``tiled``
  (the tiled kernels below), ``sdpa`` (SDPA with a dense mask; never chosen by ``auto``), ``flash``
  (flash-attention varlen, CUDA default when installed and the dtype is fp16/bf16). A dense
  ``[T, T]`` mask is never built on a GPU unless asked for by name (recipes refuse it there).
* :func:`tiled_forward` / :func:`tiled_backward` -- one (queries x keys) block whose mask is
  given by doc ids and positions, by online softmax over score tiles of at most
  ``TILE_SIZE x TILE_SIZE`` (FlashAttention-2 on the CPU): the forward returns the
  log-sum-exp, the backward recomputes each tile's probabilities from it. Tiles that see
  nothing are skipped (causal costs about half). Memory: the inputs plus one tile. Ring
  attention runs every block through these (or flash-attention on CUDA).
* :func:`block_forward` / :func:`block_backward` -- the same with an explicit dense mask:
  the reference the tiled kernels are tested against.

Shapes: ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]`` with ``H % Hkv == 0`` (grouped-query
attention: query head ``h`` reads KV head ``h // (H // Hkv)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from parallel_runtime.engines.device import on_gpu
from parallel_runtime.engines.flash import flash_available

IMPLS = ("auto", "masked", "loop", "sdpa", "flash", "tiled")
DENSE_IMPLS = ("masked", "sdpa")  # a [T, T] mask over the whole microbatch: tests and small CPU batches only


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


def resolve_impl(impl: str, q: torch.Tensor) -> str:
    """The kernel ``impl`` names for ``q``: ``auto`` is flash-attention on a GPU in fp16/bf16 when it is
    installed, else the per-doc fused SDPA loop (linear memory in tokens); never a dense ``[T, T]`` mask."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl '{impl}'; choose one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if on_gpu(q) and q.dtype in (torch.float16, torch.bfloat16) and flash_available():
        return "flash"
    return "loop"  # per-doc work (sum of L^2), not one dense T x T mask


def host_bounds(cu_seqlens: torch.Tensor | np.ndarray, host: np.ndarray | None = None) -> np.ndarray:
    """``[docs + 1]`` int64 doc bounds on the host: ``host`` when the caller has them (no device read), else
    read from ``cu_seqlens`` (a host sync on a GPU: the runtime always passes them)."""
    if host is not None:
        return np.asarray(host, dtype=np.int64)
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.detach().cpu().numpy().astype(np.int64)
    return np.asarray(cu_seqlens, dtype=np.int64)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     impl: str = "auto", max_seqlen: int | None = None,
                     host_cu_seqlens: np.ndarray | None = None) -> torch.Tensor:
    """Causal attention inside each doc of a packed batch. Returns ``[T, H, D]``. ``host_cu_seqlens``: the same
    bounds on the host (then nothing is read from the device: lengths, ``max_seqlen``)."""
    t, h, d = q.shape
    bounds = host_bounds(cu_seqlens, host_cu_seqlens)  # [docs + 1]
    if int(bounds[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(bounds[-1])} but the batch has {t} tokens")
    impl = resolve_impl(impl, q)
    scale = 1.0 / math.sqrt(d)
    if impl == "flash":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        q, k, v = (x.contiguous() for x in (q, k, v))  # token-major rows, whatever views the caller passed
        ms = max_seqlen if max_seqlen is not None else int(np.diff(bounds).max(initial=0))
        return flash_attn_varlen_func(q, k, v, cu, cu, ms, ms, softmax_scale=scale, causal=True)
    if impl == "tiled":
        return tiled_varlen(q, k, v, cu_seqlens)
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    if impl == "loop" and q.device.type == "cpu" and torch.is_grad_enabled() and (
            q.requires_grad or kx.requires_grad or vx.requires_grad):
        return DocLoopAttention.apply(q, kx, vx, tuple(bounds.tolist()), scale)
    if impl == "loop":
        outs = []
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
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


class DocLoopAttention(torch.autograd.Function):
    """The per-doc loop on CPU as one autograd function: torch's fused (flash) SDPA kernel per doc, forward and
    backward, the same ops and bits as calling ``F.scaled_dot_product_attention`` per doc and concatenating.
    ``q, k, v [T, H, D]`` (k, v with the query's heads), ``bounds`` the docs' ``[docs + 1]`` token bounds
    -> ``[T, H, D]``. Why: it keeps one ``[T, H, D]`` output for backward, the tensor it returns (which the
    output projection keeps too, as a view), where SDPA per doc kept its own ``[1, H, L, D]`` outputs
    beside the concatenation (one ``[T, H, D]`` fewer per layer: 16 MB per 1,024-token microbatch of the
    27.5M benchmark model)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...],
                scale: float) -> torch.Tensor:
        docs = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        out = q.new_zeros(q.shape)  # [T, H, D]
        lses = []  # [1, H, L] per doc
        for a, b in docs:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _heads_first(q[a:b]), _heads_first(k[a:b]), _heads_first(v[a:b]), 0.0, True, scale=scale)
            out[a:b] = o[0].transpose(0, 1)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.docs, ctx.scale = docs, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, b), lse in zip(ctx.docs, lses, strict=True):
            dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(_heads_first(x[a:b]) for x in (grad, q, k, v, out)), lse, 0.0, True, scale=ctx.scale)
            dq[a:b], dk[a:b], dv[a:b] = dq_p[0].transpose(0, 1), dk_p[0].transpose(0, 1), dv_p[0].transpose(0, 1)
        return dq, dk, dv, None, None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D] -> [1, H, L, D]`` (a view): the layout torch's SDPA kernels take."""
    return x.transpose(0, 1)[None]


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


# ---- tiled blocks (online softmax; no score tensor beyond one tile) ---------------------------

TILE_SIZE = 512  # query and key rows per tile: one [H, 512, 512] fp32 score tile is 1 MiB per head


@dataclass(frozen=True)
class _Spans:
    """Tiles of one side of a block: ``[a, b)`` row ranges and the doc ids they touch."""

    bounds: tuple[tuple[int, int], ...]
    doc_lo: np.ndarray  # [tiles] smallest doc id in the tile
    doc_hi: np.ndarray  # [tiles] largest doc id in the tile


def _spans(doc: torch.Tensor, tile: int) -> _Spans:
    d = doc.cpu().numpy()  # [T] int64
    starts = np.arange(0, len(d), tile)
    bounds = tuple((int(a), int(min(a + tile, len(d)))) for a in starts)
    if not len(d):
        return _Spans(bounds=(), doc_lo=np.zeros(0, np.int64), doc_hi=np.zeros(0, np.int64))
    return _Spans(bounds=bounds, doc_lo=np.minimum.reduceat(d, starts), doc_hi=np.maximum.reduceat(d, starts))


def visible_tiles(q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor, k_pos: torch.Tensor,
                  tile: int, host: HostTiles | None = None):
    """Per query tile ``(a, b, [(c, e, mask or None), ...])``: the key tiles it can see. Tiles whose doc
    ranges are disjoint or whose mask is all False are skipped (half the work of a causal block);
    ``mask`` is None where the whole tile is visible. ``host``: the same decisions made on the host
    (:func:`host_tiles`), so nothing is read from the device (masks are built only for partial tiles)."""
    if host is not None:
        for a, b, row in host:
            yield a, b, [(c, e, causal_doc_mask(q_doc[a:b], q_pos[a:b], k_doc[c:e], k_pos[c:e]) if partial else None)
                         for c, e, partial in row]
        return
    qs, ks = _spans(q_doc, tile), _spans(k_doc, tile)
    for qi, (a, b) in enumerate(qs.bounds):
        row = []
        for ki, (c, e) in enumerate(ks.bounds):
            if ks.doc_hi[ki] < qs.doc_lo[qi] or ks.doc_lo[ki] > qs.doc_hi[qi]:
                continue
            mask = causal_doc_mask(q_doc[a:b], q_pos[a:b], k_doc[c:e], k_pos[c:e])  # [tq, tk]
            if not bool(mask.any()):
                continue
            row.append((c, e, None if bool(mask.all()) else mask))
        yield a, b, row


HostTiles = list[tuple[int, int, list[tuple[int, int, bool]]]]  # per query tile (a, b, [(c, e, partial)])


def host_tiles(q_doc: np.ndarray, q_pos: np.ndarray, k_doc: np.ndarray, k_pos: np.ndarray,
               tile: int | None = None) -> HostTiles:
    """:func:`visible_tiles`' decisions from host arrays (``[Tq]``, ``[Tk]`` int64): which key tiles each query
    tile sees and whether partly (a mask is needed) or wholly."""
    tile = tile or TILE_SIZE
    out: HostTiles = []
    for a in range(0, len(q_doc), tile):
        b = min(a + tile, len(q_doc))
        qd, qp = q_doc[a:b], q_pos[a:b]
        row = []
        for c in range(0, len(k_doc), tile):
            e = min(c + tile, len(k_doc))
            kd, kp = k_doc[c:e], k_pos[c:e]
            if kd.max() < qd.min() or kd.min() > qd.max():
                continue
            m = (qd[:, None] == kd[None, :]) & (kp[None, :] <= qp[:, None]) & (kp[None, :] >= 0) & (qp[:, None] >= 0)
            if m.any():
                row.append((c, e, not bool(m.all())))
        out.append((a, b, row))
    return out


def _heads_major(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[t, H, D] -> [Hkv, rep * t, D]: the query heads of one KV head side by side (GQA without copies of K/V)."""
    t, h, d = x.shape
    return x.permute(1, 0, 2).reshape(hkv, h // hkv * t, d)


def _rows_major(x: torch.Tensor, h: int) -> torch.Tensor:
    """Inverse of :func:`_heads_major`: ``[Hkv, rep * t, D] -> [t, H, D]``."""
    hkv, n, d = x.shape
    return x.reshape(h, n // (h // hkv), d).permute(1, 0, 2)


def tiled_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor, q_pos: torch.Tensor,
                  k_doc: torch.Tensor, k_pos: torch.Tensor, scale: float, *,
                  tile: int | None = None, host: HostTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_forward` with the mask given by doc ids and positions (``causal_doc_mask``), by
    online softmax over ``tile x tile`` score tiles. ``q_doc``/``q_pos`` ``[Tq]``, ``k_doc``/``k_pos``
    ``[Tk]``; doc ids must be non-decreasing for the tile skipping to pay off (correct either way).
    Returns ``out [Tq, H, D]`` and ``lse [Tq, H]`` (``-inf`` and 0 on rows that see no key)."""
    tile = tile or TILE_SIZE
    tq, h, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    kh, vh = k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()  # [Hkv, Tk, D]
    out = torch.zeros_like(q)
    lse = torch.full((tq, h), float("-inf"), dtype=q.dtype, device=q.device)
    for a, b, row in visible_tiles(q_doc, q_pos, k_doc, k_pos, tile, host):
        if not row:
            continue
        n = b - a
        qt = _heads_major(q[a:b], hkv) * scale  # [Hkv, rep*n, D]
        m = torch.full(qt.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)  # running max
        den = torch.zeros_like(m)  # running sum of exp(s - m)
        acc = torch.zeros_like(qt)  # running sum of exp(s - m) v
        for c, e, mask in row:
            s = torch.bmm(qt, kh[:, c:e].transpose(1, 2))  # [Hkv, rep*n, tk]
            if mask is not None:
                s.view(hkv, rep, n, e - c).masked_fill_(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = s.sub_(m_safe[..., None]).exp_()  # in place: one tile alive
            alpha = torch.exp(m - m_safe)  # rescales what was summed under the old max (0 when it was -inf)
            den = den * alpha + p.sum(-1)
            acc = torch.baddbmm(acc * alpha[..., None], p, vh[:, c:e])
            m = m_new
        seen = den > 0
        safe_den = torch.where(seen, den, torch.ones_like(den))
        out[a:b] = _rows_major(acc / safe_den[..., None], h)
        m_safe = torch.where(seen, m, torch.zeros_like(m))
        lse[a:b] = torch.where(seen, m_safe + torch.log(safe_den), torch.full_like(m, float("-inf"))).reshape(
            h, n).T
    return out, lse


def tiled_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
                   lse: torch.Tensor, q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor,
                   k_pos: torch.Tensor, scale: float, *, tile: int | None = None,
                   host: HostTiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` by tiles: P is recomputed per tile from Q, K and the final ``lse``
    (FlashAttention-2): ``dV += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dQ += dS K``, ``dK += dS^T Q``."""
    tile = tile or TILE_SIZE
    h, hkv = q.shape[1], k.shape[1]
    rep = h // hkv
    kh, vh = k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()  # [Hkv, Tk, D]
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)  # [Hkv, Tk, D]
    for a, b, row in visible_tiles(q_doc, q_pos, k_doc, k_pos, tile, host):
        if not row:
            continue
        n = b - a
        qt = _heads_major(q[a:b], hkv)  # [Hkv, rep*n, D]
        dot = _heads_major(dout[a:b], hkv)
        lse_t = lse[a:b].T.reshape(hkv, rep * n)
        # rows that see no key anywhere: exp(s - inf) = 0, so they get no gradient
        lse_t = torch.where(torch.isfinite(lse_t), lse_t, torch.full_like(lse_t, float("inf")))
        delta_t = delta[a:b].T.reshape(hkv, rep * n)
        dq_t = torch.zeros_like(qt)
        for c, e, mask in row:
            kt, vt = kh[:, c:e], vh[:, c:e]
            s = torch.bmm(qt, kt.transpose(1, 2)).mul_(scale)  # [Hkv, rep*n, tk]
            if mask is not None:
                s.view(hkv, rep, n, e - c).masked_fill_(~mask, float("-inf"))
            p = s.sub_(lse_t[..., None]).exp_()
            dv[:, c:e].baddbmm_(p.transpose(1, 2), dot)
            ds = torch.bmm(dot, vt.transpose(1, 2)).sub_(delta_t[..., None]).mul_(p)  # dS = P (dP - D)
            dq_t.baddbmm_(ds, kt, alpha=scale)
            dk[:, c:e].baddbmm_(ds.transpose(1, 2), qt, alpha=scale)
        dq[a:b] = _rows_major(dq_t, h)
    return dq, dk.permute(1, 0, 2).contiguous(), dv.permute(1, 0, 2).contiguous()


class _TiledVarlen(torch.autograd.Function):
    """Local varlen causal attention by tiles (``impl="tiled"``)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[2])
        out, lse = tiled_forward(q, k, v, doc, pos, doc, pos, scale)
        ctx.save_for_backward(q, k, v, out, lse, doc, pos)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, doc, pos = ctx.saved_tensors
        delta = (dout * out).sum(-1)  # [T, H]
        dq, dk, dv = tiled_backward(dout.contiguous(), q, k, v, delta, lse, doc, pos, doc, pos,
                                    1.0 / math.sqrt(q.shape[2]))
        return dq, dk, dv, None, None


def tiled_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each doc by tiles; differentiable (memory linear in tokens)."""
    t = q.shape[0]
    cu = cu_seqlens.to(q.device).long()
    doc = doc_ids_from_cu_seqlens(cu, t)  # [T]
    pos = torch.arange(t, device=q.device) - cu[doc]  # [T] position inside its doc
    return _TiledVarlen.apply(q, k, v, doc, pos)


# ---- fused CPU blocks (torch's flash SDPA kernels, which return and take the LSE) ------------

# one piece of a block: query rows [qa, qb) x key rows [ka, kb), fully visible (causal False) or
# causal with top-left alignment (the first query and the first key share a position)
Piece = tuple[int, int, int, int, bool]


def fused_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple[Piece, ...],
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tiled_forward` for a block given as pieces, through ``aten._scaled_dot_product_flash_attention_for_cpu``
    (about 2x faster than the tiled kernel on CPU); rows in no piece get ``out = 0``, ``lse = -inf``."""
    h = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)  # [Tq, H]
    for qa, qb, ka, kb, causal in pieces:
        o, l_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[qa:qb].transpose(0, 1)[None], _expand_kv(k[ka:kb], h).transpose(0, 1)[None],
            _expand_kv(v[ka:kb], h).transpose(0, 1)[None], 0.0, causal, scale=scale)
        out[qa:qb], lse[qa:qb] = merge_block(out[qa:qb], lse[qa:qb], o[0].transpose(0, 1), l_p[0].T)
    return out, lse


def fused_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, pieces: tuple[Piece, ...],
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of a block given as pieces, from the *final* ``out`` and ``lse`` of its query rows
    (the fused kernel forms ``delta = rowsum(dout * out)`` itself)."""
    h, hkv = q.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qa, qb, ka, kb, causal in pieces:
        dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[qa:qb].transpose(0, 1)[None], q[qa:qb].transpose(0, 1)[None],
            _expand_kv(k[ka:kb], h).transpose(0, 1)[None], _expand_kv(v[ka:kb], h).transpose(0, 1)[None],
            out[qa:qb].transpose(0, 1)[None], lse[qa:qb].T[None].contiguous(), 0.0, causal, scale=scale)
        dq[qa:qb] += dq_p[0].transpose(0, 1)
        dk[ka:kb] += _reduce_kv(dk_p[0].transpose(0, 1).contiguous(), hkv)
        dv[ka:kb] += _reduce_kv(dv_p[0].transpose(0, 1).contiguous(), hkv)
    return dq, dk, dv
