"""Integrations with the trainers users already have: adapters only (the algorithms they run live below, in
:mod:`balanced_loader.planning` and the loader).

* :mod:`.transformers`: :class:`~balanced_loader.integrations.transformers.BalancedTrainer`, a Hugging Face
  ``transformers.Trainer`` on a :class:`~balanced_loader.BalancedLoader`, plus the check that a model's attention
  honours packed ``position_ids``.
* :mod:`.trl`: the same mixin on TRL's ``SFTTrainer``.
* :mod:`.megatron`: :class:`~balanced_loader.HydraCPScheduler`, Megatron-LM's dynamic-CP scheduler interface.

RL balancing (:func:`~balanced_loader.balance` / :func:`~balanced_loader.balance_batch`) is a planning
algorithm: :mod:`balanced_loader.planning.rl`.

Each module imports its framework when used.
"""
