"""Integrations with the trainers users already have.

* :mod:`.torch_dataset`: a :class:`~balanced_loader.BalancedLoader` as a torch ``IterableDataset`` (what
  ``BalancedLoader.dataset`` gives accelerate's ``skip_first_batches``).

Each module imports its framework when used.
"""
