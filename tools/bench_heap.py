"""Speed and peak memory of CPU training steps under glibc's default heap and a fixed mmap threshold.

One fresh process per (setting, repeat), settings alternated so that a loaded machine affects each
alike; each process builds the native model (default: the 27M-parameter shape of issue 12), keeps its
gradients in one flat buffer (as the runtime does) and runs forward/backward with recompute over
microbatches of packed docs. Prints per setting the median step time and peak resident-set growth,
and the ratio to the default.

    python tools/bench_heap.py [--repeats 5] [--settings 0,1024,256,1024t] [--steps 4]

A setting is a threshold in KiB (0: glibc's default); a trailing ``t`` also sets torch's
``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for its large CPU tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(threshold_kb: int, steps: int, tokens: int, doc: int) -> dict:
    import torch

    from parallel_runtime.model import ModelConfig, Transformer, local_attention
    from parallel_runtime.training.metrics import peak_rss_mb, set_heap_mmap_threshold

    set_heap_mmap_threshold(threshold_kb << 10)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=256, hidden=512, ffn_hidden=1536, num_layers=8, num_heads=8, num_kv_heads=8)
    model = Transformer(cfg, seed=0)
    model.recompute = True
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))  # [model params] the gradient buffer
    o = 0
    for p in params:
        p.grad = flat[o:o + p.numel()].view_as(p)
        o += p.numel()
    cu = torch.arange(0, tokens + 1, doc, dtype=torch.int32)  # equal docs of `doc` tokens
    pos = torch.arange(tokens) % doc
    attn = local_attention(cu, "loop")

    times = []
    start_mb = 0.0
    for s in range(steps + 1):
        ids = torch.randint(0, 256, (tokens,))
        t0 = time.perf_counter()
        for _ in range(4):  # microbatches accumulate into the gradient buffer
            model(ids, pos, ids, attn=attn, num_valid_tokens=4 * tokens).backward()
        times.append(time.perf_counter() - t0)
        if s == 0:  # after the first step: model, gradients and the allocator's first growth
            start_mb = peak_rss_mb()
    return {"step_s": statistics.median(times[1:]), "hwm_mb": peak_rss_mb(), "first_mb": start_mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settings", default="0,1024,256,1024t",
                    help="mmap thresholds in KiB (0: glibc default; a trailing t: with THP_MEM_ALLOC_ENABLE=1)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per microbatch")
    ap.add_argument("--doc", type=int, default=256, help="tokens per doc")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.steps, a.tokens, a.doc)))
        return
    settings = a.settings.split(",")
    got: dict[str, list[dict]] = {k: [] for k in settings}
    for r in range(a.repeats):
        for k in settings:
            env = dict(os.environ)
            env.pop("THP_MEM_ALLOC_ENABLE", None)
            if k.endswith("t"):
                env["THP_MEM_ALLOC_ENABLE"] = "1"
            out = subprocess.run([sys.executable, __file__, "--child", k.rstrip("t"), "--steps", str(a.steps),
                                  "--tokens", str(a.tokens), "--doc", str(a.doc)],
                                 check=True, capture_output=True, text=True, env=env).stdout
            got[k].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {r} threshold {k} KiB: {got[k][-1]}", file=sys.stderr)
    base = statistics.median(x["step_s"] for x in got[settings[0]])
    print(f"{'heap':>16} {'step s (median)':>16} {'vs first':>9} {'peak MB':>9} {'after step 1 MB':>16}")
    for k in settings:
        t = statistics.median(x["step_s"] for x in got[k])
        name = (k.rstrip("t") + " KiB" if k.rstrip("t") != "0" else "default") + (" +THP" if k.endswith("t") else "")
        print(f"{name:>16} {t:16.3f} {t / base:9.3f} "
              f"{statistics.median(x['hwm_mb'] for x in got[k]):9.1f} "
              f"{statistics.median(x['first_mb'] for x in got[k]):16.1f}")


if __name__ == "__main__":
    main()
