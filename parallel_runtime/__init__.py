"""parallel_runtime: execute a balanced_loader plan with tensor, context and pipeline parallelism.

One concern per module (docs/runtime.md, "Code layout"):

* ``topology`` (the rank grid of a step's pools, pure), ``groups`` (process groups created
  once, looked up by rank tuple), ``launch`` (starting a world), ``model`` (the decoder);
* ``engines/``: ``tensor``, ``attention``, ``context`` (ring, Ulysses, nested CP), ``pipeline`` (1F1B);
* ``training/``: ``plan_check`` (can this plan run here), ``params``, ``runtime``, ``step``
  (forward/backward of one step), ``optimizer`` (fixed shards, pull/push), ``trainer``, ``metrics``;
* ``spindle/``: multi-task wave plans; ``diagnostics/``: ``selfcheck``, ``profile``.

``python -m parallel_runtime --recipe R.yaml`` trains; ``python -m parallel_runtime selfcheck ...``
and ``python -m parallel_runtime profile ...`` run the diagnostics.
"""
