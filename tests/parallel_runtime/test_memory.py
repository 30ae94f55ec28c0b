"""Memory: recompute leaves gradients unchanged, and the memory formulas of
:mod:`balanced_loader.presets` (lane caps of the analytic presets) match what the runtime holds:
saved activations measured with saved-tensor hooks, parameter and optimizer tensors by size."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from balanced_loader.presets import OPTIMIZER_BYTES_PER_PARAM, ModelShape, activation_bytes_per_token, state_bytes
from parallel_runtime.model import ModelConfig, Transformer, local_attention
from parallel_runtime.training.heap import heap_in_use, release_free_memory
from parallel_runtime.training.metrics import SavedActivations, tensor_bytes
from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, ShardedOptimizer
from parallel_runtime.training.params import init_params, param_specs
from parallel_runtime.training.peaks import PeakProbe, resident_bytes

SIZES = [ModelConfig(hidden=64, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden=128),
         ModelConfig(hidden=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden=384),
         ModelConfig(hidden=256, num_layers=2, num_heads=8, num_kv_heads=8, ffn_hidden=768)]


def shape_of(cfg: ModelConfig) -> ModelShape:
    return ModelShape(hidden=cfg.hidden, layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                      ffn=cfg.ffn_hidden, vocab=cfg.vocab_size, tied=cfg.tie_embeddings)


def fwd_bwd(cfg: ModelConfig, *, dtype=torch.float32, recompute=False, tokens=384, docs=3):
    """A whole-model forward and backward on ``docs`` equal docs; returns the model and the saved-activation peak."""
    model = Transformer(cfg, dtype=dtype, seed=0)
    model.recompute = recompute
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    n = tokens // docs
    pos = torch.arange(tokens) % n
    cu = torch.arange(0, tokens + 1, n, dtype=torch.int32)
    saved = SavedActivations(exclude=list(model.parameters()))
    with saved.hooks():
        loss = model(ids, pos, labels, attn=local_attention(cu, "loop"), num_valid_tokens=tokens)
    loss.backward()
    assert saved.current == 0  # every saved tensor is released after backward
    return model, saved.peak


def test_recompute_gives_the_same_gradients() -> None:
    cfg = SIZES[1]
    plain, _ = fwd_bwd(cfg)
    again, _ = fwd_bwd(cfg, recompute=True)
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("cfg", SIZES, ids=lambda c: f"h{c.hidden}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recompute", [False, True])
def test_activation_formula_matches_saved_tensors(cfg, dtype, recompute) -> None:
    tokens = 384
    _, peak = fwd_bwd(cfg, dtype=dtype, recompute=recompute, tokens=tokens)
    predicted = activation_bytes_per_token(shape_of(cfg), itemsize=torch.empty(0, dtype=dtype).element_size(),
                                           recompute=recompute) * tokens
    assert abs(peak - predicted) <= 0.2 * predicted, (peak, predicted)


def test_recompute_keeps_less() -> None:
    cfg = SIZES[2]
    assert fwd_bwd(cfg, recompute=True)[1] * 3 < fwd_bwd(cfg)[1]


@pytest.mark.parametrize("cfg", SIZES, ids=lambda c: f"h{c.hidden}")
def test_state_formulas_match_the_runtime_tensors(cfg) -> None:
    world = 4
    shape = shape_of(cfg)
    model = Transformer(cfg, dtype=torch.bfloat16, seed=0)
    st = state_bytes(shape, world_size=world, itemsize=2)
    assert tensor_bytes(model.parameters()) == st["params"] == 2 * shape.params
    opt = ShardedOptimizer(FlatLayout(param_specs(cfg), world), init_params(cfg, 0), AdamWConfig(), rank=1)
    held = opt.state_bytes + opt.grad.numel() * 4  # the gradient shard in a buffer of its own (made on first use)
    assert abs(held - st["optimizer"]) <= 0.01 * st["optimizer"] + OPTIMIZER_BYTES_PER_PARAM * world


def table(tokens: int = 384) -> str:
    """Measured saved activations vs the formula per size, dtype and recompute (docs/results/runtime.md)."""
    rows = ["| hidden | layers | heads/kv | ffn | dtype | recompute | measured B/token | formula B/token | ratio |",
            "|---|---|---|---|---|---|---|---|---|"]
    for cfg in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            for rc in (False, True):
                peak = fwd_bwd(cfg, dtype=dtype, recompute=rc, tokens=tokens)[1] / tokens
                f = activation_bytes_per_token(shape_of(cfg), itemsize=torch.empty(0, dtype=dtype).element_size(),
                                               recompute=rc)
                rows.append(f"| {cfg.hidden} | {cfg.num_layers} | {cfg.num_heads}/{cfg.num_kv_heads} | "
                            f"{cfg.ffn_hidden} | {str(dtype)[6:]} | {rc} | {peak:.0f} | {f:.0f} | {peak / f:.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())


def test_recompute_is_a_strict_recipe_key() -> None:
    from parallel_runtime.config import load_recipe

    hetero = str(Path(__file__).resolve().parents[2] / "recipes" / "cpu-hetero.yaml")
    assert load_recipe(hetero).train.recompute is False
    assert load_recipe(hetero, ["train.recompute=true"]).train.recompute is True
    with pytest.raises(ValueError, match="train.recompute: expected true or false"):
        load_recipe(hetero, ["train.recompute=maybe"])


def test_gradients_accumulate_in_one_flat_buffer() -> None:
    """The runtime's gradient buffer: views as .grad, zeroed on attach, equal to autograd's own gradients."""
    from parallel_runtime.training.params import local_params
    from parallel_runtime.training.runtime import GradBuffer

    cfg = ModelConfig(vocab_size=64, hidden=32, ffn_hidden=64, num_layers=2, num_heads=2, num_kv_heads=2)
    model = Transformer(cfg, seed=0)
    params = local_params(model, {s.name: s for s in param_specs(cfg)})
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24) % 12
    attn = local_attention(torch.tensor([0, 12, 24], dtype=torch.int32))

    def two_microbatches() -> None:
        for _ in range(2):
            model(ids, pos, ids, attn=attn, num_valid_tokens=48).backward()

    two_microbatches()
    want = [lp.tensor.grad.clone() for lp in params]
    buf = GradBuffer(torch.device("cpu"))
    for _ in range(2):  # the second attach must zero what the first step left
        buf.attach(params)
        two_microbatches()
    flat = buf._flat
    assert flat.numel() == sum(lp.tensor.numel() for lp in params)
    for lp, w in zip(params, want, strict=True):
        assert lp.tensor.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        torch.testing.assert_close(lp.tensor.grad, w, rtol=0, atol=1e-6)
    GradBuffer.detach(params)
    assert all(lp.tensor.grad is None for lp in params)


def test_heap_threshold_is_a_checked_recipe_key() -> None:
    import ctypes.util

    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.heap import set_heap_mmap_threshold

    hetero = str(Path(__file__).resolve().parents[2] / "recipes" / "cpu-hetero.yaml")
    assert load_recipe(hetero).world.heap_mmap_kb == 0  # glibc's own: activations reused from the heap
    with pytest.raises(ValueError, match="world.heap_mmap_kb must be in 0"):
        load_recipe(hetero, ["world.heap_mmap_kb=-1"])
    assert set_heap_mmap_threshold(0) is False  # 0 keeps the C library's default
    if ctypes.util.find_library("c") and "libc.so.6" in (ctypes.util.find_library("c") or ""):
        assert set_heap_mmap_threshold(1 << 20) is True  # glibc accepts it


def _holes_then_growth(trim_mb: int, *, refill: bool, earlier_mb: int = 0, margin_mb: int = 0) -> tuple[int, int]:
    """A heap of 64 KB chunks with every other one freed and trimmed (holes between live chunks, not
    resident); with ``refill`` a step touches every hole and frees it again (glibc's pattern under
    activations: free pages left resident between live tensors); then 96 MiB of live tensor, which
    wakes the sampler's check. With ``earlier_mb``, a step before it held that many MiB more (the
    process's high mark) and ``margin_mb`` lets trims run that far below it. Returns the resident
    growth over the step and the probe's trims."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def touched(n: int) -> list[int]:
        out = [libc.malloc(64 << 10) for _ in range(n)]
        for q in out:
            libc.memset(q, 1, 64 << 10)
        return out

    chunks = touched(2000)
    for q in chunks[1::2]:
        libc.free(q)
    release_free_memory()
    probe = PeakProbe(torch.device("cpu"), interval_s=0.002, trim_bytes=trim_mb << 20, margin_bytes=margin_mb << 20)
    big = None
    try:
        if earlier_mb:
            probe.reset()
            big = torch.ones(earlier_mb << 18)
            time.sleep(0.2)
            big = None
            probe.peak()
        probe.reset()
        if refill:
            for q in touched(1000):  # lands in the holes (best fit before the heap's top)
                libc.free(q)
        big = torch.ones(96 << 18)  # its own mapping: live growth
        time.sleep(0.2)  # the sampler's turn
        growth = resident_bytes() - probe.base
        probe.peak()
        return growth, probe.trims
    finally:
        probe.close()
        del big
        for q in chunks[0::2]:
            libc.free(q)
        release_free_memory()


@pytest.mark.skipif(heap_in_use() is None, reason="glibc >= 2.33 (mallinfo2) and /proc")
def test_the_peak_sampler_trims_free_heap_pages_not_live_growth() -> None:
    live = 96 << 20
    grown, trims = _holes_then_growth(0, refill=True)
    assert trims == 0 and grown > live + (48 << 20)  # ~64 MB of free pages left resident
    grown, trims = _holes_then_growth(16, refill=True)
    assert trims >= 1 and grown < live + (24 << 20)  # handed back once the resident set grew
    grown, trims = _holes_then_growth(16, refill=False)
    assert trims == 0  # growth that is all live tensors triggers nothing
    grown, trims = _holes_then_growth(16, refill=True, earlier_mb=400)
    assert trims == 0 and grown > live + (48 << 20)  # far below an earlier step's mark: no new peak to lower
    grown, trims = _holes_then_growth(16, refill=True, earlier_mb=400, margin_mb=512)
    assert trims >= 1 and grown < live + (24 << 20)  # within the margin: trimmed as without the mark
    with pytest.raises(ValueError, match="trim_bytes and margin_bytes must be >= 0"):
        PeakProbe(torch.device("cpu"), trim_bytes=-1)


def test_heap_trim_is_a_checked_recipe_key() -> None:
    from parallel_runtime.config import load_recipe

    hetero = str(Path(__file__).resolve().parents[2] / "recipes" / "cpu-hetero.yaml")
    assert load_recipe(hetero).world.heap_trim_mb == 64
    assert load_recipe(hetero, ["world.heap_trim_mb=0"]).world.heap_trim_mb == 0
    with pytest.raises(ValueError, match="world.heap_trim_mb must be in 0"):
        load_recipe(hetero, ["world.heap_trim_mb=-1"])
