"""TRL's ``SFTTrainer`` on a :class:`~balanced_loader.BalancedLoader`: :class:`BalancedSFTTrainer`.

``pip install 'balanced-loader[trl]'``. TRL prepares the dataset as usual (tokenizing, chat
templates, EOS, truncation to ``max_length``); the loader then reads the prepared ``input_ids``
column as its source (or ``train_source=`` when given) and :class:`~balanced_loader.integrations.
transformers.BalancedTrainerMixin` runs the steps: packed microbatches, equal counts, the step's
global valid tokens as ``num_items_in_batch`` (TRL's fused-LM-head loss divides its token sum by
it), loader state in the checkpoints. TRL's metrics (entropy, token accuracy, tokens seen) keep
working. Refused in one line: ``packing=True`` (the loader packs; TRL's packed rows would be
read as single docs) and completion-only / assistant-only losses (the loader trains on every
token of a doc and does not read TRL's ``labels`` column).
"""

from __future__ import annotations

from typing import Any

from trl import SFTTrainer

from balanced_loader.integrations.transformers import BalancedTrainerMixin

__all__ = ["BalancedSFTTrainer"]


class BalancedSFTTrainer(BalancedTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose ``train()`` runs on a BalancedLoader (``loader_kwargs`` as for BalancedTrainer)."""

    def __init__(self, *args: Any, train_source: Any = None, loader_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, train_source=train_source, loader_kwargs=loader_kwargs, **kwargs)
        if self.args.packing:
            raise ValueError("BalancedSFTTrainer packs the docs itself (balanced across ranks); set packing=False in "
                             "the SFTConfig")
        if self.completion_only_loss or self.args.assistant_only_loss:
            raise ValueError("BalancedSFTTrainer trains on every token of a doc; set completion_only_loss=False and "
                             "assistant_only_loss=False in the SFTConfig")
