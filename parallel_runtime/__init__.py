"""parallel_runtime: execute a balanced_loader plan with tensor, context and pipeline parallelism.

Runtime I: ``topology`` (pure rank maths from a plan's pools), ``groups`` (process groups
created once per run, world setup), ``model`` (LLaMA-style decoder on packed batches),
``tensor_parallel``, ``attention`` (local varlen kernels), ``context_parallel`` (ring, Ulysses
and nested CP engines) and ``selfcheck``.

Runtime II: ``config`` (strict YAML recipes), ``optim`` (fixed fp32 optimizer shards with
pull/push), ``pipeline`` (1F1B over uneven microbatches), ``step`` (one step of a plan),
``trainer`` and ``metrics``, ``profile`` (cost-model calibration); ``python -m parallel_runtime``.

Multi-task: ``multitask_model`` and ``waves`` (execution of a Spindle wave plan).
"""
