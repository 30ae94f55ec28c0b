"""Speed and peak memory of CPU training steps under glibc's default heap and a fixed mmap threshold.

One fresh process per (setting, repeat), settings alternated so that a loaded machine affects each
alike; each process builds the native model (default: the 27M-parameter shape of issue 12), keeps its
gradients in one flat buffer (as the runtime does) and runs forward/backward over microbatches of
packed docs (with recompute unless ``--recompute 0``; microbatch sizes drawn in
``[--min-tokens, --tokens]`` when those differ). Prints per setting the median step time (wall and
thread CPU time, which other jobs on the machine inflate less), the minor page faults per step (the
cost of fresh pages: a load-independent count), the peak resident set and the ratio to the first
setting.

    python tools/bench_heap.py [--repeats 5] [--settings 0,1024,256,1024t] [--steps 4] [--recompute 1]

A setting is a threshold in KiB (0: glibc's default, whose threshold grows to the largest block freed);
a trailing ``t`` also sets torch's ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for its large CPU
tensors), a trailing ``s`` returns free heap pages (``malloc_trim``) at the start of every step, and
``r<MB>`` has the peak sampler return them whenever the resident set and its free heap pages grew by
that many MiB (the runtime's ``world.heap_trim_mb``), e.g. ``0r64``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time


def parse_setting(setting: str) -> tuple[int, str, int]:
    """``(threshold KiB, flags, trim MiB)`` of a setting such as ``1024t``, ``0s`` or ``0r64``."""
    m = re.fullmatch(r"(\d+)([ts]*)(?:r(\d+))?", setting)
    if m is None:
        raise ValueError(f"setting '{setting}': give KiB digits, then optional t / s flags, then optional r<MB>")
    return int(m.group(1)), m.group(2), int(m.group(3) or 0)


def child(setting: str, steps: int, tokens: int, min_tokens: int, doc: int, recompute: bool) -> dict:
    import numpy as np
    import torch

    from parallel_runtime.model import ModelConfig, Transformer, local_attention
    from parallel_runtime.training.heap import release_free_memory, set_heap_mmap_threshold
    from parallel_runtime.training.peaks import PeakProbe

    kb, flags, trim_mb = parse_setting(setting)
    set_heap_mmap_threshold(kb << 10)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=256, hidden=512, ffn_hidden=1536, num_layers=8, num_heads=8, num_kv_heads=8)
    model = Transformer(cfg, seed=0)
    model.recompute = recompute
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))  # [model params] the gradient buffer
    o = 0
    for p in params:
        p.grad = flat[o:o + p.numel()].view_as(p)
        o += p.numel()
    rng = np.random.default_rng(0)  # the same microbatch sizes in every process

    def microbatch():
        t = int(rng.integers(min_tokens, tokens + 1))
        cuts = np.r_[np.arange(0, t, doc), t]  # docs of `doc` tokens, the last one shorter
        cu = torch.from_numpy(cuts.astype(np.int32))
        pos = torch.arange(t) - torch.from_numpy(np.repeat(cuts[:-1], np.diff(cuts)))
        return torch.from_numpy(rng.integers(0, 256, t)), pos, local_attention(cu, "loop")

    probe = PeakProbe(torch.device("cpu"), trim_bytes=trim_mb << 20)  # the runtime's sampling interval
    out = []
    for _ in range(steps + 1):
        if "s" in flags:
            release_free_memory()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        probe.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(4):  # microbatches accumulate into the gradient buffer
            ids, pos, attn = microbatch()
            model(ids, pos, ids, attn=attn, num_valid_tokens=4 * tokens).backward()
        out.append({"step_s": time.perf_counter() - t0, "cpu_s": time.thread_time() - c0,
                    "peak": probe.peak(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0})
    probe.close()
    rest = out[1:]  # after the first step: the allocator's first growth and one-off costs
    return {"step_s": statistics.median(x["step_s"] for x in rest),
            "cpu_s": statistics.median(x["cpu_s"] for x in rest),
            "faults": statistics.median(x["faults"] for x in rest), "hwm_mb": max(x["peak"] for x in rest) / 2**20,
            "first_mb": out[0]["peak"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settings", default="0,1024,256,1024t",
                    help="mmap thresholds, KiB (0: glibc default); suffix t: THP_MEM_ALLOC_ENABLE=1, s: trim each "
                         "step, r<MB>: trim at that growth of free heap pages")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per microbatch (the largest)")
    ap.add_argument("--min-tokens", type=int, default=None, help="smallest microbatch (default: --tokens)")
    ap.add_argument("--doc", type=int, default=256, help="tokens per doc")
    ap.add_argument("--recompute", type=int, choices=(0, 1), default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    lo = a.tokens if a.min_tokens is None else a.min_tokens
    if a.child is not None:
        print(json.dumps(child(a.child, a.steps, a.tokens, lo, a.doc, bool(a.recompute))))
        return
    settings = a.settings.split(",")
    try:
        parsed = {k: parse_setting(k) for k in settings}  # one clear line for a bad setting before any child runs
    except ValueError as e:
        ap.error(str(e))
    got: dict[str, list[dict]] = {k: [] for k in settings}
    for r in range(a.repeats):
        for k in settings:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("THP_MEM_ALLOC_ENABLE", None)
            if "t" in parsed[k][1]:
                env["THP_MEM_ALLOC_ENABLE"] = "1"
            out = subprocess.run([sys.executable, __file__, "--child", k, "--steps", str(a.steps), "--tokens",
                                  str(a.tokens), "--min-tokens", str(lo), "--doc", str(a.doc), "--recompute",
                                  str(a.recompute)], check=True, capture_output=True, text=True, env=env).stdout
            got[k].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {r} setting {k}: {got[k][-1]}", file=sys.stderr)
    base = statistics.median(x["cpu_s"] for x in got[settings[0]])
    print(f"machine load {os.getloadavg()}; recompute {a.recompute}, microbatches of {lo}-{a.tokens} tokens")
    print(f"{'heap':>18} {'step s':>8} {'CPU s':>8} {'vs first':>9} {'faults/step':>12} {'peak MB':>9} "
          f"{'step 0 MB':>10}")
    for k in settings:
        c = statistics.median(x["cpu_s"] for x in got[k])
        kb, flags, trim_mb = parsed[k]
        name = ((f"{kb} KiB" if kb else "default") + (" +THP" if "t" in flags else "")
                + (" +trim" if "s" in flags else "") + (f" +trim@{trim_mb}MB" if trim_mb else ""))
        print(f"{name:>18} {statistics.median(x['step_s'] for x in got[k]):8.3f} {c:8.3f} {c / base:9.3f} "
              f"{statistics.median(x['faults'] for x in got[k]):12.0f} "
              f"{statistics.median(x['hwm_mb'] for x in got[k]):9.1f} "
              f"{statistics.median(x['first_mb'] for x in got[k]):10.1f}")


if __name__ == "__main__":
    main()
