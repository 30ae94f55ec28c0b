"""``model.hf`` of a recipe: which transformers causal LM to train, checked before any process starts.

``model.hf`` is either a config mapping (``{model_type: llama, hidden_size: 64, ...}``: a random-init
model built from it, never downloaded) or a local pretrained folder (``{pretrained: path}``; a plain
string in the recipe is read as that). Only the model types whose forward is exactly
``embed -> decoder -> lm_head`` (no logit scaling or soft-capping hidden in ``ForCausalLM.forward``)
are accepted, since the runtime runs those three pieces itself (:mod:`parallel_runtime.hf.model`).

transformers is an optional dependency (the ``hf`` extra): it is imported inside the functions.
"""

from __future__ import annotations

import json
import os
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # embed -> decoder -> lm_head, nothing else in the head
PRETRAINED = "pretrained"


def normalize(raw: Any) -> Any:
    """A recipe's ``model.hf`` as a mapping: a folder string becomes ``{pretrained: folder}``."""
    return {PRETRAINED: raw} if isinstance(raw, str) else raw


def _transformers():
    try:
        import transformers  # heavy optional dependency: only recipes with model.hf need it
    except ImportError:
        raise ValueError("model.hf needs transformers: pip install 'balanced-loader[hf]'") from None
    return transformers


_CONFIGS: dict[str, Any] = {}  # spec (as JSON) -> its config: plans are checked against it every step


def hf_config(spec: dict):
    """The transformers ``PretrainedConfig`` of ``spec`` (ValueError naming the key on a bad one); cached.
    A pretrained folder is read as given (the recipe resolves it against its own folder first)."""
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _CONFIGS:
        _CONFIGS[key] = _build_config(spec)
    return _CONFIGS[key]


def _build_config(spec: dict):
    tf = _transformers()
    if PRETRAINED in spec:
        if set(spec) != {PRETRAINED}:
            raise ValueError(f"model.hf: a pretrained folder takes no other keys, got {sorted(spec)}")
        path = str(spec[PRETRAINED])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model.hf.pretrained: {path} is not a local model folder (no config.json); "
                             f"models are never downloaded")
        cfg = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        kind = spec.get("model_type")
        if kind not in SUPPORTED:
            raise ValueError(f"model.hf.model_type must be one of {', '.join(SUPPORTED)}, got {kind!r}")
        rest = {k: v for k, v in spec.items() if k != "model_type"}
        known = set(tf.AutoConfig.for_model(kind).to_dict())
        unknown = sorted(set(rest) - known)
        if unknown:  # transformers keeps unknown keys as attributes: a typo would pass silently
            raise ValueError(f"model.hf: unknown key '{unknown[0]}' for model_type {kind}")
        try:
            cfg = tf.AutoConfig.for_model(kind, **rest)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model.hf: {str(e).splitlines()[0]}") from None
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model.hf: model_type {cfg.model_type!r} is not supported; use one of {', '.join(SUPPORTED)}")
    return cfg


def kv_heads(cfg) -> int:
    """KV heads of every attention layer (the most a Ulysses degree may split)."""
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def check_hf_config(cfg, *, max_seq_len: int) -> None:
    """ValueError when the CP engines cannot run this model exactly (one line naming the key)."""
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError("model.hf.attention_dropout must be 0: the CP engines have no attention dropout")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None) is not None:
            raise ValueError(f"model.hf.{key} is not supported by the CP engines; set it to null")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    sliding = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if sliding and window < max_seq_len:
        raise ValueError(f"model.hf.sliding_window ({window}) is smaller than data.max_seq_len ({max_seq_len}); "
                         f"the CP engines attend to the whole doc: raise it or set it to null")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim % 2:
        raise ValueError(f"model.hf: head_dim ({head_dim}) must be even for rotary embeddings")


def check_hf_recompute(cfg, model_class: type | None = None) -> None:
    """ValueError when ``train.recompute`` asks activation checkpointing of a model class without it
    (``model_class``: the built model's class; default: the causal LM class transformers builds for ``cfg``)."""
    if model_class is None:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING  # heavy optional dependency (the hf extra)

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if model_class is None or not getattr(model_class, "supports_gradient_checkpointing", False):
        name = model_class.__name__ if model_class is not None else f"model_type {cfg.model_type!r}"
        raise ValueError(f"train.recompute: transformers' {name} has no activation checkpointing; "
                         f"set train.recompute: false")


def check_hf_shape(tp: int, pp: int, *, where: str) -> None:
    """An HF model runs on data- and context-parallel lanes only (tp = pp = 1); its Ulysses sizes are
    checked with the native model's (:func:`parallel_runtime.config.check_shape`)."""
    if tp > 1 or pp > 1:
        raise ValueError(f"{where}: model.hf runs on tp=1, pp=1 lanes only (TP and PP are for the native model); "
                         f"use a policy or pools of shape 1x1")
