"""The runtime's engines in users' own training loops (not the runtime's trainer).

* :mod:`.hf_context_parallel`: :func:`enable_context_parallel`, dynamic context parallelism for a
  transformers model in an accelerate / DDP / torchrun loop over the loader's plans.

Imported lazily: ``parallel_runtime.integrations`` itself pulls in neither transformers nor torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ContextParallelBinding", "enable_context_parallel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("parallel_runtime.integrations.hf_context_parallel"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
