"""The loader's arguments, checked before any work (contract 4), and the resume cursor of a loader state.

Every argument of :class:`~balanced_loader.loader.BalancedLoader` is checked for its type (``True`` is
not a number, ``"2"`` is not 2, ``None`` only where it means something) and its range, in one
``ValueError`` line naming it. Numbers that size memory, processes or time are bounded: a world of at
most 2**20 ranks (as a plan file), at most :func:`max_planner_workers` planner processes (a small
multiple of the cores this process may use), at most ``MAX_PREFETCH_STEPS`` plans ahead. ``pad_id``
must be a token id, inside the source's vocabulary when the source knows it.

A loader state's cursor (:func:`read_cursor`) must be well formed, and must sit on a step boundary of
the epoch it names (:func:`check_step_start`): a position moved inside a step would replay docs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

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


def read_cursor(state: dict[str, Any], *, epochs: int | None, num_docs: int) -> tuple[int, int, int, int]:
    """``(epoch, step_in_epoch, step, position)`` of a loader state, checked for form (integers >= 0 that
    agree with each other and with ``epochs``); :func:`check_step_start` checks the position itself."""
    cursor = []
    for key in ("epoch", "step_in_epoch", "step", "position"):
        v = state.get(key)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"malformed loader state: the cursor's {key!r} must be an integer >= 0, got "
                             f"{v!r}; pass a dict from BalancedLoader.state_dict()")
        cursor.append(int(v))
    epoch, s, step, pos = cursor
    if epochs is not None and (epoch > epochs or (epoch == epochs and s)):
        raise ValueError(f"loader state cursor (epoch {epoch}, step {s}) is past the last of this "
                         f"loader's {epochs} epoch(s)")
    if step < s or (epoch == 0 and step != s):
        raise ValueError(f"malformed loader state: global step {step} cannot be step {s} of epoch {epoch}")
    # a step starts at position 0 only as the first of its epoch, and before the last doc
    if (s == 0) != (pos == 0) or pos >= max(1, num_docs):
        raise ValueError(f"loader state cursor (epoch {epoch}, step {s}, position {pos}) is outside the epoch")
    return epoch, s, step, pos


def check_step_start(batches: Any, epoch: int, s: int, pos: int) -> None:
    """Position ``pos`` must be where step ``s`` of the epoch begins: the epoch is cut from its start up to
    ``pos`` (lengths only, one streaming pass over that part of the epoch; no tokens are read). A cursor
    moved inside a step, onto another step, or past the epoch's last step is one ``ValueError``."""
    where = f"loader state cursor (epoch {epoch}, step {s}, position {pos})"
    fix = "pass a dict from BalancedLoader.state_dict(), unchanged, to a loader of the same source and config"
    prev, at, k = 0, 0, 0  # step k starts at position `at`; step k - 1 started at `prev`
    while k < s and at < pos:
        end = batches.cut(at).end
        if end >= batches.num_docs:
            raise ValueError(f"{where}: epoch {epoch} has only {k + 1} step(s); {fix}")
        prev, at, k = at, end, k + 1
    if at == pos and k == s:
        return
    if k == s:
        raise ValueError(f"{where} is not on a step boundary: step {s} of epoch {epoch} begins at position {at} "
                         f"(a cursor moved inside a step would replay or skip docs); {fix}")
    if at == pos:
        raise ValueError(f"{where}: position {pos} is where step {k} begins, not step {s}; {fix}")
    raise ValueError(f"{where} is not on a step boundary: it lies inside step {k - 1}, which begins at position "
                     f"{prev} (a cursor moved inside a step would replay or skip docs); {fix}")
