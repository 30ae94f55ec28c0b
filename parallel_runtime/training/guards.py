"""What a run checks before its first step, so that a mistake is one line and no output is half written.

* **One writer per ``--out``** (:func:`lock_out`): rank 0 (the process that writes ``metrics.jsonl``)
  holds an exclusive lock on ``--out`` for the whole run
  (:class:`balanced_loader.outputs.locks.OutputLock`); a second run on it fails at once, naming the
  holder. Its peers stop at their first collective, naming rank 0's error.
* **One history per ``--out``** (:func:`check_history`): a folder with ``metrics.jsonl`` but no
  checkpoint cannot be resumed; a new run there would append a second history (steps 0..5, then
  0..2 again), so it is refused unless ``--fresh`` asks to start over (the old file is replaced).
* **The model's vocabulary covers the data** (:func:`check_vocab`, before any step): the largest token
  id the data holds (recorded in a shard index), else its tokenizer's vocabulary, must be below
  ``model.vocab_size`` (or the Hugging Face config's); and every step's ``input_ids`` are checked
  again (:func:`check_step_ids`, for sources that record neither), never an embedding's
  ``IndexError`` mid-step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from balanced_loader.outputs.locks import OutputLock


def lock_out(out_dir: str, rank: int) -> OutputLock | None:
    """Rank 0's exclusive lock on ``out_dir`` (``None`` on the other ranks, which write there only the
    checkpoint shards of a run rank 0 holds)."""
    if rank != 0:
        return None
    return OutputLock(out_dir, "--out").acquire()


def release_lock_on_error(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an ``__init__`` that takes ``self._out_lock``: a failure after it releases the lock at once."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "_out_lock", None)
            if lock is not None:
                lock.release()
            raise

    return wrapper


def check_history(out_dir: str, metrics_path: str, *, checkpoint: int | None, fresh: bool) -> None:
    """Refuse a run that would write a second history into ``out_dir`` (see the module doc); ``fresh``:
    replace a metrics file that no checkpoint continues. ``checkpoint``: the step of the checkpoint the
    run resumes from (None: none)."""
    if checkpoint is not None:
        if fresh:
            raise ValueError(f"--fresh: --out {out_dir} holds a checkpoint of step {checkpoint}, which this run would "
                             f"resume; choose another --out (or remove {os.path.join(out_dir, 'checkpoint')} to start "
                             f"over)")
        return
    if not os.path.exists(metrics_path) or not os.path.getsize(metrics_path):
        return
    if fresh:
        os.remove(metrics_path)
        print(f"--fresh: removed {metrics_path} (no checkpoint continued it); starting at step 0", flush=True)
        return
    with open(metrics_path, "rb") as f:
        lines = sum(1 for line in f if line.strip())
    raise ValueError(f"--out {out_dir} holds metrics.jsonl ({lines} step record(s)) but no checkpoint to resume "
                     f"from: a new run would append a second history; pass --fresh to start over (the old "
                     f"metrics.jsonl is replaced) or choose another --out")


def model_vocab(recipe: Any) -> tuple[int, str]:
    """``(vocab size, the recipe key that sets it)`` of the recipe's model."""
    if recipe.model.hf is not None:
        from parallel_runtime.hf.config import hf_config

        return int(hf_config(recipe.model.hf).vocab_size), "model.hf.vocab_size"
    return int(recipe.model.vocab_size), "model.vocab_size"


def check_vocab(source: Any, vocab: int, key: str) -> None:
    """The data's token ids must be embeddable: its recorded largest id, else its tokenizer's vocabulary."""
    top = getattr(source, "max_token_id", None)
    if top is not None:
        if top >= vocab:
            raise ValueError(f"{key} is {vocab} but {source.describe()} holds token id {top} (recorded in its index); "
                             f"set {key} to at least {top + 1} (e.g. --set {key}={top + 1})")
        return
    data_vocab = getattr(source, "vocab_size", None)
    if data_vocab is not None and int(data_vocab) > vocab:
        raise ValueError(f"{key} is {vocab} but {source.describe()} was tokenized with a vocabulary of "
                         f"{int(data_vocab)} ids; set {key} to at least {int(data_vocab)} (e.g. --set "
                         f"{key}={int(data_vocab)})")


def check_step_ids(batch: Any, vocab: int, key: str) -> None:
    """Every token id of this rank's microbatches is below ``vocab`` (a source that records no largest id)."""
    for mb in batch.microbatches:
        ids = mb.input_ids
        if ids.size and int(ids.max()) >= vocab:
            bad = int(ids.max())
            docs = sorted({int(d) for d, _, _ in mb.segments if d >= 0})[:3]
            raise ValueError(f"step {batch.step}: token id {bad} (docs {docs} ...) is outside {key} {vocab}; set "
                             f"{key} to at least {bad + 1}, or check the data's tokenizer")
