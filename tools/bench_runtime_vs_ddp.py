"""The runtime against the plain transformers + accelerate DDP loop a user would write: tokens/s and peak memory.

Same model (the 27.5M-parameter decoder 512x8: the native decoder, or the same shape as a transformers
``LlamaForCausalLM`` through ``model.hf``), same data (the stdlib corpus, byte tokens, docs truncated to
1,024), the same global batches (8,192 tokens per step), the same loader (hydra; the loop's with ``cp=1``
and ``mb.to_hf()``, microbatches capped at 1,024 tokens), 2 gloo ranks with 1 torch thread each. The
loop is what examples/hf_accelerate.py does: ``sdpa`` attention, DDP's gradient all-reduce on the last
microbatch (``no_sync`` before), ``clip_grad_norm_`` and torch's ``AdamW`` with its defaults.

    python tools/bench_runtime_vs_ddp.py --rounds 3          # native, hf, ddp; 2 warm-up + 4 timed steps each

Every run is a fresh ``accelerate launch`` of 2 processes; the configurations run one after the other
in rounds (the order rotates each round), so load from other jobs hits them alike. A step's time is
the time between rank 0's consecutive step lines (data, plan, forward/backward, communication and
optimizer: the whole iteration, timed the same way for the runtime and the loop); a run's figure is
the median over its timed steps, and the summary takes medians over rounds. Beside it, the CPU time
of all the run's processes per timed step (user + system of every thread: compute, communication,
the loader's planner), which other jobs on a shared machine disturb far less than wall time. Peak
memory is sampled
from outside every 20 ms (resident set of each process of the run, and its kernel high-water mark
``VmHWM``, which the runtime leaves alone); the figure is the largest process's.

A configuration is ``ddp``, ``native`` or ``hf``, optionally with recipe overrides:
``native+world.heap_mmap_kb=1024`` (``+`` separates ``--set`` values; ``+env:NAME=VALUE`` sets an
environment variable of the run instead, e.g. ``native+env:THP_MEM_ALLOC_ENABLE=1``, the runtime
with torch's transparent huge pages, or ``ddp+env:THP_MEM_ALLOC_ENABLE=1``, the loop with them), and
optionally ``@DIR``: the runtime from another checkout of this repository (``native@/tmp/before``:
the code before a change, side by side with it). The 1-minute load average of the machine is printed
before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+\S+\s+tokens\s+(\d+)")

NATIVE = {"vocab_size": 256, "hidden": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "ffn_hidden": 1536}
# the same decoder as a transformers Llama (RMSNorm eps, untied head; RoPE theta 1e4 is transformers' default)
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}


def recipe_text(*, steps: int, shards: str, hf: bool, tokens: int, cap: int) -> str:
    """The benchmark's recipe (JSON is YAML): both models, the loader settings the loop reuses."""
    rec = {"seed": 0, "steps": steps,
           "data": {"source": "stdlib", "shards_dir": shards, "global_batch_tokens": tokens, "max_seq_len": 1024,
                    "long_docs": "truncate"},
           "model": {"hf": LLAMA} if hf else NATIVE,
           "policy": {"name": "hydra"},
           "cost": {"file": str(REPO / "recipes" / "cost-cpu-tiny.yaml"), "lane_caps": {"1x1": cap}},
           "world": {"size": 2, "device": "cpu", "threads": 1, "timeout_s": 600},
           "optimizer": {"lr": 3e-3, "max_grad_norm": 1.0},
           "train": {"attention": "auto"}}
    return json.dumps(rec, indent=1)


# ---- the plain loop (runs under accelerate launch) -------------------------------------------------


def ddp_loop(recipe_path: str, steps: int) -> None:
    """A plain accelerate DDP loop over the recipe's loader with ``cp=1``; prints one line per step (rank 0)."""
    import contextlib

    import torch
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM

    import balanced_loader as bl
    from parallel_runtime.config import load_recipe

    torch.set_num_threads(1)
    r = load_recipe(recipe_path)
    d = r.data
    accelerator = Accelerator(cpu=True)
    loader = bl.BalancedLoader(bl.open_source(d.shards_dir), policy=r.policy.name, cost=r.cost_model(), cp=1,
                               global_batch_tokens=d.global_batch_tokens, seed=r.seed, max_seq_len=d.max_seq_len,
                               long_docs=d.long_docs, epochs=None)
    spec = dict(LLAMA)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(r.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    o = r.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for batch in loader:
        if batch.step >= steps:
            break
        n = len(batch.microbatches)
        loss_sum = torch.zeros(())
        for i, mb in enumerate(batch.microbatches):
            hf = mb.to_hf()
            sync = contextlib.nullcontext() if i == n - 1 else accelerator.no_sync(model)
            with sync:
                # transformers' own loss: the token sum over num_items_in_batch (the step's global targets);
                # x processes because DDP averages the gradients over ranks
                loss = model(input_ids=hf["input_ids"], position_ids=hf["position_ids"], labels=hf["labels"],
                             num_items_in_batch=batch.num_valid_tokens, use_cache=False).loss
                accelerator.backward(loss * accelerator.num_processes)
            loss_sum += loss.detach()
        accelerator.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = float(accelerator.reduce(loss_sum, reduction="sum"))
        if accelerator.is_main_process:
            print(f"step {batch.step:4d}  loss {total:.5f}  tokens {batch.plan.tokens:6d}", flush=True)
    loader.close()
    accelerator.wait_for_everyone()


# ---- measuring one run from outside --------------------------------------------------------------


class MemorySampler(threading.Thread):
    """Every ``interval`` s: resident set and ``VmHWM`` of every descendant of ``pid`` (largest seen per process)."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.rss: dict[int, int] = {}  # pid -> largest sampled resident bytes
        self.hwm: dict[int, int] = {}  # pid -> last read VmHWM bytes
        self.done = threading.Event()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every descendant of the root so far (all their threads)."""
        import psutil

        total = 0.0
        for p in self.root.children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                kids = self.root.children(recursive=True)
            except psutil.Error:
                return
            for p in kids:
                try:
                    with open(f"/proc/{p.pid}/status") as f:
                        for line in f:
                            if line.startswith(("VmRSS:", "VmHWM:")):
                                kb = int(line.split()[1]) * 1024
                                d = self.rss if line.startswith("VmRSS") else self.hwm
                                d[p.pid] = max(d.get(p.pid, 0), kb)
                except (OSError, ValueError):
                    pass
            self.done.wait(self.interval)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load1() -> float:
    return os.getloadavg()[0]


def run_one(config: str, work: Path, *, steps: int, warmup: int, shards: str, tokens: int, cap: int,
            tag: str) -> dict:
    """One launch of ``config``; returns its step times, tokens, peaks and the load around it."""
    what, _, code = config.partition("@")
    name, *sets = what.split("+")
    envs = dict(x[4:].split("=", 1) for x in sets if x.startswith("env:"))
    sets = [x for x in sets if not x.startswith("env:")]
    if name not in ("ddp", "native", "hf"):
        raise SystemExit(f"bench_runtime_vs_ddp: unknown configuration '{name}' (ddp, native, hf)")
    recipe = work / f"{name}.json"
    recipe.write_text(recipe_text(steps=steps, shards=shards, hf=name == "hf", tokens=tokens, cap=cap))
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)  # a folder with a checkpoint would resume instead of training
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port())]
    if name == "ddp":
        if sets:
            raise SystemExit("bench_runtime_vs_ddp: the ddp loop takes no recipe overrides (env:NAME=VALUE only)")
        cmd = [*launch, __file__, "--ddp-child", str(recipe), "--steps", str(steps)]
    else:
        cmd = [*launch, "-m", "parallel_runtime", "--recipe", str(recipe), "--out", str(out)]
        for s in sets:
            cmd += ["--set", s]
    root = Path(code).resolve() if code else REPO  # whose parallel_runtime runs (the loop: always this one's tool)
    if name == "ddp" and code:
        raise SystemExit("bench_runtime_vs_ddp: the ddp loop runs from this checkout (no @DIR)")
    path = str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, **envs, OMP_NUM_THREADS="1", PYTHONPATH=path)
    load0 = _load1()
    # under ``python -m`` the working directory comes first on the import path: it picks the checkout that runs
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root)
    sampler = MemorySampler(p.pid)
    sampler.start()
    stamps: dict[int, float] = {}
    cpu: dict[int, float] = {}  # CPU seconds of the run's processes when rank 0 printed step s
    toks: dict[int, int] = {}
    tail: list[str] = []
    for line in p.stdout:
        now = time.perf_counter()
        m = STEP_LINE.match(line.strip())
        if m:
            stamps[int(m.group(1))] = now
            cpu[int(m.group(1))] = sampler.cpu_seconds()
            toks[int(m.group(1))] = int(m.group(2))
        tail = (tail + [line])[-30:]
    p.wait()
    sampler.done.set()
    sampler.join()
    shutil.rmtree(out, ignore_errors=True)  # the end-of-run checkpoint: 3 x 4 bytes per parameter
    if p.returncode != 0 or len(stamps) < steps:
        raise SystemExit(f"bench_runtime_vs_ddp: {config} failed (exit {p.returncode}):\n{''.join(tail)}")
    first = max(warmup, 1)
    times = [stamps[s] - stamps[s - 1] for s in range(first, steps)]
    return {"config": config, "step_s": statistics.median(times), "steps_s": [round(t, 3) for t in times],
            "cpu_s": (cpu[steps - 1] - cpu[first - 1]) / (steps - first),
            "tokens": statistics.mean(toks[s] for s in range(max(warmup, 1), steps)),
            "rss_mb": max(sampler.rss.values(), default=0) / 2**20,
            "hwm_mb": max(sampler.hwm.values(), default=0) / 2**20,
            "load": [round(load0, 2), round(_load1(), 2)]}


def summarize(got: dict[str, list[dict]], base: str) -> str:
    lines = [f"{'config':<34} {'step s':>8} {'tokens/s':>9} {'vs ' + base:>9} {'per-round':>22} "
             f"{'CPU s/step':>10} {'vs ' + base:>9} {'peak RSS MB':>11} {'vs ' + base:>9} {'VmHWM MB':>9}"]
    b = got.get(base)
    for cfg, runs in got.items():
        step = statistics.median(r["step_s"] for r in runs)
        tps = statistics.median(r["tokens"] / r["step_s"] for r in runs)
        rss = statistics.median(r["rss_mb"] for r in runs)
        hwm = statistics.median(r["hwm_mb"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        if b:
            per = [x["step_s"] / r["step_s"] for x, r in zip(b, runs)]
            ratio = f"{statistics.median(per):9.3f}"
            rounds = ",".join(f"{v:.2f}" for v in per)
            mem = f"{rss / statistics.median(x['rss_mb'] for x in b):9.3f}"
            cpu_ratio = f"{statistics.median(x['cpu_s'] for x in b) / cpu:9.3f}"  # > 1: less CPU than the base
        else:
            ratio = rounds = mem = cpu_ratio = "-"
        lines.append(f"{cfg:<34} {step:8.2f} {tps:9.0f} {ratio:>9} {rounds:>22} {cpu:10.2f} {cpu_ratio:>9} "
                     f"{rss:11.0f} {mem:>9} {hwm:9.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the configurations (default 3)")
    ap.add_argument("--configs", default="ddp,native,hf",
                    help="comma-separated: ddp, native, hf, each optionally +key=value (recipe --set)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed at the start of a run (default 2)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (default 8192)")
    ap.add_argument("--cap", type=int, default=1024, help="tokens per microbatch and lane (default 1024)")
    ap.add_argument("--work", default="/tmp/bench_runtime_vs_ddp", help="recipes, runs and the corpus")
    ap.add_argument("--json", help="also write every run's figures to this file")
    ap.add_argument("--ddp-child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ddp_child:
        ddp_loop(a.ddp_child, a.steps)
        return
    if a.warmup < 1 or a.steps <= a.warmup:
        raise SystemExit("bench_runtime_vs_ddp: need --steps > --warmup >= 1")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = str(work / "stdlib-shards")
    from balanced_loader.build.corpus import stdlib_shards

    stdlib_shards(shards)  # built once, before any timed run
    configs = a.configs.split(",")
    got: dict[str, list[dict]] = {c: [] for c in configs}
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()}", flush=True)
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for i, c in enumerate(order):
            res = run_one(c, work, steps=a.steps, warmup=a.warmup, shards=shards, tokens=a.tokens, cap=a.cap,
                          tag=f"r{r}-{i}")
            got[c].append(res)
            print(f"round {r} {c}: step {res['step_s']:.2f} s {res['steps_s']}, CPU {res['cpu_s']:.2f} s/step, "
                  f"peak RSS {res['rss_mb']:.0f} MB (VmHWM {res['hwm_mb']:.0f}), load {res['load']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(got, indent=1))
    print(summarize(got, configs[0] if "ddp" not in configs else "ddp"))
    print(f"machine load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
