"""The GPU code paths' fixes, checked on CPU: no dense attention mask on a GPU, microbatch gradients summed in
fp32, the calibration timer refused when it is not device time, exchange buckets sized by bytes per peer,
the pipeline's transfers paired in one batch per peer, and the clock's events read once after the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel_runtime.engines import device as D
from parallel_runtime.engines.attention import resolve_impl
from parallel_runtime.engines.pipeline import Clock
from parallel_runtime.model import ModelConfig, Transformer, local_attention
from parallel_runtime.training.closed_loop import check_timer
from parallel_runtime.training.params import local_params, param_specs
from parallel_runtime.training.runtime import GradBuffer, accumulate_in_fp32
from parallel_runtime.training.transport import PEER_BYTES, PEER_BYTES_GPU, bucket_limit

HETERO = str(Path(__file__).resolve().parents[3] / "recipes" / "cpu-hetero.yaml")


class _Emulated:
    def __init__(self) -> None:
        self.syncs = 0

    def event(self):
        class E:
            def record(self) -> None:
                pass

            def elapsed_time(self, other) -> float:
                return 1.5

        return E()

    def synchronize(self) -> None:
        self.syncs += 1


@pytest.fixture
def gpu():
    saved, D.EMULATION = D.EMULATION, _Emulated()
    try:
        yield D.EMULATION
    finally:
        D.EMULATION = saved


def test_auto_attention_never_builds_a_dense_mask_on_a_gpu(gpu) -> None:
    from parallel_runtime.engines.flash import flash_available

    q = torch.empty(8, 2, 4, dtype=torch.bfloat16)
    assert resolve_impl("auto", q) == ("flash" if flash_available() else "loop")
    assert resolve_impl("auto", q.float()) == "loop"  # fp32 on a GPU: per-doc SDPA, not [T, T]


def test_recipes_refuse_dense_masks_on_cuda() -> None:
    from parallel_runtime.config import load_recipe

    for impl in ("masked", "sdpa"):
        with pytest.raises(ValueError, match=f"train.attention {impl} builds a dense"):
            load_recipe(HETERO, ["world.device=cuda", f"train.attention={impl}"])
    assert load_recipe(HETERO, ["world.device=cuda", "train.attention=auto"]).train.attention == "auto"


def test_clock_reads_its_events_once_after_the_step(gpu) -> None:
    clock = Clock(torch.device("cpu"), spans=True)
    for k in range(3):
        with clock.on(k, "F"):
            pass
    assert gpu.syncs == 0 and clock.cost_ms == {}  # nothing waited for or read inside the step
    clock.finish()
    assert gpu.syncs == 1 and clock.cost_ms == {0: 1.5, 1: 1.5, 2: 1.5} and len(clock.spans) == 3
    assert clock.timer == "cuda-events"


def test_calibration_refuses_cpu_timers_on_a_gpu() -> None:
    check_timer("cuda-events", gpu=True)
    check_timer("thread-cpu", gpu=False)
    with pytest.raises(RuntimeError, match="calibration on a GPU needs device time"):
        check_timer("thread-cpu", gpu=True)


def test_half_precision_gradients_sum_in_fp32() -> None:
    """Four bf16 microbatches: the fp32 main gradient is the fp32 sum of each microbatch's bf16 gradient, closer
    to the fp32 model's than bf16 accumulation in ``.grad`` is."""
    cfg = ModelConfig(vocab_size=64, hidden=32, ffn_hidden=64, num_layers=2, num_heads=2, num_kv_heads=2)
    specs = {s.name: s for s in param_specs(cfg)}
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (48,), generator=gen) for _ in range(4)]
    pos = torch.arange(48) % 24
    attn = local_attention(torch.tensor([0, 24, 48], dtype=torch.int32), "loop")

    def run(model: Transformer) -> None:
        for ids in batches:
            model(ids, pos, ids, attn=attn, num_valid_tokens=4 * 48).backward()

    ref = Transformer(cfg, seed=0)
    run(ref)
    plain = Transformer(cfg, seed=0, dtype=torch.bfloat16)
    run(plain)  # bf16 .grad: every accumulation rounds
    model = Transformer(cfg, seed=0, dtype=torch.bfloat16)
    params = local_params(model, specs)
    accumulate_in_fp32(params)
    buf = GradBuffer(torch.device("cpu"))
    buf.attach(params)
    run(model)
    err16 = err32 = 0.0
    for (name, p), q, r in zip(model.named_parameters(), plain.parameters(), ref.parameters()):
        assert p.grad is None and p.main_grad.dtype == torch.float32, name
        scale = float(r.grad.abs().max())
        err32 = max(err32, float((p.main_grad - r.grad).abs().max()) / scale)
        err16 = max(err16, float((q.grad.float() - r.grad).abs().max()) / scale)
    assert err32 < err16, (err32, err16)
    GradBuffer.detach(params)
    assert all(lp.tensor.main_grad is None for lp in params)


def test_exchange_buckets_carry_bytes_per_peer() -> None:
    assert bucket_limit(1 << 19, 4) == 1 << 19 and bucket_limit(1 << 19, 8) == 1 << 19  # CPU worlds: as before
    assert bucket_limit(1 << 19, 64) == 64 * PEER_BYTES // 4  # 256 KiB per peer at 64 ranks (was 32 KiB)
    assert bucket_limit(1 << 19, 64, gpu=True) == 64 * PEER_BYTES_GPU // 4 == 16 << 20  # 1 MiB per peer


def test_bf16_ring_with_fused_cpu_blocks_matches_the_reference() -> None:
    """One long doc per group takes torch's fused CPU kernels in every ring block; in bf16 their backward wants
    the log-sum-exp in fp32 (it failed before: 'expected scalar type Float but found BFloat16')."""
    from parallel_runtime.diagnostics.selfcheck import LayoutSpec, check

    res = check(LayoutSpec(world_size=2, cp=2, engine="ring", dtype="bfloat16", doc_tokens=512, heads=4, kv_heads=2,
                           docs_per_group=3, microbatches=1), timeout_s=300)
    assert res["ok"], (res["max_rel_diff_grad"], res["half"])
