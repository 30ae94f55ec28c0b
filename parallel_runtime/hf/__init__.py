"""Hugging Face transformers models on the runtime's engines.

* :mod:`.model`, :mod:`.config`: a transformers causal LM as the runtime's model (``model.hf`` in a recipe).
* :mod:`.attention`: the ``"bl_cp"`` attention transformers calls, running the microbatch's CP engine.
* :mod:`.context`: :func:`enable_context_parallel`, dynamic CP for a model in the user's own loop.

Imported lazily: ``parallel_runtime.hf`` itself pulls in neither transformers nor torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["enable_context_parallel"]


def __getattr__(name: str) -> Any:
    if name in ("enable_context_parallel", "ContextParallelBinding"):
        return getattr(importlib.import_module("parallel_runtime.hf.context"), name)
    raise AttributeError(f"module 'parallel_runtime.hf' has no attribute '{name}'")
