"""A transformers causal LM as the runtime's model: built from ``model.hf``, trained on DP and dynamic CP.

* :class:`HFModel` builds the model on the meta device (shapes, no memory), lists its parameters as
  :class:`~parallel_runtime.training.optimizer.ParamSpec`\\ s (names as in the model's
  ``named_parameters``, every one replicated: ``tp_dim`` None; no weight decay on 1-D tensors: norms
  and biases) and yields their initial values one piece of the model at a time for the fixed optimizer
  shards (a config: random init per piece from (recipe seed, piece name), the same on every rank; a
  pretrained folder: its safetensors read tensor by tensor). The working model is materialized from
  the meta one on the run's device and dtype, uninitialized: the step's pull fills it.
* :class:`HFCausalLM` is the stage-model adapter :class:`~parallel_runtime.engines.pipeline.PipelineStage`
  and the reference run call, with the native model's pieces: ``embed_tokens`` -> ``run_layers``
  -> ``head_loss`` (and ``forward`` for the whole pass), its MLPs and norms keeping fewer activations
  for backward (:mod:`parallel_runtime.hf.lean`). ``run_layers`` runs the HF decoder on one
  packed sequence with the microbatch's ``position_ids`` (each lane's true positions in the CP
  layout, so RoPE sees them) and passes the microbatch's bound attention to every layer through
  the registered ``bl_cp`` attention (:mod:`parallel_runtime.hf.attention`). ``head_loss`` makes the
  logits a chunk of tokens at a time (:func:`parallel_runtime.model.chunked_loss_sum`: no ``[T, vocab]``
  fp32 copy). Setting its ``recompute`` (the trainer does, from ``train.recompute``) turns on
  transformers' activation checkpointing of every decoder layer, non-reentrant: a layer keeps its
  input only and runs again in backward, its attention's CP collectives included (every rank of a
  CP group replays its layers in the same reverse order, so the collectives pair up as in the forward).
* :class:`HFRuntime` is the :class:`~parallel_runtime.training.runtime.Runtime` of an HF model:
  one whole model per rank (pools must be tp=1, pp=1; the recipe check says so first).
"""

from __future__ import annotations

import copy
import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from balanced_loader.outputs.files import read_json
from parallel_runtime.engines.tensor import IGNORE_INDEX
from parallel_runtime.hf.attention import BOUND_KWARG, NAME, register
from parallel_runtime.hf.config import PRETRAINED, check_hf_recompute, hf_config
from parallel_runtime.hf.lean import install as install_lean
from parallel_runtime.model import chunked_loss_sum
from parallel_runtime.topology import Topology
from parallel_runtime.training.optimizer import LocalParam, ParamSpec
from parallel_runtime.training.runtime import Runtime, StageModel


@dataclass(frozen=True, kw_only=True, slots=True)
class StageShape:
    """What :class:`~parallel_runtime.engines.pipeline.PipelineStage` reads of a model's config."""

    hidden: int


class HFCausalLM(nn.Module):
    """A transformers causal LM with the native model's forward pieces (one whole model: first and last stage)."""

    first_stage = True
    last_stage = True

    def __init__(self, hf: nn.Module, *, lean: bool = True) -> None:
        """``lean``: the MLPs and norms keep fewer activations for backward (:mod:`parallel_runtime.hf.lean`;
        the same gradients bit for bit), except under ``recompute``."""
        super().__init__()
        self.hf = hf
        self.config = StageShape(hidden=int(hf.config.hidden_size))
        self._recompute = False
        self.lean_modules = install_lean(hf, lambda: not self._recompute) if lean else 0

    @property
    def recompute(self) -> bool:
        """Activation checkpointing per decoder layer (``train.recompute``); the math is unchanged."""
        return self._recompute

    @recompute.setter
    def recompute(self, on: bool) -> None:
        on = bool(on)
        if on == self._recompute:  # the trainer sets it every step
            return
        if on:
            check_hf_recompute(self.hf.config, type(self.hf))
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            # transformers also hooks the embedding to make its output require grad (for frozen embeddings
            # under reentrant checkpoints); the runtime trains the embedding and checkpoints non-reentrantly
            self.hf.disable_input_require_grads()
        else:
            self.hf.activation_checkpointing_disable()
        self._recompute = on

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]``."""
        return self.hf.get_input_embeddings()(input_ids)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor, attn) -> torch.Tensor:
        """The decoder (its layers and final norm) on ``h [T, hidden]`` at ``position_ids [T]``."""
        out = self.hf.base_model(inputs_embeds=h[None], position_ids=position_ids[None], use_cache=False,
                                 **{BOUND_KWARG: attn})
        return out.last_hidden_state[0]

    def head_loss(self, h: torch.Tensor, labels: torch.Tensor, num_valid_tokens: int) -> torch.Tensor:
        """Sum of token losses (labels -100 skipped) divided by the step's global number of valid tokens;
        the logits are made (and reduced in fp32) a chunk of tokens at a time (:func:`chunked_loss_sum`)."""
        if num_valid_tokens < 1:
            raise ValueError(f"num_valid_tokens must be >= 1, got {num_valid_tokens}")
        vocab = int(self.hf.get_output_embeddings().weight.shape[0])
        return chunked_loss_sum(self._token_loss_sum, h, labels, vocab) / num_valid_tokens

    def _token_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(h)  # [T, vocab]
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *, attn,
                num_valid_tokens: int) -> torch.Tensor:
        """Loss of a whole-model pass (the reference run's call)."""
        return self.head_loss(self.run_layers(self.embed_tokens(input_ids), position_ids, attn), labels,
                              num_valid_tokens)

    def local_params(self, specs: Mapping[str, ParamSpec]) -> tuple[LocalParam, ...]:
        """Every parameter as its full (replicated) parameter of the optimizer shards."""
        return tuple(LocalParam(spec=specs[n], tensor=p) for n, p in self.hf.named_parameters())


class HFModel:
    """The recipe's HF model: its parameter specs, initial values and working copies.

    The model itself is built on the meta device (shapes only: no parameter memory at all). Its
    initial values come one piece at a time (:meth:`init_params`: the embedding, each decoder layer,
    the final norm, the head), so a process never holds a whole fp32 copy besides its working model
    and its optimizer shard: at 7B the old whole-model build took 28 GB of host memory per rank.
    """

    def __init__(self, spec: dict, *, seed: int) -> None:
        from transformers import AutoModelForCausalLM  # heavy optional dependency (the hf extra)

        register()
        self.spec = spec
        self.seed = seed
        cfg = copy.deepcopy(hf_config(spec))  # the cached config stays untouched
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the caller's RNG untouched
            self._meta = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME, dtype=torch.float32)
        self._meta.train()
        self.specs = [ParamSpec(name=n, shape=tuple(p.shape), tp_dim=None, decay=p.dim() >= 2)
                      for n, p in self._meta.named_parameters()]

    def init_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full fp32 tensor)`` of every parameter, one piece of the model at a time: a pretrained
        folder's tensors read one by one (:func:`read_pretrained`); a config's random init piece by piece,
        each a function of (seed, piece name) through the model's own ``_init_weights``, the same on
        every rank and in any order."""
        if PRETRAINED in self.spec:
            yield from read_pretrained(self.spec[PRETRAINED], self._meta, [s.name for s in self.specs])
            return
        for piece, names in model_pieces(self._meta, [s.name for s in self.specs]):
            module = copy.deepcopy(self._meta.get_submodule(piece))  # piece "": parameters of the model's root
            materialize(module, torch.device("cpu"), torch.float32)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed((zlib.crc32(piece.encode()) + 1_000_003 * self.seed) % 2**63)
                for sub in module.modules():
                    self._meta._init_weights(sub)
            params = dict(module.named_parameters(prefix=piece))
            for n in names:
                yield n, params[n].detach()
            del module, params

    def build(self, device: torch.device, dtype: torch.dtype, *, values: bool = True, lean: bool = True) -> HFCausalLM:
        """A working model on ``device`` in ``dtype``, its buffers (RoPE tables) computed; with ``values``
        its parameters hold :meth:`init_params`, else they are uninitialized (the runtime pulls them from
        the optimizer shards before any use, so it never makes the initial values twice); ``lean``: see
        :class:`HFCausalLM`."""
        model = copy.deepcopy(self._meta)
        materialize(model, device, dtype)
        with torch.no_grad():
            for sub in model.modules():
                if next(sub.buffers(recurse=False), None) is not None:
                    model._init_weights(sub)  # buffers are not parameters: computed here (rotary inv_freq)
            if values:
                params = dict(model.named_parameters())
                for n, t in self.init_params():
                    params[n].copy_(t)
        return HFCausalLM(model.train(), lean=lean)


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter (floating ones in ``dtype``) and buffer (in its own dtype: RoPE's ``inv_freq``
    stays fp32 in a bf16 model, as transformers keeps it) of a meta ``module`` uninitialized storage on
    ``device``, in place. A parameter shared by two modules (tied embeddings) stays one parameter:
    ``Module.to_empty`` would make two."""
    made: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for key, p in mod._parameters.items():
            if p is not None:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[key] = made[id(p)]
        for key, b in mod._buffers.items():
            if b is not None:
                mod._buffers[key] = made.setdefault(id(b), torch.empty(b.shape, dtype=b.dtype, device=device))


def model_pieces(model: nn.Module, names: list[str]) -> list[tuple[str, list[str]]]:
    """``[(piece, its parameter names)]`` in ``names``' order: a piece is an element of a module list (a
    decoder layer) or else the module owning the parameter (the embedding, the final norm, the head)."""
    elements = {f"{n}.{i}" for n, m in model.named_modules() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    pieces: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        owner = ".".join(parts[:-1])
        piece = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in elements), owner)
        pieces.setdefault(piece, []).append(name)
    return list(pieces.items())


def read_pretrained(folder: str, meta: nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 tensor)`` of every parameter of a local pretrained folder, read one tensor at a time from
    its safetensors files (``model.safetensors`` or the shards its index names). A folder whose files do not
    hold every parameter under the model's own names (``.bin`` weights, renamed keys) is loaded whole by
    transformers once, as before (its whole model in fp32 in host memory while it is read)."""
    files = _safetensors_files(folder)
    if files is not None and all(n in files for n in names):
        from safetensors import safe_open  # transformers' own dependency

        handles: dict[str, Any] = {}
        try:
            for n in names:
                f = files[n]
                if f not in handles:
                    handles[f] = safe_open(os.path.join(folder, f), framework="pt", device="cpu")
                yield n, handles[f].get_tensor(n).to(torch.float32)
        finally:
            handles.clear()
        return
    from transformers import AutoModelForCausalLM  # heavy optional dependency (the hf extra)

    model = AutoModelForCausalLM.from_pretrained(folder, config=copy.deepcopy(meta.config), local_files_only=True,
                                                 attn_implementation=NAME, dtype=torch.float32)
    params = dict(model.named_parameters())
    for n in names:
        yield n, params[n].detach()


def _safetensors_files(folder: str) -> dict[str, str] | None:
    """``{tensor name: file}`` of a folder's safetensors weights, or None when it has none."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        idx = read_json(index, "safetensors index", fix="the pretrained folder is damaged")
        weights = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"safetensors index {index} has no 'weight_map' mapping; the pretrained folder is damaged")
        return dict(weights)
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open  # transformers' own dependency

        with safe_open(single, framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    return None


class HFRuntime(Runtime):
    """The runtime of an HF model: one whole model per rank, reused for every step (pools of tp=1, pp=1)."""

    def __init__(self, model: HFModel, *, rank: int, device: torch.device, dtype: torch.dtype, attention: str,
                 groups, specs, layout=None) -> None:
        super().__init__(None, rank=rank, device=device, dtype=dtype, attention=attention, groups=groups,
                         specs=specs, layout=layout)
        self.hf_model = model

    def stage_model(self, topo: Topology) -> StageModel:
        pool = topo.pools[topo.coord(self.rank).pool]
        if pool.tp > 1 or pool.pp > 1:
            raise ValueError(f"a pool of tp={pool.tp}, pp={pool.pp}: model.hf runs on tp=1, pp=1 lanes only")
        sm = self._models.get(())
        if sm is None:
            model = self.hf_model.build(self.device, self.dtype, values=False)  # values: the step's pull
            sm = self._stage(model, model.local_params(self.specs))
            self._models[()] = sm
        return sm
