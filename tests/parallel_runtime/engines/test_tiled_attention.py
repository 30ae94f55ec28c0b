"""Tier 1: the tiled online-softmax kernels equal the dense block kernels and torch autograd.

``tiled_forward`` / ``tiled_backward`` never hold more than one score tile; they are checked
against ``block_forward`` / ``block_backward`` (one dense masked block, itself checked against
autograd in test_model.py) on causal, varlen (with padding rows), grouped-query and
cross-block (queries and keys from different rows, as in a ring step) cases, with tile sizes
that do not divide the lengths.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parallel_runtime.engines.attention import (
    block_backward,
    block_forward,
    causal_doc_mask,
    tiled_backward,
    tiled_forward,
    varlen_attention,
    visible_tiles,
)


def rows(lengths: list[int], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """doc id and position of each row of a packed batch; the last ``pad`` rows of each doc are padding (-1)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.where(torch.arange(n) < n - pad, torch.arange(n), -1) for n in lengths])
    return doc, pos


def check(q_doc, q_pos, k_doc, k_pos, heads: int, kv_heads: int, tile: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 8
    q = torch.randn(len(q_doc), heads, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(len(k_doc), kv_heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = 1 / math.sqrt(d)
    mask = causal_doc_mask(q_doc, q_pos, k_doc, k_pos)
    want_out, want_lse = block_forward(q, k, v, mask, scale)
    out, lse = tiled_forward(q, k, v, q_doc, q_pos, k_doc, k_pos, scale, tile=tile)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # rows that see no key: lse = -inf
    assert torch.allclose(out, want_out, atol=1e-12)
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-12)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    delta = (dout * want_out).sum(-1)
    want = block_backward(dout, q, k, v, delta, want_lse, mask, scale)
    got = tiled_backward(dout, q, k, v, delta, lse, q_doc, q_pos, k_doc, k_pos, scale, tile=tile)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("tile", [1, 5, 16, 64])
def test_causal_one_doc_with_tiles_not_dividing_the_length(heads: int, kv_heads: int, tile: int) -> None:
    doc, pos = rows([37])
    check(doc, pos, doc, pos, heads, kv_heads, tile)


@pytest.mark.parametrize("tile", [3, 7, 512])
def test_varlen_docs_with_padding_rows_and_one_token_docs(tile: int) -> None:
    doc, pos = rows([1, 13, 2, 20, 1, 9], pad=1)  # every doc's last row is padding (-1): no key, no gradient
    check(doc, pos, doc, pos, 4, 2, tile, seed=1)


@pytest.mark.parametrize("tile", [4, 9])
def test_cross_block_of_a_ring_step(tile: int) -> None:
    # zigzag: queries are the second half of each doc, keys the whole doc (bottom-right causal),
    # then queries x keys of an earlier half only (fully visible)
    doc, pos = rows([24, 10])
    second = torch.tensor([i for i in range(34) if (i < 24 and pos[i] >= 12) or (i >= 24 and pos[i] >= 5)])
    first = torch.tensor([i for i in range(34) if i not in set(second.tolist())])
    check(doc[second], pos[second], doc, pos, 4, 2, tile, seed=2)
    check(doc[second], pos[second], doc[first], pos[first], 4, 4, tile, seed=3)


def test_tiled_varlen_equals_the_dense_formula_under_autograd() -> None:
    lengths = [30, 1, 17, 45]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    t = sum(lengths)
    base = [torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2)]
    dout = torch.randn(t, 6, 8, generator=g, dtype=torch.float64)
    grads = {}
    for impl in ("masked", "tiled"):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = varlen_attention(q, k, v, cu, impl=impl)
        out.backward(dout)
        grads[impl] = (out.detach(), q.grad, k.grad, v.grad)
    for a, b in zip(grads["tiled"], grads["masked"]):
        assert torch.allclose(a, b, atol=1e-12)


def test_causal_tiles_above_the_diagonal_and_across_docs_are_skipped() -> None:
    doc, pos = rows([100])
    pairs = [len(row) for _, _, row in visible_tiles(doc, pos, doc, pos, 10)]
    assert pairs == list(range(1, 11))  # 55 of 100 tiles: causal costs about half
    doc, pos = rows([40, 40, 40])
    seen = [(a, c) for a, _, row in visible_tiles(doc, pos, doc, pos, 20) for c, _, _ in row]
    assert seen == [(a, c) for d in (0, 40, 80) for a, c in ((d, d), (d + 20, d), (d + 20, d + 20))]  # per doc
    # a fully visible tile carries no mask (none is applied), the diagonal one carries its mask
    row = dict((a, r) for a, _, r in visible_tiles(doc, pos, doc, pos, 20))[20]
    assert [m is None for _, _, m in row] == [True, False]


@pytest.mark.parametrize(("lengths", "degree", "fused"), [((1500, 3, 545), 2, True), ((1500, 3, 545), 3, True),
                                                         ((1, 9, 16, 2, 23, 5), 2, False)])
def test_ring_block_pieces_cover_exactly_the_visible_pairs(lengths: tuple[int, ...], degree: int,
                                                           fused: bool) -> None:
    # the fused CPU kernels see a block as pieces (fully visible, or causal from a shared first
    # position): their union must be the block's doc/position mask, padding excluded
    from parallel_runtime.engines.context import PackedLayout
    from parallel_runtime.engines.ring import FUSED_MIN_ROWS, CommStats, RingPass

    lay = PackedLayout(lengths=lengths, degree=degree)
    positions = [lay.ring_positions(s) for s in range(degree)]
    for j in range(degree):
        ring = RingPass(positions, lay.padded // (2 * degree), j, None, tuple(range(degree)), True, CommStats(),
                        torch.device("cpu"))
        blocks = [b for b in (ring.diag_second, ring.diag_first, *ring.off) if b is not None]
        assert blocks
        for b in blocks:
            want = causal_doc_mask(b.q_doc, b.q_pos, b.k_doc, b.k_pos)
            if b.pieces is None:
                assert not fused
                continue
            assert fused and len(b.pieces) * FUSED_MIN_ROWS <= len(b.q_rows)
            got = torch.zeros_like(want)
            for qa, qb, ka, kb, causal in b.pieces:
                part = torch.ones(qb - qa, kb - ka, dtype=torch.bool)
                got[qa:qb, ka:kb] |= torch.tril(part) if causal else part
            assert torch.equal(got, want)


@pytest.mark.parametrize(("bounds", "heads", "kv_heads"), [((0, 96), 4, 4), ((0, 5, 40, 40, 71), 4, 2),
                                                          ((0, 1, 2, 3), 2, 1)])
def test_the_per_doc_loop_is_sdpa_per_doc_bit_for_bit_and_keeps_one_output(bounds: tuple[int, ...], heads: int,
                                                                             kv_heads: int) -> None:
    """The CPU per-doc loop as one autograd function (DocLoopAttention) against F.scaled_dot_product_attention per
    doc and a concatenation: the same output and gradients bit for bit; it keeps one [T, H, D] output, the one
    it returns, which the output projection keeps as a view (SDPA per doc kept its own outputs beside the
    concatenation the projection keeps)."""
    import torch.nn.functional as F

    from parallel_runtime.engines.attention import _expand_kv, varlen_attention
    from parallel_runtime.training.metrics import SavedActivations

    g = torch.Generator().manual_seed(len(bounds))
    t, d = bounds[-1], 8
    q0, k0, v0 = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    w0 = torch.randn(heads * d, 3, generator=g)  # the output projection
    up = torch.randn(t, 3, generator=g)
    runs = []
    for fused in (True, False):
        q, k, v, w = (x.clone().requires_grad_(True) for x in (q0, k0, v0, w0))
        saved = SavedActivations(exclude=[q, k, v, w])
        with saved.hooks():
            if fused:
                o = varlen_attention(q, k, v, torch.tensor(bounds), impl="loop", host_cu_seqlens=np.array(bounds))
            else:
                kx, vx = _expand_kv(k, heads), _expand_kv(v, heads)
                o = torch.cat([F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], kx[a:b].transpose(0, 1)[None], vx[a:b].transpose(0, 1)[None],
                    is_causal=True, scale=d ** -0.5)[0].transpose(0, 1) for a, b in zip(bounds, bounds[1:]) if b > a])
            y = o.reshape(t, -1) @ w
        y.backward(up)
        runs.append((o.detach(), q.grad, k.grad, v.grad, w.grad, saved.peak))
    (*fused, peak_fused), (*plain, peak_plain) = runs
    assert all(torch.equal(x, y) for x, y in zip(fused, plain, strict=True))
    assert peak_plain - peak_fused >= t * heads * d * 4  # the concatenation's second copy of the output
