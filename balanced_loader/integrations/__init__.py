"""Integrations with the trainers users already have.

* :mod:`.transformers`: :class:`~balanced_loader.integrations.transformers.BalancedTrainer`, a Hugging Face
  ``transformers.Trainer`` on a :class:`~balanced_loader.BalancedLoader` (and TRL's ``SFTTrainer``),
  plus the check that a model's attention honours packed ``position_ids``.
* :mod:`.rl`: :func:`~balanced_loader.balance` / :func:`~balanced_loader.balance_batch`, balanced
  microbatches of in-memory RL rollouts (verl's ``get_seqlen_balanced_partitions`` +
  ``rearrange_micro_batches``).

Each module imports its framework when used.
"""
