"""The model's parameters in the optimizer's coordinates.

The full (unsharded) model's parameter names and shapes are the coordinates of the fixed
optimizer shards (:mod:`parallel_runtime.training.optimizer`): :func:`param_specs` lists
them, :func:`init_params` yields their initial values one layer at a time (a function of
(seed, name) on the full shape, so every layout starts from the same model), and
:func:`local_params` says which full parameter, and which TP slice of it, each parameter
of a stage model is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from parallel_runtime.model import ModelConfig, Transformer
from parallel_runtime.training.optimizer import LocalParam, ParamSpec


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the full model (name, full shape, TP split dim); norms get no weight decay."""
    model = Transformer(cfg, device="meta", seed=None)
    return [ParamSpec(name=n, shape=tuple(shape), tp_dim=dim, decay=not n.endswith("norm.weight"))
            for n, (shape, dim) in model.full_shapes().items()]


def init_params(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full fp32 tensor)`` of every parameter, built one piece (ends, then each layer) at a time."""
    ends = Transformer(cfg, layers=[], seed=seed)
    yield from ((n, p.detach()) for n, p in ends.named_parameters())
    del ends
    for i in range(cfg.num_layers):
        block = Transformer(cfg, layers=[i], first_stage=False, last_stage=False, seed=seed)
        yield from ((n, p.detach()) for n, p in block.named_parameters())


def local_params(model: Transformer, specs: Mapping[str, ParamSpec], *, tp_index: int = 0,
                 tp_size: int = 1) -> tuple[LocalParam, ...]:
    """Every parameter of ``model`` (a stage, or the whole model) as a slice of a full parameter."""
    return tuple(LocalParam(spec=specs[n], tensor=p, tp_index=tp_index, tp_size=tp_size)
                 for n, p in model.named_parameters())
