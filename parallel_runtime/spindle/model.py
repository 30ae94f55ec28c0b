"""A small multi-task model for executing Spindle wave plans on CPU, and its single-process reference.

Every MetaOp of the graph is a chain of identical residual MLP blocks
(``x + W2 gelu(W1 layer_norm(x) + b1) + b2``) of width ``hidden`` over samples of ``tokens``
tokens each. MetaOps with the same ``module`` share parameters: layer ``i`` of each of them is
the module's block ``i`` (so a shared backbone is one set of blocks that every task runs).
A MetaOp without predecessors reads a synthetic input; one with predecessors reads the sum of
their outputs (same batch: sample ``j`` of the successor is sample ``j`` of each predecessor).
Every sink MetaOp (no successor) ends in its own head: mean over tokens, a linear layer to
``classes`` logits, and cross-entropy against synthetic labels; its loss is the mean over its
batch, and the step's loss is the sum over sinks.

Synthetic data, fp32: the inputs of a root MetaOp and the labels of a sink are drawn from a
generator seeded by ``(seed, step, name)``, and every parameter from one seeded by
``(seed, name)``, so any process builds the same tensors in any order (parameters are
replicated on every rank; a rank reads only the ones its wave entries run).
Parameter names: ``{module}.{layer}.{ln_w|ln_b|w1|b1|w2|b2}`` and ``head:{sink}.{w|b}``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from balanced_loader.spindle.graph import Graph

BLOCK_PARAMS = ("ln_w", "ln_b", "w1", "b1", "w2", "b2")
HEAD_PARAMS = ("w", "b")


@dataclass(frozen=True, kw_only=True, slots=True)
class MetaOpModelConfig:
    """The MetaOp graph's toy model (one block per MetaOp; not the runtime's transformer, parallel_runtime.model)."""

    hidden: int = 32  # width of every block
    ffn: int = 64  # inner width of the MLP
    tokens: int = 8  # tokens per sample
    classes: int = 4  # logits of each head
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("hidden", "ffn", "tokens", "classes"):
            if getattr(self, k) < 1:
                raise ValueError(f"model config: '{k}' must be >= 1, got {getattr(self, k)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpSpec:
    """What the model needs of a MetaOp (so worker processes need not import the planner)."""

    name: str
    layers: int
    batch: int
    module: str
    after: tuple[str, ...]


def op_specs(graph: Graph) -> tuple[OpSpec, ...]:
    """The graph's MetaOps as :class:`OpSpec` (graph order), after :func:`check_graph`."""
    check_graph(graph)
    return tuple(OpSpec(name=op.name, layers=op.layers, batch=op.batch, module=op.module, after=op.after)
                 for op in graph.metaops)


def _generator(seed: int, *parts: object) -> torch.Generator:
    key = zlib.crc32("/".join(str(p) for p in parts).encode())
    return torch.Generator().manual_seed(seed * 1_000_003 + key)


def sinks(ops: Sequence[OpSpec]) -> tuple[str, ...]:
    """MetaOps no other MetaOp depends on (graph order): each ends in a head and a loss."""
    used = {a for op in ops for a in op.after}
    return tuple(op.name for op in ops if op.name not in used)


def dependency_order(ops: Sequence[OpSpec]) -> list[OpSpec]:
    """The MetaOps, each after all of its ``after`` list (graph order among the ready ones)."""
    done: set[str] = set()
    out: list[OpSpec] = []
    while len(out) < len(ops):
        ready = [op for op in ops if op.name not in done and all(a in done for a in op.after)]
        assert ready, "the graph loader rejects cycles"
        out += ready
        done.update(op.name for op in ready)
    return out


def block_names(module: str, layer: int) -> tuple[str, ...]:
    """Parameter names of block ``layer`` of ``module``."""
    return tuple(f"{module}.{layer}.{k}" for k in BLOCK_PARAMS)


def head_names(sink: str) -> tuple[str, ...]:
    """Parameter names of the head of sink MetaOp ``sink``."""
    return tuple(f"head:{sink}.{k}" for k in HEAD_PARAMS)


def check_graph(graph: Graph) -> None:
    """Raise ValueError unless every MetaOp's predecessors have its batch (samples correspond one to one)."""
    ops = {op.name: op for op in graph.metaops}
    for op in graph.metaops:
        for a in op.after:
            if ops[a].batch != op.batch:
                raise ValueError(f"MetaOp '{op.name}' (batch {op.batch}) runs after '{a}' (batch {ops[a].batch}); "
                                 f"the executor needs equal batches along every edge of the graph")


def module_layers(ops: Sequence[OpSpec]) -> dict[str, int]:
    """Blocks of each module: the most layers any MetaOp using it has (graph order)."""
    out: dict[str, int] = {}
    for op in ops:
        out[op.module] = max(out.get(op.module, 0), op.layers)
    return out


class MultiTaskModel:
    """The parameters of every module and head, and the functions that run them."""

    def __init__(self, ops: Sequence[OpSpec] | Graph, config: MetaOpModelConfig) -> None:
        specs = op_specs(ops) if hasattr(ops, "metaops") else tuple(ops)
        self.specs = specs
        self.config = config
        self.ops: dict[str, OpSpec] = {op.name: op for op in specs}
        self.sinks = sinks(specs)
        self.params: dict[str, torch.Tensor] = {}
        h, f = config.hidden, config.ffn
        for module, layers in module_layers(specs).items():
            for i in range(layers):
                shapes = ((h,), (h,), (f, h), (f,), (h, f), (h,))  # BLOCK_PARAMS
                for name, shape in zip(block_names(module, i), shapes):
                    self.params[name] = self._init(name, shape, layers)
        for s in self.sinks:
            for name, shape in zip(head_names(s), ((config.classes, h), (config.classes,))):
                self.params[name] = self._init(name, shape, 1)

    def _init(self, name: str, shape: tuple[int, ...], layers: int) -> torch.Tensor:
        g = _generator(self.config.seed, "param", name)
        kind = name.rsplit(".", 1)[1]
        if kind == "ln_w":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif kind in ("ln_b", "b1", "b2", "b"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:  # w1, w2, w: fan-in scaled; w2 also by depth so the residual stream stays O(1)
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            if kind == "w2":
                t = t / math.sqrt(2 * layers)
        return t.requires_grad_()

    # ---- data ------------------------------------------------------------------------
    def op_input(self, op: str, step: int) -> torch.Tensor:
        """[batch, tokens, hidden] synthetic input of a MetaOp without predecessors."""
        c = self.config
        g = _generator(c.seed, "input", step, op)
        return torch.randn((self.ops[op].batch, c.tokens, c.hidden), generator=g)

    def labels(self, sink: str, step: int) -> torch.Tensor:
        """[batch] synthetic class labels of a sink MetaOp."""
        g = _generator(self.config.seed, "labels", step, sink)
        return torch.randint(0, self.config.classes, (self.ops[sink].batch,), generator=g)

    # ---- compute ---------------------------------------------------------------------
    def run_layers(self, op: str, x: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Layers ``[first, first + count)`` of MetaOp ``op`` on ``x`` [samples, tokens, hidden]."""
        module = self.ops[op].module
        h = self.config.hidden
        for i in range(first, first + count):
            p = [self.params[n] for n in block_names(module, i)]
            y = F.layer_norm(x, (h,), p[0], p[1])
            x = x + F.linear(F.gelu(F.linear(y, p[2], p[3])), p[4], p[5])
        return x

    def loss_sum(self, sink: str, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the head of ``sink`` over the samples of ``x`` [samples, tokens, hidden]."""
        w, b = (self.params[n] for n in head_names(sink))
        return F.cross_entropy(F.linear(x.mean(dim=1), w, b), labels, reduction="sum")

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def sgd(self, lr: float) -> None:
        """``p -= lr * grad`` for every parameter that has a gradient."""
        for p in self.params.values():
            if p.grad is not None:
                p -= lr * p.grad


def reference_step(model: MultiTaskModel, step: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One process, every MetaOp whole, in graph dependency order, on the full batch.

    Returns the loss of each sink (mean over its batch) and every parameter's gradient; the
    parameters' ``.grad`` are left set (for :meth:`MultiTaskModel.sgd`).
    """
    model.zero_grad()
    out: dict[str, torch.Tensor] = {}
    for op in dependency_order(model.specs):
        x = model.op_input(op.name, step) if not op.after else sum(out[a] for a in op.after)
        out[op.name] = model.run_layers(op.name, x, 0, op.layers)
    losses = {s: model.loss_sum(s, out[s], model.labels(s, step)) / model.ops[s].batch for s in model.sinks}
    torch.stack(list(losses.values())).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.params.items() if p.grad is not None}
    return {s: float(v.detach()) for s, v in losses.items()}, grads


def max_rel_diff(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """Largest ``max|got - want| / max|want|`` over the names of ``got`` (each must be in ``want``)."""
    worst = 0.0
    for name, g in got.items():
        w = want[name]
        scale = float(w.abs().max()) if w.numel() else 0.0
        diff = float((g - w).abs().max()) if w.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
