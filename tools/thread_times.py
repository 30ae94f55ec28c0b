"""Where a run's CPU time went, thread by thread: on CPU, waiting for a CPU, and how often preempted.

Starts a command, reads ``/proc/<pid>/task/<tid>/schedstat`` and ``status`` of the command and every
descendant process every 0.5 s, and prints each thread's last reading: seconds on CPU, seconds runnable but
waiting for a CPU (run queue), voluntary context switches (it blocked: a lock, a collective, a
sleep) and involuntary ones (the kernel took its CPU for another thread). Linux only.

    python tools/thread_times.py python -m accelerate.commands.launch --multi_gpu --num_processes 2 \\
        -m parallel_runtime --recipe R.json --out /tmp/run
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _reading(pid: int, tid: str) -> tuple[str, float, float, int, int]:
    base = f"/proc/{pid}/task/{tid}"
    with open(f"{base}/comm") as f:
        name = f.read().strip()
    with open(f"{base}/schedstat") as f:
        run_ns, wait_ns, _ = (int(x) for x in f.read().split())
    switches = {}
    with open(f"{base}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, value = line.split(":")
                switches[key] = int(value)
    vol, invol = switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]
    return name, run_ns / 1e9, wait_ns / 1e9, vol, invol


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tools/thread_times.py COMMAND [ARGS...]")
    if not os.path.exists("/proc/self/schedstat"):
        raise SystemExit("thread_times: needs Linux's /proc/<pid>/task/<tid>/schedstat")
    import psutil

    p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(p.pid)
    last: dict[tuple[int, int], tuple[str, float, float, int, int]] = {}
    while p.poll() is None:
        try:
            kids = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for c in kids:
            try:
                for tid in os.listdir(f"/proc/{c.pid}/task"):
                    last[(c.pid, int(tid))] = _reading(c.pid, tid)
            except (OSError, ValueError, KeyError):
                pass  # the process or thread ended between listing and reading
        time.sleep(0.5)
    print(f"{'pid':>7} {'tid':>7} {'thread':<18} {'on CPU s':>9} {'run queue s':>11} {'voluntary':>10} "
          f"{'involuntary':>11}")
    for (pid, tid), (name, run, wait, vol, invol) in sorted(last.items(), key=lambda kv: -kv[1][1]):
        if run >= 0.1:
            print(f"{pid:7d} {tid:7d} {name:<18} {run:9.2f} {wait:11.2f} {vol:10d} {invol:11d}")
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
