"""RL balancing: per-rank microbatches of in-memory rollouts (:func:`balance`, :func:`balance_batch`), verl's
``get_seqlen_balanced_partitions`` + ``rearrange_micro_batches`` as one pure function of the lengths.

* :mod:`.balance`: the public functions, their input checks and :class:`BalancedBatch` (the packed tensors).
* :mod:`.kernels`: their numba kernels (exchanges, microbatches, LPT, the whole chain), each with a pure-Python
  reference; verl's Karmarkar-Karp is :func:`~balanced_loader.planning.kernels.karmarkar_karp.grouped_kk_kernel`.

Not a policy: it plans no :class:`~balanced_loader.plan.StepPlan` and is not in the registry. The public names
are ``balanced_loader.balance`` and ``balanced_loader.balance_batch``.
"""

from __future__ import annotations

from balanced_loader.planning.rl.balance import BalancedBatch, balance, balance_batch, rollout_work

__all__ = ["BalancedBatch", "balance", "balance_batch", "rollout_work"]
