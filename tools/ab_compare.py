"""Run one benchmark in two checkouts, alternating, and report the median ratio of its figures.

Each round runs the command in the base checkout, then in this one (the order alternates between
rounds), each in a fresh process with ``PYTHONPATH`` and the working folder set to that checkout, so the
code under test is the checkout's. ``{json}`` in the command is replaced by a per-run output path; the
named keys of that JSON (dotted paths into it) are compared: ``new / base`` per round, the median of the
rounds. On a shared machine this is the only way to compare speeds: both sides see the same load.

    python tools/ab_compare.py --base /tmp/base --rounds 3 --key ratio_cluster --key ratio_rank \\
        -- tools/bench_loader.py --repeats 3 --json {json}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _get(d: dict, path: str) -> float:
    for k in path.split("."):
        d = d[k]
    return float(d)  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (e.g. git worktree add /tmp/base COMMIT)")
    ap.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--key", action="append", required=True, help="a dotted path into the command's JSON")
    ap.add_argument("--out", help="write every round's values and the ratios here (JSON)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the tool and its arguments")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd or not any("{json}" in c for c in cmd):
        ap.error("give the command after --, with {json} where it writes its JSON")
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                code = os.path.abspath(getattr(a, side))
                out = os.path.join(tmp, f"{side}-{r}.json")
                argv = [sys.executable] + [c.replace("{json}", out) for c in cmd]
                p = subprocess.run(argv, cwd=code, env={**os.environ, "PYTHONPATH": code}, capture_output=True,
                                   text=True)
                if p.returncode:
                    print(p.stdout[-2000:] + p.stderr[-2000:], file=sys.stderr)
                    print(f"ab_compare: the {side} run of round {r} failed (exit {p.returncode})", file=sys.stderr)
                    return 1
                with open(out) as f:
                    runs[side].append(json.load(f))
    result = {"command": " ".join(cmd), "base": os.path.abspath(a.base), "rounds": a.rounds, "keys": {}}
    for k in a.key:
        ratios = [_get(n, k) / _get(b, k) for n, b in zip(runs["new"], runs["base"])]
        result["keys"][k] = {"base": [_get(b, k) for b in runs["base"]], "new": [_get(n, k) for n in runs["new"]],
                             "ratios": ratios, "median_ratio": statistics.median(ratios)}
        rounds = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{k}: new / base median {statistics.median(ratios):.3f} (rounds {rounds})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
