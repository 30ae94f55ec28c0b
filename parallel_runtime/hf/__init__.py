"""Hugging Face transformers models on the runtime's engines.

* :mod:`.model`, :mod:`.config`: a transformers causal LM as the runtime's model (``model.hf`` in a recipe).
* :mod:`.attention`: the ``"bl_cp"`` attention transformers calls, running the microbatch's CP engine.
* :mod:`.lean`: fewer saved activations for transformers' Llama-style blocks.

Dynamic CP for a model in the user's own loop is :mod:`parallel_runtime.integrations.hf_context_parallel`.
"""
