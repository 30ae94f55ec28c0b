"""What a rank keeps across steps: its process groups and one stage model per pool shape.

A step's plan may put this rank in a pool of any ``(tp, pp)`` shape, at any stage and tp
index. :meth:`Runtime.stage_model` builds the model part for that place once (layers of the
stage, TP slices over the lane's TP group) and reuses it whenever the shape comes back; its
parameters are refilled from the optimizer shards by every step's pull, so a cached model
never carries stale weights.

Gradients live in one flat fp32 buffer per rank (:class:`GradBuffer`), shared by every stage model
(one is active per step): the parameters' ``.grad`` (``main_grad`` for half-precision ones) are views
into it, so backward accumulates in place, in fp32. Why: per-parameter gradients allocated by autograd
inside backward land between the activations on the C heap, whose freed pages then stay resident (on
CPU the step's peak grew by ~2x the gradients); one allocation made once never moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallel_runtime.engines.pipeline import stage_layers
from parallel_runtime.engines.tensor import TensorParallel
from parallel_runtime.groups import GroupCache
from parallel_runtime.model import ModelConfig, Transformer
from parallel_runtime.topology import Topology
from parallel_runtime.training.optimizer import FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.params import local_params

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class StageModel:
    """This rank's part of the model for one pool shape, and its parameters in full coordinates."""

    model: Transformer
    params: tuple[LocalParam, ...]
    flat: torch.Tensor | None = None  # [padded] fp32: the parameters' buffer where they are in layout order


class GradBuffer:
    """One flat fp32 gradient buffer per rank, grown to the largest stage model seen.

    fp32 parameters take their ``.grad`` as views of it (backward accumulates in place). Half-precision
    parameters get fp32 views as ``main_grad`` instead (Megatron's name), and the hook that
    :func:`accumulate_in_fp32` installs adds each backward's half gradient into it and drops it: the
    gradients of several microbatches sum in fp32, not in bf16 (where every addition rounds to 8 bits)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: torch.Tensor | None = None  # [capacity] fp32

    def attach(self, params: Sequence[LocalParam], layout: FlatLayout | None = None) -> torch.Tensor | None:
        """Point every parameter's gradient (``.grad``, or ``main_grad`` for half ones) at a zeroed view of the
        buffer. With ``layout``, where ``params`` are the layout's own (:func:`in_layout_order`), the buffer is
        laid out as the layout, padding included, and returned (``[padded]``): its windows can hold the
        optimizer's gradient shards
        (:meth:`~parallel_runtime.training.optimizer.ShardedOptimizer.share_grad`); else ``None``."""
        need = sum(lp.tensor.numel() for lp in params)
        shared = layout is not None and in_layout_order(params, layout)
        if shared:
            need = layout.padded  # the padding stays zero: backward never writes it
        flat = self._flat
        if flat is None or flat.numel() < need:
            self._flat = None  # free the old buffer before the larger one is made
            flat = self._flat = torch.zeros(need, dtype=torch.float32, device=self.device)
        else:
            flat[:need].zero_()
        o = 0
        for lp in params:
            t = lp.tensor
            view = flat[o:o + t.numel()].view(t.shape)
            if t.dtype == torch.float32:
                t.grad = view
            else:
                t.grad = None
                t.main_grad = view
            o += t.numel()
        return flat[:layout.padded] if shared else None

    @staticmethod
    def detach(params: Sequence[LocalParam]) -> None:
        """Drop the views (the buffer stays for the next step)."""
        for lp in params:
            lp.tensor.grad = None
            if getattr(lp.tensor, "main_grad", None) is not None:
                lp.tensor.main_grad = None


def accumulate_in_fp32(params: Sequence[LocalParam]) -> None:
    """Install on every half-precision parameter the hook that adds its gradient into its fp32 ``main_grad``
    (when the buffer is attached) and frees it. Call once per model, before any other gradient hook (hooks
    run in the order they were registered: the overlap's push reads ``main_grad`` after this one)."""
    for lp in params:
        t = lp.tensor
        if t.dtype != torch.float32 and not getattr(t, "_fp32_hook", False):
            t.register_post_accumulate_grad_hook(_add_to_main_grad)
            t._fp32_hook = True


def _add_to_main_grad(p: torch.Tensor) -> None:
    main = getattr(p, "main_grad", None)
    if main is not None and p.grad is not None:
        main.add_(p.grad)
        p.grad = None


def in_layout_order(params: Sequence[LocalParam], layout: FlatLayout) -> bool:
    """Whether ``params`` are every full parameter of ``layout``, in its order, whole and fp32: then one
    flat buffer of them in this order has each parameter at its layout offset."""
    return len(params) == len(layout.specs) and all(
        lp.spec.name == s.name and lp.tp_size == 1 and lp.tensor.dtype == torch.float32
        and lp.tensor.numel() == s.numel for lp, s in zip(params, layout.specs))


def flatten_params(params: Sequence[LocalParam], layout: FlatLayout | None = None) -> torch.Tensor | None:
    """Move the parameters' values into one flat buffer per dtype, the parameters becoming views of it.
    Why: built one tensor at a time, parameters of a few MB land in the C heap between other
    allocations, where the holes they leave and keep apart make a step touch more pages. Where
    ``params`` are ``layout``'s own (:func:`in_layout_order`) the buffer is laid out as the layout,
    padding included, and returned (``[padded]``: its windows can hold the master shards); else ``None``."""
    if not params:
        return None
    device = params[0].tensor.device
    need = _numel_by_dtype(params)
    shared = layout is not None and in_layout_order(params, layout)
    if shared:
        need[torch.float32] = layout.padded
    flats = {dt: torch.zeros(n, dtype=dt, device=device) if shared else torch.empty(n, dtype=dt, device=device)
             for dt, n in need.items()}
    offsets = dict.fromkeys(flats, 0)
    for lp in params:
        t = lp.tensor
        o = offsets[t.dtype]
        view = flats[t.dtype][o:o + t.numel()].view_as(t)
        view.copy_(t.detach())
        t.data = view  # the module keeps its Parameter object (hooks, optimizer rows); its storage moves
        offsets[t.dtype] = o + t.numel()
    return flats[torch.float32] if shared else None


def _numel_by_dtype(params: Sequence[LocalParam]) -> dict[torch.dtype, int]:
    need: dict[torch.dtype, int] = {}
    for lp in params:
        need[lp.tensor.dtype] = need.get(lp.tensor.dtype, 0) + lp.tensor.numel()
    return need


class Runtime:
    """What a rank keeps across steps: groups, stage models by shape, the model config."""

    def __init__(self, cfg: ModelConfig, *, rank: int, device: torch.device, dtype: torch.dtype,
                 attention: str, groups: GroupCache | None, specs: Sequence[ParamSpec],
                 layout: FlatLayout | None = None) -> None:
        """``layout``: the optimizer's; a stage model whose parameters are its own is laid out as it
        (:attr:`StageModel.flat`)."""
        self.cfg, self.rank, self.device, self.dtype = cfg, rank, device, dtype
        self.layout = layout
        self.attention = attention
        self.groups = groups
        self.specs = {s.name: s for s in specs}
        self._models: dict[tuple, StageModel] = {}
        self.grads = GradBuffer(device)

    def stage_model(self, topo: Topology) -> StageModel:
        """The model of this rank's (pool shape, stage, tp index, TP group), built once and reused."""
        c = topo.coord(self.rank)
        pool = topo.pools[c.pool]
        tp_ranks = topo.tp_ranks(self.rank)
        key = (pool.tp, pool.pp, c.stage, c.tp_index, tp_ranks)
        sm = self._models.get(key)
        if sm is None:
            tp = TensorParallel(size=pool.tp, index=c.tp_index,
                                group=self.groups.get(tp_ranks) if pool.tp > 1 else None)
            model = Transformer(self.cfg, tp=tp, layers=stage_layers(self.cfg.num_layers, pool.pp, c.stage),
                                first_stage=c.stage == 0, last_stage=c.stage == pool.pp - 1, device=self.device,
                                dtype=self.dtype, seed=None)
            sm = self._stage(model, local_params(model, self.specs, tp_index=c.tp_index, tp_size=pool.tp))
            self._models[key] = sm
        return sm

    def prepare_step(self, topo: Topology, optimizer: ShardedOptimizer, *, push: bool = True,
                     share_grad: bool = True) -> StageModel:
        """The stage model of this rank's place in ``topo``, ready for a step against ``optimizer``'s shards: a
        whole fp32 model (:attr:`StageModel.flat`) holds the master shard from now on
        (:meth:`~ShardedOptimizer.share_master`); the gradients are attached, zeroed, in fp32 (:attr:`grads`);
        with ``push`` the optimizer's gradient shard lives inside them where they are laid out as its layout and
        ``share_grad`` allows it, else in a buffer of its own (:meth:`~ShardedOptimizer.share_grad`). Without
        ``push`` (another policy's pass: no push follows) the gradient shard stays where it is."""
        sm = self.stage_model(topo)
        if sm.flat is not None:  # a whole fp32 model: its own shard of parameters is the master from now on
            optimizer.share_master(sm.flat)
        full = self.grads.attach(sm.params, optimizer.layout if push and share_grad else None)
        if push:
            optimizer.share_grad(full)
        return sm

    def _stage(self, model, params: tuple[LocalParam, ...]) -> StageModel:
        """A new stage model, its parameters moved into one buffer (:func:`flatten_params`), half-precision
        gradients summed in fp32 (:func:`accumulate_in_fp32`)."""
        accumulate_in_fp32(params)
        return StageModel(model=model, params=params, flat=flatten_params(params, self.layout))
