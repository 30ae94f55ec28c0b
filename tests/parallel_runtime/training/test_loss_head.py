"""The loss head in chunks of tokens (:func:`parallel_runtime.model.chunked_loss_sum`): the native decoder's
head (tp 1 and tp 2) and an HF model's give the same loss and gradients chunked as whole, every parameter's
gradient is accumulated once per backward (what the overlap's push counts on), and no tensor of the whole
``[T, vocab]`` logits is ever made, in fp32 or in bf16 (the largest tensor any op makes is watched)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

import parallel_runtime.model as M
from parallel_runtime.engines.context import shard_microbatch
from parallel_runtime.engines.tensor import TensorParallel, shard
from parallel_runtime.model import ModelConfig, Transformer, local_attention

LENGTHS = [9, 1, 14, 4, 6, 20, 6]  # 60 tokens in 7 docs
CFG = ModelConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=64)


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    return {k: torch.from_numpy(v) for k, v in shard_microbatch([rng.integers(0, vocab, n) for n in LENGTHS], 1,
                                                                0).items()}


def _run(model: torch.nn.Module, b: dict[str, torch.Tensor], chunk_tokens: int | None, vocab: int,
         monkeypatch: pytest.MonkeyPatch) -> dict:
    """Loss, gradients, accumulations per parameter and the largest tensor of one forward and backward."""
    if chunk_tokens is not None:
        monkeypatch.setattr(M, "LOSS_CHUNK_BYTES", 4 * vocab * chunk_tokens)
    counts = dict.fromkeys(range(len(list(model.parameters()))), 0)
    handles = [p.register_post_accumulate_grad_hook(lambda _, j=j: counts.__setitem__(j, counts[j] + 1))
               for j, p in enumerate(model.parameters())]
    nvt = int((b["labels"] != -100).sum())
    watch = LargestTensor()
    with watch:
        loss = model(b["input_ids"], b["position_ids"], b["labels"], attn=local_attention(b["cu_seqlens"], "loop"),
                     num_valid_tokens=nvt)
        loss.backward()
    for h in handles:
        h.remove()
    monkeypatch.undo()
    return {"loss": float(loss.detach()), "grads": [p.grad.clone() for p in model.parameters()],
            "counts": set(counts.values()), "largest": watch.bytes}


def _same(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert abs(a["loss"] - b["loss"]) <= rtol * abs(b["loss"])
    for x, y in zip(a["grads"], b["grads"], strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_the_native_head_in_chunks_equals_the_whole_head(tie: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    b = _batch(cfg.vocab_size)
    t, v = len(b["input_ids"]), cfg.vocab_size
    whole = _run(Transformer(cfg, seed=0), b, None, v, monkeypatch)
    chunked = _run(Transformer(cfg, seed=0), b, 7, v, monkeypatch)  # 9 chunks, the last of 4 tokens
    _same(chunked, whole)
    assert chunked["counts"] == whole["counts"] == {1}  # one accumulation per parameter and backward
    assert whole["largest"] >= 4 * t * v > chunked["largest"]  # no [T, V] fp32 tensor in chunks
    # bf16: neither the fp32 upcast nor the bf16 logits of all T tokens are made
    bf = _run(Transformer(cfg, seed=0, dtype=torch.bfloat16), b, 7, v, monkeypatch)
    assert bf["largest"] < 2 * t * v and bf["counts"] == {1}
    assert abs(bf["loss"] - whole["loss"]) < 0.05 * whole["loss"]


def test_a_chunk_larger_than_the_tokens_is_the_plain_head(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _batch(CFG.vocab_size)
    default = _run(Transformer(CFG, seed=0), b, None, CFG.vocab_size, monkeypatch)
    one_chunk = _run(Transformer(CFG, seed=0), b, len(b["input_ids"]), CFG.vocab_size, monkeypatch)
    assert one_chunk["loss"] == default["loss"]  # the same call: bit for bit
    assert all(torch.equal(x, y) for x, y in zip(one_chunk["grads"], default["grads"]))


def test_the_hf_head_in_chunks_equals_the_whole_head(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from parallel_runtime.hf.model import HFModel

    spec = {"model_type": "llama", "vocab_size": 160, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "initializer_range": 0.2}
    b = _batch(160)
    t = len(b["input_ids"])
    hf = HFModel(spec, seed=1)
    whole = _run(hf.build(torch.device("cpu"), torch.float32), b, None, 160, monkeypatch)
    chunked = _run(hf.build(torch.device("cpu"), torch.float32), b, 16, 160, monkeypatch)
    _same(chunked, whole)
    assert chunked["counts"] == whole["counts"] == {1}
    assert whole["largest"] >= 4 * t * 160 > chunked["largest"]


def _tp_rank(rank: int, world: int) -> dict:
    b = _batch(CFG.vocab_size)
    nvt = int((b["labels"] != -100).sum())
    tp = TensorParallel(size=world, index=rank, group=dist.group.WORLD)
    out = {}
    for name, model, chunk in (("full", Transformer(CFG, seed=0), None),
                               ("tp", Transformer(CFG, tp=tp, seed=0), 7)):
        if chunk is not None:
            M.LOSS_CHUNK_BYTES = 4 * (CFG.vocab_size // world) * chunk
        loss = model(b["input_ids"], b["position_ids"], b["labels"], attn=local_attention(b["cu_seqlens"], "loop"),
                     num_valid_tokens=nvt)
        loss.backward()
        out[name] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters()},
                     {n: getattr(p, "tp_dim", None) for n, p in model.named_parameters()})
    (lf, gf, _), (lt, gt, dims) = out["full"], out["tp"]
    err = max(float((gt[n] - shard(gf[n], dims[n], tp)).abs().max()) for n in gt)
    return {"loss": (lf, lt), "grad_err": err}


@pytest.mark.multirank
def test_the_chunked_head_on_two_tp_ranks_equals_one_whole_model() -> None:
    """The vocab-parallel cross entropy's collectives replay chunk by chunk in backward, in one order on both ranks."""
    for res in run_distributed(_tp_rank, 2):
        lf, lt = res["loss"]
        assert abs(lf - lt) <= 1e-5 * abs(lf)
        assert res["grad_err"] < 1e-6
