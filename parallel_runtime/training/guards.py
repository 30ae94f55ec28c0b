"""What a run checks before its first step, so that a mistake is one line and no output is half written.

* **``--out`` is a folder of its own** (:func:`check_out`): never the recipe, a data source, the stdlib
  corpus folder or the cost file it reads, never a device or a link to one (one line); a run refused
  after rank 0 made ``--out`` removes the folders it made while they are still empty
  (:func:`release_lock_on_error`), so a refusal leaves nothing behind.
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

from balanced_loader.data.vocab import check_step_ids as step_ids_check
from balanced_loader.data.vocab import check_vocab as vocab_check
from balanced_loader.outputs.files import check_output, missing_folders, remove_empty
from balanced_loader.outputs.locks import OutputLock


def lock_out(out_dir: str, rank: int) -> OutputLock | None:
    """Rank 0's exclusive lock on ``out_dir`` (``None`` on the other ranks, which write there only the
    checkpoint shards of a run rank 0 holds)."""
    if rank != 0:
        return None
    return OutputLock(out_dir, "--out").acquire()


def check_out(recipe: Any, out_dir: str) -> None:
    """``--out`` must be a folder (or a new path) that is none of the run's inputs (module doc)."""
    d = recipe.data
    inputs = [recipe.path, recipe.resolve(d.shards_dir)] if recipe.path else [d.shards_dir]
    inputs += [recipe.resolve(p) for p in (d.source, *(e.source for e in (d.mixture or ())), recipe.cost.file) if p]
    check_output(out_dir, "--out", inputs=inputs, folder=True)


def release_lock_on_error(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``Trainer.__init__(self, recipe, out_dir, ...)``, which takes ``self._out_lock``: ``--out`` is checked
    first (:func:`check_out`), and a failure after the lock releases it at once and removes the folders the
    run made for ``--out`` (on the rank that holds the lock, while they are still empty)."""

    @functools.wraps(init)
    def wrapper(self: Any, recipe: Any, out_dir: str, *args: Any, **kwargs: Any) -> None:
        check_out(recipe, out_dir)
        made = missing_folders(out_dir)
        try:
            init(self, recipe, out_dir, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "_out_lock", None)
            if lock is not None:
                lock.release()
                remove_empty(made)
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
    """The data's token ids must be embeddable (:func:`balanced_loader.data.vocab.check_vocab`)."""
    vocab_check(source, vocab, key, fix=f"e.g. --set {key}={{n}}")


def check_step_ids(batch: Any, vocab: int, key: str) -> None:
    """Every token id of this rank's microbatches is below ``vocab``, else one line naming the doc and the id."""
    step_ids_check(batch, vocab, key, fix=f"e.g. --set {key}={{n}}")
