"""Which transformers attention implementations keep packed docs apart: a measured table.

A tiny random ``LlamaForCausalLM`` per implementation runs two docs packed into one row (position
ids restarting at the second doc) and the second doc alone; the table gives the largest logit
difference of the second doc (about 1e-7: the docs are kept apart; about 0.1 or more: its tokens
attended to the first doc) in three setups: no ``attention_mask`` with ``use_cache=False`` (what
``mb.to_hf()`` gives), the model's default ``use_cache`` (True: a KV cache is created), and an
all-ones ``attention_mask``. Runs on CPU (eager, sdpa, flex_attention); flash-attention needs CUDA
and the ``flash-attn`` package and is reported as skipped without them.

    python tools/check_packed_attention.py
"""

from __future__ import annotations

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

IMPLS = ("eager", "sdpa", "flex_attention", "flash_attention_2")
SETUPS = {"no mask, use_cache=False": {"use_cache": False}, "default use_cache (True)": {},
          "all-ones attention_mask": {"use_cache": False, "mask": True}}


def run(impl: str) -> dict[str, str]:
    dev = "cuda" if impl.startswith("flash") else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        return dict.fromkeys(SETUPS, "skipped (no CUDA)")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM(cfg).to(dev).eval()
    except (ImportError, ValueError) as e:
        return dict.fromkeys(SETUPS, f"skipped ({str(e).splitlines()[0][:60]})")
    a, b = torch.randint(1, 64, (1, 7), device=dev), torch.randint(1, 64, (1, 5), device=dev)
    ids = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(dev)
    out = {}
    with torch.no_grad():
        alone = model(input_ids=b, use_cache=False).logits[0]
        for name, kw in SETUPS.items():
            kw = dict(kw)
            if kw.pop("mask", False):
                kw["attention_mask"] = torch.ones_like(ids)
            got = model(input_ids=ids, position_ids=pos, **kw).logits[0, 7:]
            out[name] = f"{float((got - alone).abs().max()):.1e}"
    return out


def main() -> int:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
    print("| attn_implementation | " + " | ".join(SETUPS) + " |")
    print("|---|" + "---|" * len(SETUPS))
    for impl in IMPLS:
        row = run(impl)
        print(f"| {impl} | " + " | ".join(row[s] for s in SETUPS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
