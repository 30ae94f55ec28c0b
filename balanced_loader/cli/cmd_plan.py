"""``balanced-loader plan``: plan global batches with a policy and write the plan JSON (contract 3).

The whole length file is one global batch in file order, unless ``--global-batch-tokens N``
cuts consecutive batches of sequences (a doc of at most ``--max-seq-len`` tokens, or one piece of
a longer doc; ``--shuffle --seed S`` shuffles them first, as the loader's epoch 0 does).
Batches are cut as they are planned, so ``--steps K`` reads only the
docs of K steps (a ``.npy`` is memory-mapped) and the counts in the summary line are the
docs read; a length of 0 in ``--lengths`` is an error when it is read. Every step is
validated against its batch (contract 1) before it is written; ``plan_seconds`` and
``predicted_ms`` (contract 2) are filled per step.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from balanced_loader.cli.cmd_simulate import add_cost_arguments
from balanced_loader.cli.options import COUNT, DEGREE, RANKS, SECONDS, add_batch_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_batch_arguments(p, max_seq_len_default="none, a doc no degree can hold is an error")
    p.add_argument("--world-size", type=RANKS, required=True, metavar="R", help="number of ranks")
    add_cost_arguments(p)
    p.add_argument("--policy", required=True, metavar="P",
                   help="maxlen, static-sp, token-kk, mcore-dcp, hydra, batch-ada, flexsp, hydraulis, greedy")
    p.add_argument("--tp", type=DEGREE, help="tensor-parallel size (static shape; a shape of the cost file)")
    p.add_argument("--pp", type=DEGREE, help="pipeline-parallel size (static shape; a shape of the cost file)")
    p.add_argument("--cp", type=DEGREE,
                   help="CP/SP degree: fixed for maxlen, static-sp, token-kk; the largest (a power of two) for the "
                        "dynamic policies; --cp 1: plain data parallelism, every group on one lane (any policy)")
    p.add_argument("--steps", type=COUNT, metavar="K", help="plan only the first K steps")
    p.add_argument("--time-limit", type=SECONDS, default=1.0, metavar="S",
                   help="solver time limit per call for flexsp / hydraulis (default 1 s)")
    p.add_argument("--candidates", metavar="CANDIDATES.yaml",
                   help="hydraulis: candidate strategies from 'balanced-loader candidates' (default: per batch)")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan here (default: JSON on stdout)")


def _lengths(args: argparse.Namespace):
    from balanced_loader.data.open import read_batch_source

    # zero lengths: rejected as batches read them
    return read_batch_source(args.lengths, args.source, cache_dir=args.cache_dir)


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send whatever is written to file descriptor 1 (C/C++ code included) to stderr for the block."""
    import ctypes
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # C stdio buffers: flush them while fd 1 is still stderr
            ctypes.CDLL(None).fflush(None)
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from balanced_loader.cli.streams import shares, stream_batches, wants_stream
    from balanced_loader.outputs.files import write_text
    from balanced_loader.plan import BatchItems, Plan
    from balanced_loader.planning import make_plan, warm_up
    from balanced_loader.planning.config import PlanConfig
    from balanced_loader.presets import load_cost

    for name in ("world_size", "global_batch_tokens", "max_seq_len", "steps", "shuffle_window"):
        v = getattr(args, name)
        if isinstance(v, int) and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    from balanced_loader.loader_args import check_cli_budget

    check_cli_budget(args.global_batch_tokens, args.max_seq_len)
    config = PlanConfig(policy=args.policy, world_size=args.world_size, tp=args.tp, pp=args.pp, cp=args.cp,
                        seed=args.seed, time_limit_s=args.time_limit, candidates=args.candidates)
    cost = load_cost(args.cost_file, args.cost, world_size=args.world_size)
    mixture: list = []  # per step: tokens per source (a --mix)
    if wants_stream(args):  # a mixture or a schedule: the loader's MixtureStream cuts the steps
        sb = stream_batches(args, max_seq_len=args.max_seq_len, steps=args.steps)
        batches, stats, what, num_docs = sb.batches, sb.stats, sb.label, sb.source.num_docs
        mixture = [c.mixture_tokens for c in sb.cuts]
    else:
        batches, stats, what, num_docs = _batches(args)
    if not batches:  # nothing to plan: one empty step
        z = np.zeros(0, dtype=np.int64)
        batches = [BatchItems(doc_ids=z, starts=z, lengths=z)]
    steps = []
    # with the plan JSON on stdout, keep native libraries' prints (HiGHS writes some diagnostics to the
    # process's stdout) out of it
    with contextlib.nullcontext() if args.out else native_stdout_to_stderr():
        warm_up(batches, cost, [config])  # kernels and policy loaded first: plan_seconds is the step's own work
        for k, items in enumerate(batches):
            plan = make_plan(items, cost, config, step=k)
            plan.validate(items, cost)
            steps.append(plan)
    out = Plan(policy=args.policy, world_size=args.world_size, steps=tuple(steps))
    report = sys.stdout if args.out else sys.stderr
    unusual = {k: v for k, v in stats.to_json().items() if k not in ("docs", "tokens") and v}
    print(f"{what}: {num_docs:,} docs, {stats.docs:,} read ({stats.tokens:,} tokens)"
          + (f" ({', '.join(f'{k} {v}' for k, v in unusual.items())})" if unusual else "")
          + f"; planned {len(steps)} step(s) of {sum(len(b) for b in batches):,} sequences, "
          f"{sum(int(b.lengths.sum()) for b in batches):,} tokens with policy {args.policy} on {args.world_size} "
          f"ranks, cost {cost.name or args.cost_file}", file=report)
    print(f"{'step':>5} {'sequences':>10} {'tokens':>12} {'microbatches':>12} {'groups':>7} "
          f"{'plan_ms':>9} {'predicted_ms':>13}" + ("  shares" if mixture else ""), file=report)
    for k, (items, s) in enumerate(zip(batches, steps)):
        mbs = max((len(p.microbatches) for p in s.pools), default=0)
        print(f"{s.step:>5} {len(items):>10,} {int(items.lengths.sum()):>12,} {mbs:>12} {s.num_groups:>7} "
              f"{s.plan_seconds * 1e3:>9.2f} {s.predicted_ms:>13.1f}"
              + (f"  {shares(mixture[k])}" if mixture else ""), file=report)
    if args.out:
        write_text(args.out, out.dumps() + "\n")  # complete or absent: an existing plan stays on failure
        print(f"wrote {args.out}", file=report)
    else:
        sys.stdout.write(out.dumps() + "\n")
    return 0


def _batches(args: argparse.Namespace):
    """``(batches, stats, label, num_docs)`` of ``--lengths``/``--source``."""
    from balanced_loader.batches.items import EmptyDocError
    from balanced_loader.batches.stream import global_batches
    from balanced_loader.data.lengths import doc_line

    lengths, shard_bounds, what = _lengths(args)
    try:
        batches, stats = global_batches(lengths, max_seq_len=args.max_seq_len, long_docs=args.long_docs,
                                        global_batch_tokens=args.global_batch_tokens, shuffle=args.shuffle,
                                        seed=args.seed, shard_bounds=shard_bounds, max_steps=args.steps,
                                        window=args.shuffle_window,
                                        empty_docs="error" if args.lengths else "skip")
    except EmptyDocError as e:  # found only when its batch is cut: name the file's line
        line = doc_line(args.lengths, e.doc)
        where = f"doc {e.doc}" + (f" (line {line})" if line is not None else "")
        raise ValueError(f"--lengths {what}: lengths must be positive; {where} has length 0") from None
    except ValueError as e:  # name the input: a bad length is found only when its batch is cut
        raise ValueError(f"{'--lengths ' if args.lengths else ''}{what}: {e}") from None
    return batches, stats, what, len(lengths)
