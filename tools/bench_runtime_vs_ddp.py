"""The runtime against the plain transformers + accelerate DDP loop a user would write: tokens/s and peak memory.

Same model (the 27.5M-parameter decoder 512x8: the native decoder, or the same shape as a transformers
``LlamaForCausalLM`` through ``model.hf``), same data (the stdlib corpus, byte tokens, docs truncated to
1,024), the same global batches (8,192 tokens per step), the same loader (hydra; the loop's with ``cp=1``
and ``mb.to_hf()``, microbatches capped at 1,024 tokens), 2 gloo ranks with 1 torch thread each. The
loop is what examples/hf_accelerate.py does (``parallel_runtime.diagnostics.ddp_loop``, launched as
``accelerate launch -m parallel_runtime.diagnostics.ddp_loop``): ``sdpa`` attention, DDP's gradient
all-reduce on the last microbatch (``no_sync`` before), ``clip_grad_norm_`` and torch's ``AdamW``.

    python tools/bench_runtime_vs_ddp.py --rounds 3          # native, hf, ddp; 2 warm-up + 4 timed steps each

Every run is a fresh ``accelerate launch`` of 2 processes; the configurations run one after the other
in rounds (the order rotates each round), so load from other jobs hits them alike. A step's time is
the time between rank 0's consecutive step lines (data, plan, forward/backward, communication and
optimizer: the whole iteration, timed the same way for the runtime and the loop); a run's tokens/s is its
timed steps' tokens over their summed time (the steps hold different token counts, 7,249 to 8,192 here:
the median step time, the figure before 2026-12-05, picked one step's time, which flipped between a full
step and a short one), a round's ratio is the runtime's tokens/s over the loop's (the same steps, the same
tokens), and the summary takes medians over rounds; the median step time is printed beside it. Beside it, the CPU time
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

from parallel_runtime.diagnostics.ddp_loop import recipe_text

REPO = Path(__file__).resolve().parents[1]
COST_FILE = REPO / "recipes" / "cost-cpu-tiny.yaml"
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+\S+\s+tokens\s+(\d+)")


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
    recipe.write_text(recipe_text(steps=steps, shards=shards, hf=name == "hf", cost_file=str(COST_FILE), tokens=tokens,
                                  cap=cap))
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)  # a folder with a checkpoint would resume instead of training
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port())]
    if name == "ddp":
        if sets:
            raise SystemExit("bench_runtime_vs_ddp: the ddp loop takes no recipe overrides (env:NAME=VALUE only)")
        cmd = [*launch, "-m", "parallel_runtime.diagnostics.ddp_loop", "--recipe", str(recipe), "--steps", str(steps)]
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
            "tokens_per_s": sum(toks[s] for s in range(first, steps)) / sum(times),
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
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        rss = statistics.median(r["rss_mb"] for r in runs)
        hwm = statistics.median(r["hwm_mb"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        if b:
            per = [r["tokens_per_s"] / x["tokens_per_s"] for x, r in zip(b, runs)]
            ratio = f"{statistics.median(per):9.3f}"
            rounds = ",".join(f"{v:.2f}" for v in per)
            mem = f"{rss / statistics.median(x['rss_mb'] for x in b):9.3f}"
            cpu_ratio = f"{statistics.median(x['cpu_s'] for x in b) / cpu:9.3f}"  # > 1: less CPU than the base
        else:
            ratio = rounds = mem = cpu_ratio = "-"
        lines.append(f"{cfg:<34} {step:8.2f} {tps:9.0f} {ratio:>9} {rounds:>22} {cpu:10.2f} {cpu_ratio:>9} "
                     f"{rss:11.0f} {mem:>9} {hwm:9.0f}")
    return "\n".join(lines)


def figures(got: dict[str, list[dict]]) -> list:
    """The record's figures (native and HF against the loop), where ``got`` has the plain ddp, native and hf runs."""
    from balanced_loader.outputs.records import Figure

    base = got["ddp"]
    out = []
    setting = ("27.5M decoder 512x8, stdlib corpus, 8,192 tokens per step, microbatch cap 1,024, hydra, 2 gloo ranks "
               f"of 1 thread, {len(base)} rounds of alternated launches; a launch's tokens/s: its timed steps' tokens "
               "over their time")
    for name, what, topic in (("native", "the native decoder", "native vs loop"),
                              ("hf", "the same Llama through model.hf", "HF vs loop")):
        runs = got[name]
        per = [r["tokens_per_s"] / x["tokens_per_s"] for x, r in zip(base, runs)]
        cpu = statistics.median(x["cpu_s"] for x in base) / statistics.median(r["cpu_s"] for r in runs)
        rss, rss_base = (statistics.median(r["rss_mb"] for r in rr) for rr in (runs, base))
        for kind, figure, target, value in (
                ("speed", f"tokens/s of the runtime with {what} / the plain accelerate DDP loop, {setting}",
                 ">= 0.98 (median of rounds), no round under 0.93",
                 f"**{statistics.median(per):.3f}** (rounds {', '.join(f'{v:.2f}' for v in per)}); CPU per step, "
                 f"the loop's / the runtime's {cpu:.3f}"),
                ("memory", f"peak RSS of the largest process, the runtime with {what} / the loop, same runs",
                 "<= 0.75", f"**{rss / rss_base:.3f}** ({rss:,.0f} MB against {rss_base:,.0f})")):
            out.append(Figure(id=f"runtime_vs_ddp.{kind}_{name}", area="runtime", figure=figure, target=target,
                              value=value, topic=topic, see="docs/results/hf_speed.md"))
    return out


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
    ap.add_argument("--record", help="write the results record here (docs/results/records/runtime_vs_ddp.json; "
                                     "needs the configurations ddp, native and hf)")
    a = ap.parse_args()
    if a.warmup < 1 or a.steps <= a.warmup:
        raise SystemExit("bench_runtime_vs_ddp: need --steps > --warmup >= 1")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = str(work / "stdlib-shards")
    from balanced_loader.build.corpus import stdlib_shards

    stdlib_shards(shards)  # built once, before any timed run
    configs = a.configs.split(",")
    if a.record and not {"ddp", "native", "hf"} <= set(configs):
        raise SystemExit("bench_runtime_vs_ddp: --record needs --configs with ddp, native and hf")
    got: dict[str, list[dict]] = {c: [] for c in configs}
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()}", flush=True)
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for i, c in enumerate(order):
            res = run_one(c, work, steps=a.steps, warmup=a.warmup, shards=shards, tokens=a.tokens, cap=a.cap,
                          tag=f"r{r}-{i}")
            got[c].append(res)
            print(f"round {r} {c}: {res['tokens_per_s']:.0f} tokens/s, step {res['step_s']:.2f} s {res['steps_s']}, "
                  f"CPU {res['cpu_s']:.2f} s/step, "
                  f"peak RSS {res['rss_mb']:.0f} MB (VmHWM {res['hwm_mb']:.0f}), load {res['load']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(got, indent=1))
    if a.record:
        from balanced_loader.outputs.records import make_record, write_record

        cmd = f"python tools/bench_runtime_vs_ddp.py --rounds {a.rounds} --steps {a.steps} --warmup {a.warmup} " \
              f"--configs {a.configs} --record {a.record}"
        write_record(a.record, make_record("runtime_vs_ddp", figures(got), command=cmd, details=got, repo=str(REPO)))
        print(f"wrote {a.record}; then: python -m balanced_loader.outputs.records")
    print(summarize(got, configs[0] if "ddp" not in configs else "ddp"))
    print(f"machine load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
