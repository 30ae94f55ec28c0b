"""How often one train step goes back to a module it already left: the rooms a ``batch`` passes through.

Runs ``recipes/cpu-hetero.yaml`` (4 gloo ranks: a 2-stage pipeline beside a pool with CP groups, the train step
with overlap) for two steps and, on ``--rank`` during the second ``Trainer.train_step``, records every call into
a function of the project (``parallel_runtime/`` and ``balanced_loader/``: a *room* is one module file) down to
``--depth`` calls below ``train_step`` (1: what ``train_step`` calls itself). The calls in order, consecutive calls
of one room merged, are the *stays*; a stay in a room already left is a *return*. Printed per depth: stays,
rooms, returns, and the rooms entered more than twice (issue 37's target: each room at most twice). The last
row follows the batch itself: the calls at any depth that are given the step's ``StepBatch`` or its plan.

    python tools/step_rooms.py --depth 1 2 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = tuple(os.path.join(REPO, p) + os.sep for p in ("parallel_runtime", "balanced_loader"))


def _room(filename: str) -> str | None:
    return os.path.relpath(filename, REPO) if filename.startswith(PACKAGES) else None


def _rank(rank: int, world: int, sets: list[str], out: str, depth: int,
          watch: int) -> tuple[list[tuple[int, str]], list[str]] | None:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    t = Trainer(load_recipe(os.path.join(REPO, "recipes", "cpu-hetero.yaml"), sets), out)
    loader = iter(t.loader)
    t.train_step(t.next_batch(loader))  # the first step creates groups and models: not the steady state
    batch = t.next_batch(loader)
    calls: list[tuple[int, str]] = []  # (depth below train_step, room)
    walk: list[str] = []  # the rooms of the calls, at any depth, that receive the batch or its plan
    followed = (batch, batch.plan)
    level = [-1]  # call depth below train_step; -1: outside it

    def prof(frame, event, arg):  # sys.setprofile: Python calls and returns only
        if event == "call":
            if level[0] >= 0:
                level[0] += 1
                room = _room(frame.f_code.co_filename)
                if room is not None and level[0] <= depth:
                    calls.append((level[0], room))
                if room is not None and _holds(frame, followed):
                    walk.append(room)
            elif frame.f_code.co_name == "train_step":
                level[0] = 0
        elif event == "return" and level[0] >= 0:
            level[0] -= 1

    if rank == watch:
        sys.setprofile(prof)
    try:
        t.train_step(batch)
    finally:
        sys.setprofile(None)
    t.close()
    return (calls, walk) if rank == watch else None


def _holds(frame, objs: tuple) -> bool:
    """Whether one of the arguments of the call ``frame`` enters is one of ``objs`` (identity)."""
    co = frame.f_code
    return any(any(frame.f_locals.get(n) is o for o in objs)
               for n in co.co_varnames[:co.co_argcount + co.co_kwonlyargcount])


def stays_of(calls: list[tuple[int, str]], depth: int) -> list[str]:
    """The rooms of the calls down to ``depth``, in order, consecutive calls of one room merged."""
    stays: list[str] = []
    for d, room in calls:
        if d <= depth and (not stays or stays[-1] != room):
            stays.append(room)
    return stays


def summarize(calls: list[tuple[int, str]], depth: int) -> tuple[int, int, int, dict[str, int]]:
    """``(stays, rooms, returns, {room: entries > 2})`` of the calls down to ``depth``."""
    stays = stays_of(calls, depth)
    entries = Counter(stays)
    return len(stays), len(entries), len(stays) - len(entries), {r: n for r, n in entries.items() if n > 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rank", type=int, default=2, help="the rank watched (2: a whole-model lane of pool 1)")
    ap.add_argument("--sequence", action="store_true", help="also print the stays in order at each depth")
    a = ap.parse_args()
    from balanced_loader.build.corpus import stdlib_shards
    from parallel_runtime.launch import spawn_world

    with tempfile.TemporaryDirectory() as tmp:
        shards = os.path.join(tmp, "shards")
        stdlib_shards(shards, limit=300)
        sets = [f"data.source={shards}", "data.global_batch_tokens=4096", "train.checkpoint_every=0"]
        res = spawn_world(_rank, 4, sets, os.path.join(tmp, "run"), max(a.depth), a.rank, timeout_s=300)
    calls, walk = res[a.rank]
    print(f"rank {a.rank}, the second step of recipes/cpu-hetero.yaml (4 ranks): {len(calls)} calls into the project")
    print("| depth below train_step | stays | rooms | returns | rooms entered more than twice |")
    print("|---:|---:|---:|---:|---|")
    for d in a.depth:
        stays, rooms, returns, over = summarize(calls, d)
        many = ", ".join(f"{r} ({n})" for r, n in sorted(over.items(), key=lambda x: -x[1])) or "none"
        print(f"| {d} | {stays} | {rooms} | {returns} | {many} |")
    walk_calls = [(0, r) for r in walk]
    stays, rooms, returns, over = summarize(walk_calls, 0)
    many = ", ".join(f"{r} ({n})" for r, n in sorted(over.items(), key=lambda x: -x[1])) or "none"
    print(f"| the batch's walk (calls given the batch or its plan, any depth) | {stays} | {rooms} | {returns} | "
          f"{many} |")
    if a.sequence:
        print("walk: " + " -> ".join(os.path.basename(r) for r in stays_of(walk_calls, 0)))
        for d in a.depth:
            print(f"depth {d}: " + " -> ".join(os.path.basename(r) for r in stays_of(calls, d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
