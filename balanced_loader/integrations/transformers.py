"""Hugging Face ``transformers.Trainer`` on a :class:`~balanced_loader.BalancedLoader`: :class:`BalancedTrainer`.

What it changes in the Trainer, and why:

* **Data**: ``get_train_dataloader`` returns a stream of the loader's steps (``cp=1``: plain data
  parallelism, padding-free packed microbatches, every rank the same microbatch count); one
  item of it is one optimizer step. ``gradient_accumulation_steps`` must be 1: the rank's
  microbatches of the step *are* the accumulation steps (their number varies per step).
* **Loss**: every microbatch runs through the Trainer's own ``training_step`` /
  ``compute_loss`` (so ``compute_loss_func``, TRL's losses and metrics keep working) with
  ``num_items_in_batch`` = the step's **global** number of valid tokens from the plan (no
  collective): the model returns its token-sum loss divided by it, the Trainer multiplies by the
  number of processes (``average_tokens_across_devices``) and DDP averages, so the summed gradient
  is exactly that of the global mean loss, on any number of ranks. Gradients are all-reduced
  once per step, on the last microbatch (``accelerator.no_sync`` before it).
* **Checkpoints**: ``_save_checkpoint`` writes the loader state (``balanced_loader_state.json``)
  into each Trainer checkpoint; ``train(resume_from_checkpoint=...)`` restores it, so the run
  continues with the same batches (``ignore_data_skip`` is set: nothing is read and dropped). A
  damaged state file is one line naming it.
* **Vocabulary**: the data's token ids must be below the model's ``vocab_size``, checked before the
  first step (the largest id a source records; samples as they are read, through ``wrap``) and in
  every step before its forward: one line naming the doc and the id, never the embedding's ``IndexError``.
* **Attention**: packed docs must not attend to each other. transformers separates them from the
  restarting ``position_ids`` only for the implementations in :data:`PACKED_ATTENTION` and only
  without an ``attention_mask`` and without a KV cache; :func:`check_packed_attention` refuses
  the rest in one line (``to_hf()`` carries ``use_cache=False`` and no mask).

:class:`BalancedTrainerMixin` holds all of it, for other ``Trainer`` subclasses
(:mod:`balanced_loader.integrations.trl` applies it to TRL's ``SFTTrainer``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any

import numpy as np
from transformers import Trainer

from balanced_loader.data.vocab import check_step_ids, check_vocab
from balanced_loader.loader import BalancedLoader, StepBatch
from balanced_loader.materialize import Microbatch
from balanced_loader.outputs.files import read_json, write_text
from balanced_loader.wrapping import wrap

__all__ = ["LOADER_STATE_NAME", "PACKED_ATTENTION", "BalancedTrainer", "BalancedTrainerMixin",
           "check_packed_attention", "hf_inputs"]

LOADER_STATE_NAME = "balanced_loader_state.json"
# transformers 5.24 separates packed docs by their restarting position_ids (no attention_mask, no KV cache):
# sdpa / eager / flex through masking_utils.find_packed_sequence_indices (a block-diagonal causal mask),
# flash-attention through the varlen kernel (cu_seq_lens_* kwargs, else modeling_flash_attention_utils.
# _is_packed_sequence). docs/hf.md has the measured table.
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_MANAGED = ("rank", "world_size")  # the Trainer's process group decides these


def check_packed_attention(model: Any, inputs: dict[str, Any] | None = None) -> None:
    """Refuse, in one ``ValueError`` line, a setup where packed docs would silently attend to each other.

    ``model`` (a transformers model, or one wrapped by DDP/accelerate) must use an attention
    implementation of :data:`PACKED_ATTENTION`; ``inputs`` (the keyword arguments of the forward,
    when given) must carry no ``attention_mask`` and ``use_cache=False`` (or no ``use_cache`` and a
    config with ``use_cache`` False): with a mask or a KV cache transformers does not look at the
    position ids and every token attends across the doc boundaries.
    """
    plain = getattr(model, "module", model)
    cfg = getattr(plain, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} is not known to keep packed docs apart (transformers "
                         f"honours packed position_ids with {', '.join(PACKED_ATTENTION)}); load the model with "
                         f"attn_implementation='sdpa'")
    if inputs is None:
        return
    if inputs.get("attention_mask") is not None:
        raise ValueError("an attention_mask with packed docs makes transformers ignore the position ids, so every "
                         "token attends across doc boundaries; pass position_ids only (mb.to_hf() has no mask)")
    use_cache = inputs.get("use_cache", getattr(cfg, "use_cache", False))
    if use_cache:
        raise ValueError("use_cache=True with packed docs makes transformers ignore the position ids, so every token "
                         "attends across doc boundaries; pass use_cache=False (mb.to_hf() does)")


def hf_inputs(mb: Microbatch) -> dict[str, Any]:
    """The model's keyword arguments for one microbatch: ``mb.to_hf()`` without flash-attn's own names."""
    hf = mb.to_hf()
    for key in ("cu_seqlens", "max_seqlen"):  # flash_attn_varlen_func's names; transformers reads cu_seq_lens_*
        hf.pop(key, None)
    return hf


class _StepInputs(dict):
    """One optimizer step as the Trainer's "batch": ``input_ids`` (``[1, T]``, this rank's tokens of the
    step, for the Trainer's token and FLOP counters) and the :class:`~balanced_loader.loader.StepBatch`."""

    step_batch: StepBatch


class _StepStream:
    """The Trainer's train "dataloader": one item per step of the loader (of its current epoch only when
    the Trainer counts epochs, so each of the Trainer's epochs is one of the loader's)."""

    def __init__(self, loader: BalancedLoader, by_epoch: bool) -> None:
        self.loader = loader
        self.by_epoch = by_epoch

    def __iter__(self):
        import torch

        epoch = self.loader.epoch
        while not (self.by_epoch and self.loader.epoch != epoch):
            try:
                batch = next(self.loader)
            except StopIteration:
                return
            ids = np.concatenate([mb.input_ids for mb in batch.microbatches])  # [T] this rank's tokens of the step
            item = _StepInputs(input_ids=torch.from_numpy(ids)[None])
            item.step_batch = batch
            yield item

    def __len__(self) -> int:
        if not self.by_epoch:
            raise TypeError("an endless BalancedLoader stream has no length")
        return self.loader.steps_in_epoch(self.loader.epoch)


class BalancedTrainerMixin:
    """The :class:`BalancedTrainer` behaviour for any ``transformers.Trainer`` subclass (put it first)."""

    def __init__(self, *args: Any, train_source: Any = None, loader_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        loader_kwargs = dict(loader_kwargs or {})
        for key in _MANAGED:
            if key in loader_kwargs:
                raise ValueError(f"loader_kwargs[{key!r}]: BalancedTrainer takes rank and world size from the "
                                 f"Trainer's process group; remove it")
        if loader_kwargs.get("cp", 1) != 1 or dict(loader_kwargs.get("plan_config") or {}).get("cp", 1) != 1:
            raise ValueError("BalancedTrainer runs plain data parallelism (cp=1): whole docs on every rank; for "
                             "context parallelism use parallel_runtime.hf.enable_context_parallel in your own loop")
        loader_kwargs["cp"] = 1
        super().__init__(*args, **kwargs)
        args_ = self.args
        if args_.gradient_accumulation_steps != 1:
            raise ValueError(f"gradient_accumulation_steps={args_.gradient_accumulation_steps}: BalancedTrainer "
                             f"accumulates over each step's microbatches itself; set gradient_accumulation_steps=1 "
                             f"and size the step with loader_kwargs['global_batch_tokens']")
        if not args_.average_tokens_across_devices:
            raise ValueError("average_tokens_across_devices=False: BalancedTrainer divides every rank's token-sum "
                             "loss by the step's global token count and needs the Trainer to undo DDP's average; "
                             "leave average_tokens_across_devices=True")
        if args_.n_gpu > 1:
            raise ValueError("BalancedTrainer does not run under nn.DataParallel (several GPUs in one process); "
                             "launch one process per GPU with accelerate launch or torchrun")
        if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            raise ValueError(f"{type(self.model).__name__}.forward takes no num_items_in_batch, so its loss would "
                             f"be a per-microbatch mean; pass compute_loss_func (it receives num_items_in_batch)")
        check_packed_attention(self.model)
        if "global_batch_tokens" not in loader_kwargs or "cost" not in loader_kwargs:
            raise ValueError("loader_kwargs needs 'global_batch_tokens' (tokens per optimizer step) and 'cost' "
                             "(a CostModel, cost file or preset name)")
        self.bl_source = train_source
        self.bl_loader_kwargs = loader_kwargs
        self.bl_loader: BalancedLoader | None = None
        self._bl_resume: str | None = None
        args_.ignore_data_skip = True  # the loader state resumes the data; skipping would read and drop steps

    # ---- data ---------------------------------------------------------------------------
    def _bl_make_loader(self) -> BalancedLoader:
        kw = dict(self.bl_loader_kwargs)
        by_epoch = self.args.max_steps <= 0
        kw.setdefault("epochs", max(1, math.ceil(self.args.num_train_epochs)) if by_epoch else None)
        kw.setdefault("seed", self.args.data_seed if self.args.data_seed is not None else self.args.seed)
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        kw.setdefault("pad_id", int(pad) if isinstance(pad, int) else 0)
        source = self.bl_source if self.bl_source is not None else self.train_dataset
        if source is None:
            raise ValueError("BalancedTrainer needs train_source= (anything balanced_loader.open_source takes) or a "
                             "tokenized train_dataset with an input_ids column")
        kw.update(rank=self.args.process_index, world_size=self.args.world_size)
        named = isinstance(source, (str, os.PathLike)) or (
            isinstance(source, (list, tuple)) and source and all(isinstance(x, (str, os.PathLike)) for x in source))
        # a folder, file or URL (or several): open_source; samples (a list of token sequences, a torch or
        # datasets Dataset, a Source): wrap, which checks each sample's ids against the model's vocabulary
        vocab = self._bl_vocab()
        loader = BalancedLoader(source, **kw) if named else wrap(source, vocab_size=vocab, **kw)
        try:
            if vocab is not None:
                check_vocab(loader.source, vocab, "the model's vocab_size", fix="or tokenize the data for this model")
            if self._bl_resume is not None:
                path = os.path.join(self._bl_resume, LOADER_STATE_NAME)
                try:
                    loader.load_state_dict(read_loader_state(path))
                except ValueError as e:
                    raise ValueError(str(e) if path in str(e) else f"the loader state {path}: {e}") from None
        except BaseException:
            loader.close()
            raise
        return loader

    def _bl_vocab(self) -> int | None:
        """The model's vocabulary size (its config's ``vocab_size``), or None when it has none."""
        cfg = getattr(getattr(self.model, "module", self.model), "config", None)
        v = getattr(cfg, "vocab_size", None)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def get_train_dataloader(self) -> _StepStream:
        if self.bl_loader is not None:
            self.bl_loader.close()
        self.bl_loader = self._bl_make_loader()
        return _StepStream(self.bl_loader, by_epoch=self.args.max_steps <= 0)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device) -> tuple[list, int | None]:
        """One step (``num_batches`` is 1), with the step's global valid-token count from the plan."""
        try:
            item = next(epoch_iterator)
        except StopIteration:
            return [], None
        return [item], item.step_batch.num_valid_tokens

    # ---- one step -----------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        batch = getattr(inputs, "step_batch", None)
        if batch is None:  # not one of our steps (a caller's own batch): the Trainer's behaviour
            return super().training_step(model, inputs, num_items_in_batch)
        n = len(batch.microbatches)  # the same on every rank (cp=1)
        vocab = self._bl_vocab()
        if vocab is not None:  # before any forward of the step: one line naming the doc, not an IndexError
            check_step_ids(batch, vocab, "the model's vocab_size", fix="or tokenize the data for this model")
        total = None
        for i, mb in enumerate(batch.microbatches):
            # one gradient all-reduce per step: on the last microbatch, whose index is the same everywhere
            sync = contextlib.nullcontext() if i == n - 1 else self.accelerator.no_sync(model)
            with sync:
                loss = super().training_step(model, hf_inputs(mb), batch.num_valid_tokens)
            total = loss if total is None else total + loss
        return total

    # ---- checkpoints --------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.bl_loader is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            out = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            write_text(os.path.join(out, LOADER_STATE_NAME), json.dumps(self.bl_loader.state_dict(), indent=1))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output directory {self.args.output_dir}")
        self._bl_resume = resume_from_checkpoint or None
        if self._bl_resume is not None and not os.path.isfile(os.path.join(self._bl_resume, LOADER_STATE_NAME)):
            raise ValueError(f"checkpoint {self._bl_resume} has no {LOADER_STATE_NAME}: it was not saved by "
                             f"BalancedTrainer, so the data cannot continue where it stopped")
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self.bl_loader is not None:
                self.bl_loader.close()


def read_loader_state(path: str) -> dict[str, Any]:
    """A checkpoint's ``balanced_loader_state.json``; a damaged or truncated file is one ``ValueError`` naming it."""
    state = read_json(path, "the loader state", fix="it is damaged: resume from another checkpoint or start the "
                      "data over")
    if not isinstance(state, dict):
        raise ValueError(f"the loader state {path} is damaged: a JSON {type(state).__name__}, not a mapping")
    return state


class BalancedTrainer(BalancedTrainerMixin, Trainer):
    """``transformers.Trainer`` whose ``train()`` runs on a :class:`~balanced_loader.BalancedLoader`.

    ``BalancedTrainer(model=..., args=TrainingArguments(..., max_steps=N), train_source=SOURCE,
    loader_kwargs={"cost": ..., "global_batch_tokens": ..., "policy": ...})``: ``train_source`` is
    anything :func:`~balanced_loader.open_source` takes (default: ``train_dataset``, a tokenized
    ``datasets.Dataset``); ``loader_kwargs`` are the loader's options (``cp`` is 1; rank and world
    size come from the Trainer). See the module docstring for what changes and why.
    """
