"""Cluster, model and cost presets in one place, usable by every command (``--cost PRESET``).

Three kinds:

* ``COST_PRESETS``: published coefficient sets (FlexSP GPT-7B/13B/30B on A100-40GB with its
  all-to-all bandwidth table; Hydraulis LLaMA2-7B on A800 per (tp, pp)), as contract-2 cost models.
* ``MODELS`` and ``HARDWARE``: shapes and device facts for :func:`analytic_cost`, which derives
  every contract-2 field (memory cap included) from first principles.
* ``analytic:<model>@<hardware>`` names build an analytic cost on the fly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from balanced_loader.cost import CostModel, ShapeCost

# ---------------------------------------------------------------------------------------------
# Published coefficient sets
# ---------------------------------------------------------------------------------------------

# FlexSP (papers/flexsp.md §3): whole-model fwd+bwd per GPU, ms; all-to-all per-device GB/s.
_FLEXSP_BW = {2: 119.5, 4: 104.1, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
# All-to-all bytes per token: Q, K, V, O x (fwd + bwd) x layers x hidden x 2 bytes = 16 * L * h.
_FLEXSP = {
    # name: (alpha1 q, alpha2 l, beta1 microbatch, layers, hidden, act MB/token, params at 384K)
    "flexsp-gpt7b-a100": (5.128e-6, 0.184, 629.0, 32, 4096, 4.48, 7.85e9),
    "flexsp-gpt13b-a100": (9.285e-6, 0.306, 1133.0, 40, 5120, 4.22, 14.85e9),
    "flexsp-gpt30b-a100": (1.543e-5, 0.804, 2789.0, 60, 6656, 3.42, 32.5e9),
}


def _flexsp_cap(act_mb: float, params: float, gpus: int = 64) -> int:
    """FlexSP's token cap: (E - 16 B * params / N) / act_per_token with E = 28 GiB (A100-40GB).

    For GPT-7B at 384K on 64 GPUs this gives 5,982; the paper's solver reports 5,950
    (its parameter count differs slightly), which the 7B preset uses as published.
    """
    e = 28 * 2**30
    return int((e - 16 * params / gpus) / (act_mb * 2**20))


def _flexsp(name: str) -> CostModel:
    q, lin, beta, layers, hidden, act, params = _FLEXSP[name]
    cap = 5950 if name == "flexsp-gpt7b-a100" else _flexsp_cap(act, params)
    return CostModel(
        name=name,
        quadratic_ms=q,
        linear_ms=lin,
        microbatch_ms=beta,
        comm_bytes_per_token=16 * layers * hidden,
        bandwidth_gbs=tuple(sorted(_FLEXSP_BW.items())),
        max_tokens_per_lane=cap,
        gpus_per_node=8,
    )


def _hydraulis_llama7b() -> CostModel:
    """Hydraulis LLaMA2-7B on A800 (papers/hydraulis.md §1).

    The paper's coefficients are one *stage's* fwd+bwd per microbatch; contract 2 wants
    whole-model time on one lane, so each is multiplied by pp (one stage's share is then
    ``time / pp`` again). Memory caps are the derived values for the dp8*tp4 optimizer layout
    on 32 GPUs. tp=pp=1 does not hold the 7B model in that layout (cap 0); tp2pp1 has a cap
    but no published time coefficients, so it is left out.
    """
    bw = tuple(sorted({2: 150.0, 4: 130.0, 8: 120.0, 16: 12.5}.items()))
    comm = 16 * 32 * 4096

    def shape(tp: int, pp: int, a: float, b: float, c: float, cap: int) -> ShapeCost:
        return ShapeCost(tp=tp, pp=pp, quadratic_ms=a * pp, linear_ms=b * pp, microbatch_ms=c * pp,
                         comm_bytes_per_token=comm, bandwidth_gbs=bw, max_tokens_per_lane=cap)

    strategies = (
        shape(1, 2, 1.37e-6, 0.0946, 15.0, 11264),
        shape(4, 1, 1.03e-6, 0.0565, 56.7, 46080),
        shape(8, 1, 5.07e-7, 0.0366, 44.3, 84992),
    )
    return CostModel(name="hydraulis-llama7b-a800", quadratic_ms=1.37e-6, linear_ms=0.0946,
                     microbatch_ms=15.0, comm_bytes_per_token=comm, bandwidth_gbs=bw,
                     max_tokens_per_lane=0, gpus_per_node=8, strategies=strategies)


def _hydra_gpt7b() -> CostModel:
    """The HyDra benchmark setting of the planning issue: FlexSP GPT-7B coefficients and bandwidths,
    ``max_tokens_per_lane: 8192`` and ``microbatch_ms: 30`` (the floor of one 7B fwd+bwd pass)."""
    return _flexsp("flexsp-gpt7b-a100").replace(name="hydra-gpt7b-a100", max_tokens_per_lane=8192,
                                                microbatch_ms=30.0)


# ---------------------------------------------------------------------------------------------
# Analytic cost from model shape and hardware
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True  # SwiGLU MLP (3 matrices, LLaMA); False: GELU MLP (2 matrices, GPT)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2
        mlp = (3 if self.gated else 2) * h * self.ffn
        emb = self.vocab * h * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * h) + emb + h

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a per-token GEMM (the input embedding is a lookup)."""
        return self.params - self.vocab * self.hidden * (0 if self.tied else 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    peak_tflops: float  # dense bf16 per device
    memory_gib: float
    intra_node_gbs: float  # per-device all-to-all bandwidth inside a node
    inter_node_gbs: float  # per-device bandwidth across nodes
    hbm_gbs: float
    gpus_per_node: int = 8
    mfu: float = 0.5  # achievable fraction of peak for GEMMs
    attn_efficiency: float = 0.4  # achievable fraction of peak for attention


# ---- memory: the formulas behind the analytic lane caps and the runtime's per-rank report ----------
# (parallel_runtime reports measured figures beside these in metrics.jsonl; tests hold them within 20%)

@dataclass(frozen=True, kw_only=True, slots=True)
class Reserve:
    """Device memory a rank cannot give to tensors: the CUDA context (with the kernels' libraries), NCCL's
    buffers for every communicator the rank uses (each holds its own, per channel and peer: 0.5-3 GB were
    measured for one, NVIDIA/nccl#864 and #1685), and the caching allocator's slack (fragmentation)."""

    context_gib: float = 1.0
    nccl_gib_per_communicator: float = 0.5
    slack: float = 0.05  # of the device
    communicators: int = 8  # assumed where a plan's are not known (the lane caps)

    def bytes(self, device_gib: float, communicators: int | None = None) -> float:
        n = self.communicators if communicators is None else communicators
        return (self.context_gib + self.nccl_gib_per_communicator * n + self.slack * device_gib) * 2**30


RESERVE = Reserve()

OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 master, two AdamW moments, fp32 gradient shard (4 B each; the shard lives inside
# the working gradients on a whole-model fp32 rank, so there it is 12)


def state_bytes(model: ModelShape, *, world_size: int, tp: int = 1, pp: int = 1, itemsize: int = 2,
                stage: int | None = None) -> dict[str, float]:
    """Bytes per rank of the model's state: working ``params`` (one stage's TP slice, in the compute dtype of
    ``itemsize`` bytes), their ``grads`` (fp32: the runtime sums microbatch gradients in fp32 whatever the
    compute dtype) and the ``optimizer`` shard (fixed, over the whole world). ``stage``: that stage's own
    parameters (its layers, and the embedding or the head at the ends); default an even share."""
    if stage is None:
        local = model.params / (tp * pp)
    else:
        local = stage_params(model, pp, stage) / tp
    return {"params": itemsize * local, "grads": 4 * local,
            "optimizer": OPTIMIZER_BYTES_PER_PARAM * model.params / world_size}


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers of pipeline ``stage`` (contiguous; sizes differ by at most one, earlier stages larger: the
    runtime's split)."""
    base, extra = divmod(layers, pp)
    return base + (1 if stage < extra else 0)


def stage_params(model: ModelShape, pp: int, stage: int) -> float:
    """Parameters one pipeline stage holds: its layers, the embedding on the first, norm and head on the last."""
    h, d = model.hidden, model.head_dim
    layer = h * model.heads * d * 2 + h * model.kv_heads * d * 2 + (3 if model.gated else 2) * h * model.ffn + 2 * h
    out = stage_layers(model.layers, pp, stage) * layer
    if stage == 0:
        out += model.vocab * h
    if stage == pp - 1:
        out += h + (model.vocab * h if not model.tied or pp > 1 else 0)
    return out


def layer_activation_bytes(model: ModelShape, *, tp: int = 1, itemsize: int = 2) -> float:
    """Bytes per token one block keeps for backward: two RMSNorms (fp32 input copy, normalised input and
    its scaled output, the 1/rms), attention's roped q, k, v, its output and the o_proj input, fp32
    log-sum-exp per head, and SwiGLU's gate, up, silu(gate) and product. No sequence parallelism: the
    norms are whole on every TP rank."""
    d = model.head_dim
    q, kv = model.heads * d, model.kv_heads * d
    norms = 2 * (4 * model.hidden + 2 * itemsize * model.hidden + 4)
    ffn_mult = 4 if model.gated else 2
    split = itemsize * (3 * q + 2 * kv) + 4 * model.heads + itemsize * ffn_mult * model.ffn
    return norms + split / tp


def activation_bytes_per_token(model: ModelShape, *, layers: int | None = None, tp: int = 1, itemsize: int = 2,
                               recompute: bool = False, ends: bool = True) -> float:
    """Bytes per token kept between forward and backward over ``layers`` blocks (default all), plus the
    ends (final norm, fp32 log-softmax of the vocab slice, token ids) when ``ends``. With ``recompute``
    a block keeps only its input; the RoPE tables are shared by all blocks. The peak under recompute
    adds one block's :func:`layer_activation_bytes` while that block is recomputed in backward."""
    n = model.layers if layers is None else layers
    per_layer = itemsize * model.hidden if recompute else layer_activation_bytes(model, tp=tp, itemsize=itemsize)
    out = n * per_layer + itemsize * model.head_dim  # cos and sin, [T, head_dim / 2] each
    if ends:
        out += 4 * model.hidden + 2 * itemsize * model.hidden + 4 + 4 * model.vocab / tp + 16
    return out


def cp_bytes_per_token(model: ModelShape, *, degree: int, inner: int, tp: int = 1, itemsize: int = 2,
                       layers: int | None = None) -> float:
    """Bytes one lane of a CP group of ``degree`` lanes sends per token it holds, forward and backward, over
    ``layers`` layers (default all), as the runtime's engines move them: Ulysses over ``inner`` lanes, the
    all-to-alls of Q, K, V and of the output, forward and backward (their buffers, the lane's own chunk
    included); a ring over ``degree / inner`` outer ranks, K and V for r - 1 hops forward, again backward
    with dK and dV, which travel in fp32. Contract 2's one ``comm_bytes_per_token`` is the Ulysses term."""
    n = model.layers if layers is None else layers
    h, hkv, d = model.heads / tp, model.kv_heads / tp, model.head_dim
    r = degree // inner
    ulysses = 2 * (2 * h + 2 * hkv) * d * itemsize if inner > 1 else 0.0
    ring = (r - 1) * 2 * hkv * d * (2 * itemsize + 4) if r > 1 else 0.0
    return n * (ulysses + ring)


def in_flight(pp: int, stage: int) -> int:
    """Microbatches whose activations 1F1B stage ``stage`` of ``pp`` holds at once (with enough microbatches):
    the warmup's ``pp - stage - 1`` forwards and the one being run."""
    return pp - stage


def lane_cap(model: ModelShape, *, usable_bytes: float, world_size: int, tp: int = 1, pp: int = 1,
             itemsize: int = 2, bucket_bytes: float = 0.0) -> int:
    """``max_tokens_per_lane`` of a ``(tp, pp)`` shape from the memory formulas: the most tokens one lane may
    hold in one microbatch so that every stage fits in ``usable_bytes`` (the device less its
    :class:`Reserve`), with :func:`in_flight` microbatches of that many tokens at each 1F1B stage, its state
    (:func:`state_bytes`), the optimizer's bucket buffers, and one more layer's activations for what a
    layer's backward allocates beside them (gradients of activations, the attention kernel's workspace).
    A multiple of 128; 0 when the state alone does not fit."""
    caps = []
    for s in range(pp):
        state = sum(state_bytes(model, world_size=world_size, tp=tp, pp=pp, itemsize=itemsize, stage=s).values())
        act = activation_bytes_per_token(model, layers=stage_layers(model.layers, pp, s), tp=tp, itemsize=itemsize,
                                         ends=s == pp - 1)
        per_token = in_flight(pp, s) * act + layer_activation_bytes(model, tp=tp, itemsize=itemsize)
        caps.append(max(0.0, usable_bytes - state - bucket_bytes) / per_token)
    return int(min(caps)) // 128 * 128


MODELS: dict[str, ModelShape] = {
    "gpt-7b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=16384, vocab=50257, gated=False),
    "gpt-13b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=40, ffn=20480, vocab=50257, gated=False),
    "gpt-30b": ModelShape(hidden=6656, layers=60, heads=52, kv_heads=52, ffn=26624, vocab=50257, gated=False),
    "llama2-7b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "llama2-13b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824, vocab=32000),
    "llama3-8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3-70b": ModelShape(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    # The runtime's CPU test model (parallel_runtime default shape).
    "tiny": ModelShape(hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, vocab=256, tied=False),
}

HARDWARE: dict[str, Hardware] = {
    "a100-40g": Hardware(peak_tflops=312, memory_gib=40, intra_node_gbs=120, inter_node_gbs=12.5, hbm_gbs=1555),
    "a800": Hardware(peak_tflops=312, memory_gib=80, intra_node_gbs=150, inter_node_gbs=12.5, hbm_gbs=2039),
    "h100": Hardware(peak_tflops=989, memory_gib=80, intra_node_gbs=300, inter_node_gbs=50, hbm_gbs=3350),
    "h200": Hardware(peak_tflops=989, memory_gib=141, intra_node_gbs=300, inter_node_gbs=50, hbm_gbs=4800),
    "cpu": Hardware(peak_tflops=0.1, memory_gib=8, intra_node_gbs=5, inter_node_gbs=1, hbm_gbs=20,
                    gpus_per_node=8, mfu=0.5, attn_efficiency=0.3),
}


def analytic_cost(model: ModelShape, hw: Hardware, *, world_size: int = 64,
                  shapes: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2)),
                  memory_fraction: float = 0.85, name: str = "") -> CostModel:
    """Derive every contract-2 field from a model shape and a device.

    * linear: 6 FLOPs per matmul parameter per token (fwd + bwd) at ``mfu`` of peak, plus
      tensor-parallel all-reduces (4 per layer of ``hidden`` bf16 values per token) over NVLink.
    * quadratic: causal attention, 6 * layers * heads * head_dim FLOPs per token^2 (fwd + bwd,
      half the square) at ``attn_efficiency`` of peak.
    * microbatch: reading the weights three times (fwd, bwd, grads) from HBM plus 0.2 ms of
      launch overhead per layer.
    * comm: Ulysses all-to-all of Q, K, V, O in fwd and bwd: ``4*(D_q + D_kv)*2 bytes*layers``.
    * memory (:func:`lane_cap` over :func:`state_bytes` and :func:`activation_bytes_per_token`, the
      formulas the runtime's memory report and ``python -m parallel_runtime estimate`` are checked
      against): per stage, the optimizer shard over the world (16 B/param), bf16 weights and fp32 grads
      of the stage (6 B/param / tp), and bf16 activations of the stage's layers for the microbatches
      1F1B keeps in flight there (pp - stage), in ``memory_fraction`` of the device.
    """
    flops = hw.peak_tflops * 1e12
    d_q = model.heads * model.head_dim
    d_kv = model.kv_heads * model.head_dim
    bw = ((2, hw.intra_node_gbs), (hw.gpus_per_node * 2, hw.inter_node_gbs))
    comm = 4 * (d_q + d_kv) * 2 * model.layers
    out: list[ShapeCost] = []
    for tp, pp in shapes:
        tp_eff = 1.0 if tp == 1 else 0.9
        lin = 6 * model.matmul_params / (flops * hw.mfu * tp_eff * tp) * 1e3
        if tp > 1:  # 4 all-reduces per layer (2 fwd, 2 bwd), ring factor 2(tp-1)/tp
            lin += 4 * model.layers * model.hidden * 2 * 2 * (tp - 1) / tp / (hw.intra_node_gbs * 1e9) * 1e3
        quad = 6 * model.layers * d_q / 2 / (flops * hw.attn_efficiency * tp) * 1e3 * 2
        mb = 3 * model.params * 2 / tp / (hw.hbm_gbs * 1e9) * 1e3 + 0.2 * model.layers
        cap = lane_cap(model, usable_bytes=hw.memory_gib * 2**30 * memory_fraction, world_size=world_size, tp=tp,
                       pp=pp)
        out.append(ShapeCost(tp=tp, pp=pp, quadratic_ms=quad, linear_ms=lin, microbatch_ms=mb,
                             comm_bytes_per_token=comm, bandwidth_gbs=bw, max_tokens_per_lane=cap))
    base = next((s for s in out if s.tp == 1 and s.pp == 1), None)
    if base is None:
        raise ValueError("analytic_cost: shapes must include (1, 1)")
    return CostModel(name=name, quadratic_ms=base.quadratic_ms, linear_ms=base.linear_ms,
                     microbatch_ms=base.microbatch_ms, comm_bytes_per_token=comm, bandwidth_gbs=bw,
                     max_tokens_per_lane=base.max_tokens_per_lane, gpus_per_node=hw.gpus_per_node,
                     strategies=tuple(s for s in out if (s.tp, s.pp) != (1, 1)))


COST_PRESETS = {
    "flexsp-gpt7b-a100": lambda: _flexsp("flexsp-gpt7b-a100"),
    "flexsp-gpt13b-a100": lambda: _flexsp("flexsp-gpt13b-a100"),
    "flexsp-gpt30b-a100": lambda: _flexsp("flexsp-gpt30b-a100"),
    "hydraulis-llama7b-a800": _hydraulis_llama7b,
    "hydra-gpt7b-a100": _hydra_gpt7b,
}


def preset_names() -> list[str]:
    return sorted(COST_PRESETS) + [f"analytic:{m}@{h}" for m in sorted(MODELS) for h in sorted(HARDWARE)]


def cost_preset(name: str, *, world_size: int = 64) -> CostModel:
    """A named cost model: a published preset or ``analytic:<model>@<hardware>``."""
    if name in COST_PRESETS:
        return COST_PRESETS[name]()
    if name.startswith("analytic:") and "@" in name:
        m, h = name[len("analytic:"):].split("@", 1)
        if m not in MODELS:
            raise ValueError(f"unknown model '{m}' in cost preset; known: {', '.join(sorted(MODELS))}")
        if h not in HARDWARE:
            raise ValueError(f"unknown hardware '{h}' in cost preset; known: {', '.join(sorted(HARDWARE))}")
        return analytic_cost(MODELS[m], HARDWARE[h], world_size=world_size, name=name)
    raise ValueError(f"unknown cost preset '{name}'; known: {', '.join(sorted(COST_PRESETS))}, "
                     f"or analytic:<model>@<hardware>")


def load_cost(cost_file: str | None = None, preset: str | None = None, *, world_size: int = 64) -> CostModel:
    """Cost model from ``--cost-file`` or ``--cost PRESET`` (exactly one)."""
    if cost_file and preset:
        raise ValueError("give either --cost-file or --cost, not both")
    if cost_file:
        return CostModel.from_file(cost_file)
    if preset:
        return cost_preset(preset, world_size=world_size)
    raise ValueError("a cost model is needed: --cost-file COST.yaml or --cost PRESET "
                     f"(presets: {', '.join(sorted(COST_PRESETS))})")


def resolve_cost(cost: Any, world_size: int) -> CostModel:
    """A :class:`CostModel`, a cost-file path (``.yaml``/``.yml``) or a preset name (the loader's and
    :func:`balanced_loader.balance`'s ``cost``)."""
    if isinstance(cost, CostModel):
        return cost
    if isinstance(cost, (str, os.PathLike)):
        name = os.fspath(cost)
        if name.endswith((".yaml", ".yml")):
            return CostModel.from_file(name)
        return cost_preset(name, world_size=world_size)
    raise ValueError("BalancedLoader needs a cost model: cost=CostModel, a cost file path, or a preset "
                     "name such as 'analytic:tiny@cpu'")
