"""The loader's arguments, checked before any work (contract 4), and the resume cursor of a loader state.

Every argument of :class:`~balanced_loader.loader.BalancedLoader` is checked for its type (``True`` is
not a number, ``"2"`` is not 2, ``None`` only where it means something) and its range, in one
``ValueError`` line naming it. Numbers that size memory, processes or time are bounded: a world of at
most 2**20 ranks (as a plan file), at most :func:`max_planner_workers` planner processes (a small
multiple of the cores this process may use), at most ``MAX_PREFETCH_STEPS`` plans ahead. ``pad_id``
must be a token id, inside the source's vocabulary when the source knows it.

Every step's ``global_batch_tokens`` must hold one sequence of that step's ``max_seq_len``
(:func:`check_budget_holds_a_sequence`; the command line's form :func:`check_cli_budget`). A loader
state's cursor is checked where it is read (:meth:`balanced_loader.batches.stream.BatchStream.load`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from balanced_loader.schedule import Schedule, schedule

MAX_RANKS = 1 << 20  # ranks of a world (a plan file's limit too)
MAX_TOKENS = 1 << 40  # tokens of a doc, a segment or a global batch
MAX_COUNT = 1 << 30  # epochs, shuffle window (docs)
MAX_SEED = (1 << 63) - 1
MAX_PREFETCH_STEPS = 256  # plans computed ahead (each holds its batch and plan in memory)
MAX_TOKEN_ID = (1 << 32) - 1  # the largest id any source dtype (uint32) holds
WORKERS_PER_CORE = 2


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS tells, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_planner_workers() -> int:
    """The most planner processes a loader starts: ``WORKERS_PER_CORE`` per available core."""
    return WORKERS_PER_CORE * available_cores()


def integer(value: Any, name: str, lo: int, hi: int, *, hint: str = "") -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (numpy integers too; never a bool, a float or a string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer{hint}, got {value!r} ({type(value).__name__})")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in {lo:,}..{hi:,}{hint}, got {int(value):,}")
    return int(value)


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def _env_int(name: str) -> int:
    v = os.environ[name]
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def resolve_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments where given, else the initialized ``torch.distributed``
    process group (only when torch is already imported: it is never imported for this), else the
    ``RANK``/``WORLD_SIZE`` environment variables, else one process (rank 0 of 1).

    A process that looks like one of several (``LOCAL_RANK`` set, or ``WORLD_SIZE``/
    ``LOCAL_WORLD_SIZE`` above 1) but has no rank from any of these is an error, never rank 0.
    ``world_size`` is at most 2**20 (what a plan file holds; a larger world would size every plan).
    """
    dist = sys.modules.get("torch.distributed")
    group = None
    if dist is not None and dist.is_available() and dist.is_initialized():
        group = (dist.get_rank(), dist.get_world_size())
    if world_size is None:
        world_size = group[1] if group else _env_int("WORLD_SIZE") if os.environ.get("WORLD_SIZE") else 1
    world_size = integer(world_size, "world_size", 1, MAX_RANKS)
    if rank is None:
        if group:
            rank = group[0]
        elif os.environ.get("RANK"):
            rank = _env_int("RANK")
        else:
            hints = [f"{k}={os.environ[k]}" for k in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
                     if os.environ.get(k) and (k == "LOCAL_RANK" or os.environ[k] != "1")]
            if hints:
                raise ValueError(f"rank is not set but this process is one of several ({', '.join(hints)}): "
                                 f"pass rank=, set RANK, or initialize torch.distributed before the loader")
            rank = 0
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    return int(rank), world_size


def check_loader_args(*, policy: Any, global_batch_tokens: Any, seed: Any, max_seq_len: Any, long_docs: Any,
                      long_doc_modes: tuple[str, ...], shuffle: Any, shuffle_window: Any, epochs: Any,
                      prefetch_steps: Any, planner_workers: Any, cp_inner: Any, pad_id: Any,
                      validate: Any) -> dict[str, Any]:
    """The loader's scalar arguments, checked (one ``ValueError`` naming the first bad one) and normalized
    to plain Python values (``int``, ``bool``, ``None``)."""
    if not isinstance(policy, str) or not policy:
        raise ValueError(f"policy must be a policy name (a string such as 'hydra'), got {policy!r}")
    if not isinstance(long_docs, str) or long_docs not in long_doc_modes:
        raise ValueError(f"long_docs must be one of {', '.join(long_doc_modes)}, got {long_docs!r}")
    workers_hint = f" ({WORKERS_PER_CORE} x the {available_cores()} CPU core(s) this process may use; 0: a thread)"
    return {
        "global_batch_tokens": integer(global_batch_tokens, "global_batch_tokens", 1, MAX_TOKENS),
        "seed": integer(seed, "seed", 0, MAX_SEED),
        "max_seq_len": None if max_seq_len is None else integer(max_seq_len, "max_seq_len", 1, MAX_TOKENS),
        "long_docs": long_docs,
        "shuffle": flag(shuffle, "shuffle"),
        "shuffle_window": integer(shuffle_window, "shuffle_window", 1, MAX_COUNT),
        "epochs": None if epochs is None else integer(epochs, "epochs", 1, MAX_COUNT, hint=" or None (endless)"),
        "prefetch_steps": integer(prefetch_steps, "prefetch_steps", 0, MAX_PREFETCH_STEPS),
        "planner_workers": integer(planner_workers, "planner_workers", 0, max_planner_workers(), hint=workers_hint),
        "cp_inner": integer(cp_inner, "cp_inner", 1, MAX_RANKS),
        "pad_id": integer(pad_id, "pad_id", 0, MAX_TOKEN_ID),
        "validate": flag(validate, "validate"),
    }


def check_pad_id(pad_id: int, source: Any) -> None:
    """``pad_id`` must be a token id of the source's vocabulary, when the source knows its vocabulary."""
    vocab = getattr(source, "vocab_size", None)
    if vocab is not None and pad_id >= int(vocab):
        raise ValueError(f"pad_id {pad_id} is outside the vocabulary of {source.describe()} ({int(vocab)} ids: "
                         f"0..{int(vocab) - 1}); pass a pad_id below {int(vocab)}")


def smallest(s: Schedule) -> int:
    """The smallest value of a schedule."""
    return int(min(v for _, v in s.points))


def check_budget_holds_a_sequence(budget: Schedule, limit: Schedule) -> None:
    """Every step's ``global_batch_tokens`` must hold one sequence of that step's ``max_seq_len``: then every
    step holds between ``B - max_seq_len`` and ``B`` tokens. Both are piecewise linear, so their points
    decide (rounding to integers keeps the order)."""
    for step in sorted({s for s, _ in budget.points} | {s for s, _ in limit.points}):
        b, m = int(budget.at(step)), int(limit.at(step))
        if b < m:
            at = "" if budget.constant and limit.constant else f" at step {step}"
            raise ValueError(f"global_batch_tokens {b} is smaller than max_seq_len {m}{at}: a step must hold one "
                             f"sequence; raise global_batch_tokens or lower max_seq_len")


def check_cli_budget(budget: Any, limit: Any) -> None:
    """``--global-batch-tokens`` must hold one sequence of ``--max-seq-len`` at every step (numbers or
    schedules; either absent: nothing to check)."""
    if budget is not None and limit is not None:
        check_budget_holds_a_sequence(schedule(budget, "--global-batch-tokens"), schedule(limit, "--max-seq-len"))
