"""Compare two training runs of the examples: largest loss and parameter differences.

Each folder holds ``params.pt`` (a state dict) and the losses: ``losses.json`` (``{step: loss}``,
examples/hf_trainer.py) or ``rank{r}.json`` files with a ``losses`` list (examples/hf_accelerate.py,
examples/hf_dynamic_cp.py; every rank's list is compared). Prints one line; exits 1 when a
difference is above ``--tol``.

    python tools/compare_runs.py /tmp/cp1 /tmp/cp4 --tol 1e-5
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch


def losses(folder: str) -> list[list[float]]:
    path = os.path.join(folder, "losses.json")
    if os.path.exists(path):
        with open(path) as f:
            d = json.load(f)
        return [[d[k] for k in sorted(d, key=int)]]
    out = []
    for p in sorted(glob.glob(os.path.join(folder, "rank*.json"))):
        with open(p) as f:
            out.append(json.load(f)["losses"])
    if not out:
        raise SystemExit(f"{folder}: no losses.json or rank*.json")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args(argv)
    la, lb = losses(args.a), losses(args.b)
    if any(len(x) != len(la[0]) for x in la + lb):
        raise SystemExit(f"different numbers of steps: {[len(x) for x in la]} vs {[len(x) for x in lb]}")
    dl = max(abs(x - y) for ra in la for rb in lb for x, y in zip(ra, rb))
    pa, pb = (torch.load(os.path.join(f, "params.pt")) for f in (args.a, args.b))
    if pa.keys() != pb.keys():
        raise SystemExit("the runs have different parameters")
    dp = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    print(f"{len(la[0])} steps: max loss difference {dl:.2e}, max parameter difference {dp:.2e} "
          f"({len(pa)} tensors, {sum(v.numel() for v in pa.values())} values)")
    return 0 if max(dl, dp) <= args.tol else 1


if __name__ == "__main__":
    raise SystemExit(main())
