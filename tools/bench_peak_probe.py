"""What the CPU peak-memory sampler (training/peaks.py) costs: process CPU time with it at several intervals.

One process, one torch thread: 60 forward/backward passes of 8 linear layers on [1024, 512], with no
sampler and with the sampler at each ``--intervals`` (seconds), alternated over ``--repeats``; prints
the median wall and process CPU seconds (all threads: the sampler's wake-ups are what it costs) and
the CPU ratio to no sampler.

    python tools/bench_peak_probe.py [--repeats 4] [--intervals 0.005,0.02]
"""

from __future__ import annotations

import argparse
import statistics
import time


def work(passes: int = 60) -> tuple[float, float]:
    import torch

    layer = torch.nn.Linear(512, 512)
    x = torch.randn(1024, 512, requires_grad=True)  # [tokens, hidden]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(passes):
        y = x
        for _ in range(8):
            y = torch.relu(layer(y))
        y.sum().backward()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--intervals", default="0.005,0.02", help="sampler intervals in seconds, comma-separated")
    a = ap.parse_args()
    import torch

    from parallel_runtime.training.peaks import PeakProbe

    torch.set_num_threads(1)
    settings = [None, *(float(x) for x in a.intervals.split(","))]
    got: dict[float | None, list[tuple[float, float]]] = {s: [] for s in settings}
    for _ in range(a.repeats):
        for s in settings:
            probe = None if s is None else PeakProbe(torch.device("cpu"), interval_s=s)
            if probe is not None:
                probe.reset()  # starts the sampling thread
            got[s].append(work())
            if probe is not None:
                probe.close()
    base = statistics.median(c for _, c in got[None])
    for s, runs in got.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        name = "no sampler" if s is None else f"every {s * 1e3:g} ms"
        print(f"{name:<16} wall {wall:7.2f} s  CPU {cpu:7.2f} s  CPU vs none {cpu / base:6.3f}")


if __name__ == "__main__":
    main()
