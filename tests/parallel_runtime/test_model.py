"""Tier 1: the model and the local attention kernels in one process (no process group)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parallel_runtime.engines.attention import (
    block_backward,
    block_forward,
    causal_doc_mask,
    merge_block,
    varlen_attention,
)
from parallel_runtime.engines.context import shard_microbatch
from parallel_runtime.model import ModelConfig, Transformer, local_attention

LENGTHS = [7, 1, 12, 3, 5]


def packed(lengths, heads=4, kv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, heads, d, generator=g, dtype=dtype)
    k = torch.randn(t, kv, d, generator=g, dtype=dtype)
    v = torch.randn(t, kv, d, generator=g, dtype=dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("impl", ["masked", "loop", "sdpa"])
def test_varlen_attention_is_causal_per_doc(impl: str) -> None:
    q, k, v, cu = packed(LENGTHS)
    out = varlen_attention(q, k, v, cu, impl=impl)
    b = cu.tolist()
    for a, e in zip(b[:-1], b[1:]):  # each doc alone, by the textbook formula with repeated KV heads
        kk = k[a:e].repeat_interleave(2, dim=1)
        vv = v[a:e].repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:e], kk) / math.sqrt(8)
        s = s + torch.triu(torch.full((e - a, e - a), float("-inf"), dtype=s.dtype), 1)
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
        assert torch.allclose(out[a:e], want, atol=1e-12)


def test_block_forward_backward_match_autograd_including_empty_rows() -> None:
    q, k, v, cu = packed([6, 4, 5])
    t = q.shape[0]
    pos = torch.tensor([0, 1, 2, 3, -1, -1, 0, 1, 2, 3, 0, 1, 2, 3, 4])  # two padding tokens (-1)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([6, 4, 5]))
    mask = causal_doc_mask(doc, pos, doc, pos)
    assert not mask[4].any() and not mask[:, 5].any()
    out, lse = block_forward(q, k, v, mask, 1 / math.sqrt(8))
    assert torch.isfinite(out).all() and (out[4] == 0).all() and torch.isinf(lse[4]).all()
    # reference: rows with at least one key, softmax by autograd
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", qq, kk.repeat_interleave(2, 1)) / math.sqrt(8)
    s = s.masked_fill(~mask, float("-inf"))
    rows = mask.any(1)
    p = torch.softmax(s[:, rows], -1)
    ref = torch.einsum("hqk,khd->qhd", p, vv.repeat_interleave(2, 1))
    assert torch.allclose(out[rows], ref, atol=1e-12)
    g = torch.randn(t, 4, 8, dtype=q.dtype)
    g[~rows] = 0
    ref.backward(g[rows])
    dq, dk, dv = block_backward(g, q, k, v, (g * out).sum(-1), lse, mask, 1 / math.sqrt(8))
    for got, want in ((dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-12)


def test_merging_blocks_over_split_keys_equals_one_block() -> None:
    q, k, v, cu = packed([16])
    pos = torch.arange(16)
    doc = torch.zeros(16, dtype=torch.long)
    full, lse = block_forward(q, k, v, causal_doc_mask(doc, pos, doc, pos), 0.3)
    out = torch.zeros_like(q)
    acc = torch.full((16, 4), float("-inf"), dtype=q.dtype)
    for part in (torch.arange(0, 16, 3), torch.arange(1, 16, 3), torch.arange(2, 16, 3)):
        o_b, l_b = block_forward(q, k[part], v[part], causal_doc_mask(doc, pos, doc[part], pos[part]), 0.3)
        out, acc = merge_block(out, acc, o_b, l_b)
    assert torch.allclose(out, full, atol=1e-12) and torch.allclose(acc, lse, atol=1e-12)


def _batch(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=n) for n in lengths]
    mb = shard_microbatch(docs, 1, 0)
    return docs, {k: torch.from_numpy(v) for k, v in mb.items()}


def _loss(model, mb, valid):
    with torch.no_grad():
        return model(mb["input_ids"], mb["position_ids"], mb["labels"],
                     attn=local_attention(mb["cu_seqlens"], "masked"), num_valid_tokens=valid)


def test_packed_loss_is_the_sum_of_per_doc_losses() -> None:
    model = Transformer(ModelConfig(num_layers=2), seed=3)
    docs, mb = _batch(LENGTHS)
    valid = sum(n - 1 for n in LENGTHS)
    total = _loss(model, mb, valid)
    parts = 0.0
    for d in docs:
        one = {k: torch.from_numpy(v) for k, v in shard_microbatch([d], 1, 0).items()}
        parts += float(_loss(model, one, valid))
    assert abs(float(total) - parts) < 1e-5 * abs(parts)


def test_rope_depends_only_on_positions_inside_the_doc() -> None:
    model = Transformer(ModelConfig(num_layers=2, init_std=0.3), seed=1)  # large weights: RoPE matters
    _, mb = _batch([9, 6])
    valid = 13
    base = _loss(model, mb, valid)
    shifted = dict(mb, position_ids=mb["position_ids"] + 5)  # relative positions unchanged
    assert abs(float(_loss(model, shifted, valid)) - float(base)) < 1e-5
    scrambled = dict(mb, position_ids=torch.flip(mb["position_ids"], [0]))
    assert abs(float(_loss(model, scrambled, valid)) - float(base)) > 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stage_pieces_compose_to_the_full_model(tied: bool) -> None:
    cfg = ModelConfig(num_layers=4, tie_embeddings=tied)
    full = Transformer(cfg, seed=7)
    first = Transformer(cfg, layers=range(0, 2), last_stage=False, seed=7)
    last = Transformer(cfg, layers=range(2, 4), first_stage=False, seed=7)
    _, mb = _batch(LENGTHS, seed=2)
    valid = sum(n - 1 for n in LENGTHS)
    want = full(mb["input_ids"], mb["position_ids"], mb["labels"],
                attn=local_attention(mb["cu_seqlens"], "masked"), num_valid_tokens=valid)
    want.backward()
    attn = local_attention(mb["cu_seqlens"], "masked")
    h = first.run_layers(first.embed_tokens(mb["input_ids"]), mb["position_ids"], attn)
    h_in = h.detach().requires_grad_()
    got = last.head_loss(last.run_layers(h_in, mb["position_ids"], attn), mb["labels"], valid)
    got.backward()
    h.backward(h_in.grad)
    assert abs(float(got.detach()) - float(want.detach())) < 1e-6
    grads = {}
    for stage in (first, last):  # tied: both stages hold embed.weight; their gradients add up
        for n, p in stage.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad
    assert set(grads) == {n for n, _ in full.named_parameters()}
    for n, p in full.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-8), n


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_heads .* multiple of num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads \\(2\\) is not divisible by tp=4"):
        ModelConfig().check_parallel(tp=4)
    with pytest.raises(ValueError, match="Ulysses degree 4 must divide the KV heads per TP rank"):
        ModelConfig(num_heads=8, num_kv_heads=4).check_parallel(tp=2, ulysses=4)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig(hidden=12, num_heads=4, num_kv_heads=2)


def test_shard_microbatch_follows_the_loader_rules() -> None:
    toks = np.arange(100, 111)  # one doc of 11 tokens on 2 lanes: padded to 12, chunks of 3
    lanes = [shard_microbatch([toks, np.array([7])], 2, lane) for lane in range(2)]
    # lane 0: chunks 0 and 3 -> positions 0,1,2 and 9,10,(pad)
    assert lanes[0]["input_ids"][:6].tolist() == [100, 101, 102, 109, 110, 0]
    assert lanes[0]["labels"][:6].tolist() == [101, 102, 103, 110, -100, -100]
    assert lanes[1]["position_ids"][:6].tolist() == [3, 4, 5, 6, 7, 8]
    # the 1-token doc: padded to 4, each lane holds 2 positions (lane 0: 0 and pad, lane 1: pads)
    assert lanes[0]["input_ids"][6:].tolist() == [7, 0] and lanes[0]["labels"][6:].tolist() == [-100, -100]
    assert lanes[0]["cu_seqlens"].tolist() == [0, 6, 8]
