"""parallel_runtime: execute a balanced_loader plan with tensor, context and pipeline parallelism.

Runtime I (this package's base): ``topology`` (pure rank maths from a plan's pools),
``groups`` (process groups created once per run, world setup), ``model`` (LLaMA-style decoder
on packed batches), ``tensor_parallel``, ``attention`` (local varlen kernels),
``context_parallel`` (ring, Ulysses and nested CP engines) and ``selfcheck``.
"""
