"""Context-parallel engines: pure layout checks, then multi-rank gloo worlds against one process.

Tier 1 checks the index maths against ``balanced_loader/materialize.py``. Tier 3 runs, in one
4-rank world, the attention engines alone in float64 (outputs and q/k/v gradients equal the
unsharded attention to 1e-10, bytes sent equal the formulas of papers/hydra_dcp.md) and the
whole model under several TP x CP layouts (``selfcheck.run_rank``); an 8-rank world runs the
nested 2 x 2 engine with tp 2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from balanced_loader.data.sources import Source
from balanced_loader.materialize import cp_positions, materialize_group
from balanced_loader.plan import Group
from parallel_runtime.diagnostics.selfcheck import LayoutSpec, run_rank
from parallel_runtime.engines import attention as attention_module
from parallel_runtime.engines import ring as ring_module
from parallel_runtime.engines.attention import varlen_attention
from parallel_runtime.engines.context import PackedLayout, UlyssesAttention, make_engine, shard_microbatch
from parallel_runtime.groups import GroupCache
from parallel_runtime.topology import Topology

LENGTHS = (1, 9, 16, 2, 23, 5)  # 1-token docs and lengths not divisible by 2 * degree


# ---- tier 1: the layout ---------------------------------------------------------------


@pytest.mark.parametrize(("degree", "inner"), [(2, 1), (3, 1), (4, 1), (2, 2), (4, 4), (4, 2), (6, 2),
                                               (6, 3), (8, 2), (8, 4), (12, 3)])
def test_inner_gather_turns_the_lane_layout_into_the_ring_layout(degree: int, inner: int) -> None:
    lay = PackedLayout(lengths=LENGTHS, degree=degree, inner=inner)
    gather = lay.gather_index()
    assert sorted(gather.tolist()) == list(range(inner * lay.lane_tokens))
    for j in range(lay.outer):
        lanes = [lay.lane_positions(j * inner + i) for i in range(inner)]
        pos = np.concatenate([p for p, _ in lanes])[gather]
        seg = np.concatenate([s for _, s in lanes])[gather]
        want_pos, want_seg = lay.ring_positions(j)
        assert np.array_equal(pos, want_pos) and np.array_equal(seg, want_seg)
    # every real token of every segment is held exactly once over the group
    allpos = [lay.lane_positions(lane) for lane in range(degree)]
    for s, n in enumerate(LENGTHS):
        held = np.sort(np.concatenate([p[sg == s] for p, sg in allpos]))
        assert np.array_equal(held[held >= 0], np.arange(n))


def test_lane_positions_are_the_layout_module_positions() -> None:
    lay = PackedLayout(lengths=(13,), degree=4, inner=2)
    for lane in range(4):
        assert np.array_equal(lay.lane_positions(lane)[0], cp_positions(13, 4, 2)[lane])


def test_ulysses_degree_that_does_not_divide_kv_heads_is_a_clear_error() -> None:
    eng = UlyssesAttention(None, (0, 1, 2, 3), 0)
    attn = eng.bind([16])  # 16 tokens on 4 lanes: 4 per lane
    q = torch.zeros(4, 4, 8)
    kv = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="Ulysses degree 4 must divide the KV heads per TP rank \\(2\\)"):
        attn(q, kv, kv)
    with pytest.raises(ValueError, match="holds 5 tokens but segments"):
        attn(torch.zeros(5, 4, 8), torch.zeros(5, 4, 8), torch.zeros(5, 4, 8))


# ---- tier 3: multi-rank ---------------------------------------------------------------


def _engine_case(world: int, kind: str, inner: int, heads: int, kv_heads: int, overlap: bool, rank: int,
                 groups: GroupCache, lengths: tuple[int, ...] = LENGTHS) -> dict:
    """Attention alone, float64: this rank's lane vs the unsharded reference (values and grads)."""
    d = 8
    ranks = tuple(range(world))
    eng = make_engine(kind, groups, ranks, rank, inner=inner, overlap=overlap)
    lay = PackedLayout(lengths=lengths, degree=world, inner=eng.inner)
    g = torch.Generator().manual_seed(11)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, h, d, generator=g, dtype=torch.float64)
                     for h in (heads, kv_heads, kv_heads, heads))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    q_ref, k_ref, v_ref = (x.clone().requires_grad_() for x in (q, k, v))
    out_ref = varlen_attention(q_ref, k_ref, v_ref, cu, impl="masked")
    out_ref.backward(dout)
    pos, seg = lay.lane_positions(eng.lane_index)
    idx = torch.from_numpy(np.where(pos >= 0, cu[:-1].numpy()[seg] + pos, 0))
    real = torch.from_numpy(pos >= 0)

    def lane(x: torch.Tensor) -> torch.Tensor:  # padding rows get large junk that must not leak
        junk = torch.full_like(x[idx], 1e3)
        return torch.where(real[:, None, None], x[idx], junk).clone().requires_grad_()

    ql, kl, vl = lane(q), lane(k), lane(v)
    eng.stats.reset()
    attn = eng.bind(lengths)
    out = attn(ql, kl, vl)
    fwd_bytes = dict(eng.stats.bytes)
    out.backward(torch.where(real[:, None, None], dout[idx], torch.zeros_like(dout[idx])))
    bwd_bytes = {k2: v2 - fwd_bytes.get(k2, 0) for k2, v2 in eng.stats.bytes.items()}
    err = 0.0
    for got, want in ((out, out_ref), (ql.grad, q_ref.grad), (kl.grad, k_ref.grad), (vl.grad, v_ref.grad)):
        err = max(err, float((got[real] - want[idx[real]]).abs().max()))
        err = max(err, float(got[~real].abs().max()) if (~real).any() and got is not out else 0.0)
    # formulas of papers/hydra_dcp.md (per rank, per layer, forward), s = padded tokens of the group
    s = int(lay.padded.sum())
    b = 8
    c, u, r = world, eng.inner, eng.outer
    dq_, dkv_ = heads * d, kv_heads * d
    want_fwd = {}
    if u > 1:
        want_fwd["a2a_fwd"] = s // c * 2 * (dq_ + dkv_) * b * (u - 1) // u
    if r > 1:
        want_fwd["ring_kv"] = 2 * s * (dkv_ // u) * b * (r - 1) // r
    return {"err": err, "fwd_bytes": fwd_bytes, "want_fwd": want_fwd, "bwd_bytes": bwd_bytes}


def _world4(rank: int, world: int) -> dict:
    out: dict = {}
    topo = Topology.uniform(world)
    groups = GroupCache.build([topo], inner_sizes=[2])
    real_new_group = dist.new_group
    tile_size, fused_min_rows = attention_module.TILE_SIZE, ring_module.FUSED_MIN_ROWS

    def forbidden(*a, **kw):
        raise AssertionError("new_group called after GroupCache.build (hot path)")

    dist.new_group = forbidden
    try:
        for kind, inner, overlap in (("ring", 1, True), ("ring", 1, False), ("ulysses", 4, True),
                                     ("nested", 2, True)):
            out[f"{kind}-{inner}-{overlap}"] = _engine_case(world, kind, inner, 8, 4, overlap, rank, groups)
        attention_module.TILE_SIZE = 5  # ring blocks cut into many tiles, across segment bounds
        for kind, inner in (("ring", 1), ("nested", 2)):
            out[f"{kind}-{inner}-tiled"] = _engine_case(world, kind, inner, 8, 4, True, rank, groups)
        ring_module.FUSED_MIN_ROWS = 0  # every block through the fused CPU kernels, piece by piece
        for kind, inner in (("ring", 1), ("nested", 2)):
            out[f"{kind}-{inner}-fused"] = _engine_case(world, kind, inner, 8, 4, True, rank, groups)
    finally:
        dist.new_group = real_new_group
        attention_module.TILE_SIZE = tile_size
        ring_module.FUSED_MIN_ROWS = fused_min_rows
    # whole model, several layouts, in this one world
    specs = [LayoutSpec(world_size=4, tp=2, cp=2, engine="ring"),
             LayoutSpec(world_size=4, tp=1, cp=4, engine="ring", overlap=False, seed=1),
             LayoutSpec(world_size=4, tp=1, cp=4, engine="ulysses", seed=2),
             LayoutSpec(world_size=4, tp=1, cp=4, engine="nested", ulysses=2, seed=3),
             LayoutSpec(world_size=4, tp=1, cp=2, engine="ulysses", seed=4),  # two DP groups of 2 lanes
             LayoutSpec(world_size=4, tp=2, cp=2, engine="ulysses", seed=5)]
    out["model"] = [run_rank(rank, world, spec) for spec in specs]
    return out


@pytest.mark.multirank
def test_engines_and_model_layouts_on_four_ranks() -> None:
    results = run_distributed(_world4, 4, timeout=240)
    for rank, res in enumerate(results):
        for name, case in res.items():
            if name == "model":
                continue
            assert case["err"] < 1e-10, (rank, name, case["err"])
            assert case["fwd_bytes"] == case["want_fwd"], (rank, name)
            if "ring_kv" in case["want_fwd"]:  # backward: K/V and dK/dV, r-1 hops each (2x forward)
                assert case["bwd_bytes"]["ring_kv"] == case["want_fwd"]["ring_kv"]
                assert case["bwd_bytes"]["ring_dkv"] == case["want_fwd"]["ring_kv"]
            if "a2a_fwd" in case["want_fwd"]:
                assert case["bwd_bytes"]["a2a_bwd"] == case["want_fwd"]["a2a_fwd"]
    for check in results[0]["model"]:
        assert check["ok"], check
        assert check["max_rel_diff_grad"] <= 1e-5 and check["max_rel_diff_loss"] <= 1e-5


LONG = (1500, 3, 545)  # the 1500-token doc spans several 128-row tiles on every lane


def _world4_long(rank: int, world: int) -> dict:
    topo = Topology.uniform(world)
    groups = GroupCache.build([topo], inner_sizes=[2])
    tile_size, fused_min_rows = attention_module.TILE_SIZE, ring_module.FUSED_MIN_ROWS
    attention_module.TILE_SIZE = 128
    try:
        out = {f"{kind}-{inner}": _engine_case(world, kind, inner, 4, 2, True, rank, groups, LONG)
               for kind, inner in (("ring", 1), ("nested", 2))}  # long pieces: the fused CPU kernels
        ring_module.FUSED_MIN_ROWS = 10**9  # the tiled kernels, several tiles per block
        out.update({f"{kind}-{inner}-tiled": _engine_case(world, kind, inner, 4, 2, True, rank, groups, LONG)
                    for kind, inner in (("ring", 1), ("nested", 2))})
        # the whole model: one 1200-token doc per CP group of 2 (two groups), peak memory reported
        out["model"] = run_rank(rank, world, LayoutSpec(world_size=4, cp=2, engine="ring", doc_tokens=1200,
                                                        docs_per_group=1, microbatches=1, seed=12))
    finally:
        attention_module.TILE_SIZE = tile_size
        ring_module.FUSED_MIN_ROWS = fused_min_rows
    return out


@pytest.mark.multirank
def test_ring_and_nested_on_a_doc_spanning_many_tiles() -> None:
    results = run_distributed(_world4_long, 4, timeout=240)
    for rank, res in enumerate(results):
        for name in ("ring-1", "nested-2", "ring-1-tiled", "nested-2-tiled"):
            assert res[name]["err"] < 1e-10, (rank, name, res[name]["err"])
    check = results[0]["model"]
    assert check["ok"], check
    assert check["batch"]["lengths"] == [1200, 1200] and check["peak_rss_mb"] > 0


def _world8(rank: int, world: int) -> list:
    specs = [LayoutSpec(world_size=8, tp=2, cp=4, engine="nested", ulysses=2, seed=6),
             LayoutSpec(world_size=8, tp=2, cp=2, engine="ring", seed=7)]
    return [run_rank(rank, world, spec) for spec in specs]


@pytest.mark.multirank
def test_nested_two_by_two_with_tp2_on_eight_ranks() -> None:
    for check in run_distributed(_world8, 8, timeout=240)[0]:
        assert check["ok"], check
        assert check["layout"]["ulysses"] * check["layout"]["ring"] == check["layout"]["cp"]


def _world6(rank: int, world: int) -> list:
    specs = [LayoutSpec(world_size=6, tp=2, cp=3, engine="ring", seed=8),
             LayoutSpec(world_size=6, tp=1, cp=6, engine="nested", ulysses=3, seed=9),
             LayoutSpec(world_size=6, tp=1, cp=6, engine="nested", ulysses=2, seed=10),
             LayoutSpec(world_size=6, tp=1, cp=3, engine="ulysses", seed=11, kv_heads=3, heads=6)]
    return [run_rank(rank, world, spec) for spec in specs]


@pytest.mark.multirank
def test_cp_degrees_that_are_not_powers_of_two_on_six_ranks() -> None:
    for check in run_distributed(_world6, 6, timeout=300)[0]:
        assert check["ok"], check


def test_engine_kind_and_inner_size_errors() -> None:
    with pytest.raises(ValueError, match="unknown CP engine 'zigzag'"):
        make_engine("zigzag", None, (0, 1), 0)
    with pytest.raises(ValueError, match="inner .* size 3 must divide the degree 4"):
        make_engine("nested", None, (0, 1, 2, 3), 0, inner=3)
    with pytest.raises(ValueError, match="rank 5 is not in CP group"):
        make_engine("ring", None, (0, 1), 5)


def test_ring_bytes_formula_is_independent_of_degree() -> None:
    # sanity of the formula used above: 2 s D_kv b (P-1)/P grows only from 1x (P=2) to 2x (P large)
    s, dkv, b = 4096, 256, 2
    vals = [2 * s * dkv * b * (p - 1) / p for p in (2, 4, 8, 64)]
    assert vals == sorted(vals) and vals[-1] < 2 * vals[0] + 1 and math.isclose(vals[0], s * dkv * b)


class _ArraySource(Source):
    """Docs held in memory (for the cross-check with the loader's materialization)."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs = docs
        self.lengths = np.array([len(d) for d in docs], dtype=np.int64)

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        return self.docs[doc_id][start:start + length]


@pytest.mark.parametrize(("lanes", "inner"), [((0,), 1), ((1, 0), 1), ((0, 1, 2), 1), ((3, 1, 0, 2), 2),
                                              ((0, 1, 2, 3), 4), ((5, 4, 3, 2, 1, 0), 3), ((0, 1, 2, 3, 4, 5), 2)])
def test_engines_read_the_layout_the_loader_materializes(lanes: tuple[int, ...], inner: int) -> None:
    rng = np.random.default_rng(len(lanes) * 10 + inner)
    docs = [rng.integers(0, 256, size=n) for n in (40, 1, 13, 7, 64)]
    source = _ArraySource(docs)
    segments = ((0, 5, 30), (1, 0, 1), (2, 0, 13), (3, 2, 5), (4, 0, 64))  # some start inside a doc
    group = Group(lanes=lanes, segments=segments)
    for lane in lanes:
        ids, labels, pos, cu, _ = materialize_group(group, lane, source, cp_inner=inner)
        mine = shard_microbatch([docs[d][s:s + n] for d, s, n in segments], len(lanes), lanes.index(lane),
                                inner=inner)
        assert np.array_equal(ids, mine["input_ids"]) and np.array_equal(labels, mine["labels"])
        assert np.array_equal(pos, mine["position_ids"]) and np.array_equal(cu, mine["cu_seqlens"])
