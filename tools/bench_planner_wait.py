"""How long does iteration wait for a plan when a slow policy plans in the background?

Runs the loader over the bundled stdlib shards with a time-limited MILP policy (``flexsp``
or ``hydraulis``), once planning inline (``prefetch_steps=0``) and once ahead in worker
processes, while a fake training step sleeps ``--step-s`` seconds; prints the planner wait
of every step (``StepBatch.planner_wait_s``) and the median plan time.

    python tools/bench_planner_wait.py --policy flexsp --steps 12 --step-s 0.5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from balanced_loader.build.corpus import stdlib_shards
from balanced_loader.loader import BalancedLoader
from balanced_loader.presets import cost_preset

SHARDS = str(Path(__file__).resolve().parents[1] / ".demo" / "stdlib-shards")


def run(policy: str, steps: int, step_s: float, prefetch: int, workers: int,
        world: int) -> tuple[list[float], list[float]]:
    cost_name = "hydraulis-llama7b-a800" if policy == "hydraulis" else "flexsp-gpt7b-a100"
    loader = BalancedLoader(stdlib_shards(SHARDS), policy=policy, cost=cost_preset(cost_name), world_size=world, rank=0,
                            global_batch_tokens=400_000, seed=0, max_seq_len=32768, long_docs="split",
                            prefetch_steps=prefetch, planner_workers=workers, epochs=None)
    waits, plans = [], []
    with loader:
        for i, batch in enumerate(loader):
            waits.append(batch.planner_wait_s)
            plans.append(batch.plan.plan_seconds)
            time.sleep(step_s)  # the training step the planner overlaps with
            if i + 1 >= steps:
                break
    return waits, plans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="flexsp", choices=("flexsp", "hydraulis"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--step-s", type=float, default=0.5, help="seconds one fake training step takes")
    ap.add_argument("--world-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    a = ap.parse_args()
    for label, prefetch, workers in (("inline (prefetch_steps=0)", 0, 0),
                                     (f"ahead (prefetch_steps={a.prefetch}, planner_workers={a.workers})",
                                      a.prefetch, a.workers)):
        waits, plans = run(a.policy, a.steps, a.step_s, prefetch, workers, a.world_size)
        print(f"{a.policy}, {label}: median plan {statistics.median(plans) * 1e3:.0f} ms; "
              f"wait at step 0 {waits[0] * 1e3:.0f} ms, "
              f"after step 0: median {statistics.median(waits[1:]) * 1e3:.1f} ms, "
              f"max {max(waits[1:]) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
