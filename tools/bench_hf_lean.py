"""CPU cost of the lean activations (``parallel_runtime/hf/lean.py``) on one microbatch of a transformers Llama.

The benchmark's 27.5M shape (hidden 512, MLP 1,536, 8 layers, byte vocabulary), one thread, one microbatch of
``--tokens`` tokens: forward and backward of the plain model, of the model with both lean changes, with
each alone, and with the norms checkpointed (lean's norms before ``RMSNormKeepInput``), alternated
``--repeats`` times (the order flipping each round); medians of CPU time, as ratios to the plain model's.

    python tools/bench_hf_lean.py --repeats 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import types

import torch

from parallel_runtime.hf import lean


def variant(base: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A copy of ``base`` with ``kind`` of the lean changes: plain, lean (both), mlp, norm (the norm function) or
    ckpt (the norms checkpointed instead, as lean did before the function)."""
    m = copy.deepcopy(base)
    for mod in m.modules():
        if kind in ("lean", "mlp") and type(mod).__name__ in lean.SWIGLU_MLPS:
            mod.forward = types.MethodType(lean._swiglu_forward(mod.forward, lambda: True), mod)
            down = mod.down_proj
            down.forward = types.MethodType(lean._down_forward(down.forward), down)
        elif kind in ("lean", "norm") and type(mod).__name__ in lean.EXACT_NORMS:
            mod.forward = types.MethodType(lean._norm_forward(mod.forward, lambda: True), mod)
        elif kind == "ckpt" and "RMSNorm" in type(mod).__name__:
            mod.forward = lean._checkpointed(mod.forward, lambda: True)
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=8)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM  # the hf extra

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=256, max_position_embeddings=max(4096, a.tokens))
    base = LlamaForCausalLM(cfg).train()
    models = {k: variant(base, k) for k in ("plain", "lean", "mlp", "norm", "ckpt")}
    ids = torch.randint(0, 256, (1, a.tokens))  # [1, T]
    pos = torch.arange(a.tokens)[None]  # [1, T]

    def run(m: torch.nn.Module) -> float:
        t = time.process_time()
        m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        return time.process_time() - t

    cpu: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        run(m)  # warm
    for r in range(a.repeats):
        for k in list(models) if r % 2 else list(models)[::-1]:
            cpu[k].append(run(models[k]))
    plain = statistics.median(cpu["plain"])
    for k, v in cpu.items():
        print(f"{k:6s} {statistics.median(v) * 1e3:8.1f} ms CPU  {statistics.median(v) / plain:.4f}x the plain model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
