"""A transformers causal LM as the runtime's model: built from ``model.hf``, trained on DP and dynamic CP.

* :class:`HFModel` builds the model once per process (a config mapping: random init from the
  recipe's seed, the same on every rank; a pretrained folder: its weights), lists its
  parameters as :class:`~parallel_runtime.training.optimizer.ParamSpec`\\ s (names as in the
  model's ``named_parameters``, every one replicated: ``tp_dim`` None; no weight decay on 1-D
  tensors: norms and biases) and yields their initial values for the fixed optimizer shards.
* :class:`HFCausalLM` is the stage-model adapter :class:`~parallel_runtime.engines.pipeline.PipelineStage`
  and the reference run call, with the native model's pieces: ``embed_tokens`` -> ``run_layers``
  -> ``head_loss`` (and ``forward`` for the whole pass). ``run_layers`` runs the HF decoder on one
  packed sequence with the microbatch's ``position_ids`` (each lane's true positions in the CP
  layout, so RoPE sees them) and passes the microbatch's bound attention to every layer through
  the registered ``bl_cp`` attention (:mod:`parallel_runtime.hf.attention`). Setting its
  ``recompute`` (the trainer does, from ``train.recompute``) turns on transformers' activation
  checkpointing of every decoder layer, non-reentrant: a layer keeps its input only and runs again
  in backward, its attention's CP collectives included (every rank of a CP group replays its layers
  in the same reverse order, so the collectives pair up as in the forward).
* :class:`HFRuntime` is the :class:`~parallel_runtime.training.runtime.Runtime` of an HF model:
  one whole model per rank (pools must be tp=1, pp=1; the recipe check says so first).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel_runtime.hf.attention import BOUND_KWARG, NAME, register
from parallel_runtime.hf.config import PRETRAINED, check_hf_recompute, hf_config
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

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config = StageShape(hidden=int(hf.config.hidden_size))
        self._recompute = False

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
        """Sum of token losses (labels -100 skipped) divided by the step's global number of valid tokens."""
        if num_valid_tokens < 1:
            raise ValueError(f"num_valid_tokens must be >= 1, got {num_valid_tokens}")
        logits = self.hf.get_output_embeddings()(h)  # [T, vocab]
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / num_valid_tokens

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *, attn,
                num_valid_tokens: int) -> torch.Tensor:
        """Loss of a whole-model pass (the reference run's call)."""
        return self.head_loss(self.run_layers(self.embed_tokens(input_ids), position_ids, attn), labels,
                              num_valid_tokens)

    def local_params(self, specs: Mapping[str, ParamSpec]) -> tuple[LocalParam, ...]:
        """Every parameter as its full (replicated) parameter of the optimizer shards."""
        return tuple(LocalParam(spec=specs[n], tensor=p) for n, p in self.hf.named_parameters())


class HFModel:
    """The recipe's HF model: its parameter specs, initial values and working copies."""

    def __init__(self, spec: dict, *, seed: int) -> None:
        from transformers import AutoModelForCausalLM  # heavy optional dependency (the hf extra)

        register()
        cfg = copy.deepcopy(hf_config(spec))  # the cached config stays untouched
        with torch.random.fork_rng(devices=[]):  # the same random init on every rank, the caller's RNG untouched
            torch.manual_seed(seed)
            if PRETRAINED in spec:
                model = AutoModelForCausalLM.from_pretrained(spec[PRETRAINED], config=cfg, local_files_only=True,
                                                             attn_implementation=NAME, dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME, dtype=torch.float32)
        self._model: nn.Module | None = model.train()
        self.specs = [ParamSpec(name=n, shape=tuple(p.shape), tp_dim=None, decay=p.dim() >= 2)
                      for n, p in model.named_parameters()]

    def init_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full fp32 tensor)`` of every parameter (call before :meth:`build`)."""
        assert self._model is not None, "init_params after build: the initial values were handed over"
        for n, p in self._model.named_parameters():
            yield n, p.detach()

    def build(self, device: torch.device, dtype: torch.dtype) -> HFCausalLM:
        """The working model (its values are pulled from the optimizer shards before use): the initial
        model itself, moved, so a process holds one copy; call once, after :meth:`init_params`."""
        if self._model is None:
            raise ValueError("HFModel.build: one working model per HFModel (the runtime caches it)")
        model, self._model = self._model, None
        return HFCausalLM(model.to(device=device, dtype=dtype))


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
            model = self.hf_model.build(self.device, self.dtype)
            sm = self._stage(model, model.local_params(self.specs))
            self._models[()] = sm
        return sm
