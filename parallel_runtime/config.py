"""Training recipes: strict YAML into frozen dataclasses (unknown keys fail, errors name the field).

A recipe is one YAML file with a top-level ``seed`` and ``steps`` and the sections ``data``,
``model``, ``policy``, ``cost``, ``world``, ``optimizer`` and ``train`` (see ``recipes/`` and
docs/runtime.md). ``--set key=value`` overrides any field by its dotted path before
validation (``--set seed=3``, ``--set optimizer.lr=1e-3``, ``--set policy.compare=[maxlen]``); the
value is read as YAML. Relative paths (``cost.file``, ``data.source``) are resolved against the
recipe's folder first, then the working directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from balanced_loader.batches.items import LONG_DOC_MODES
from balanced_loader.calibration.calibrator import CalibrationOptions
from balanced_loader.cost import CostModel, allowed_degrees
from balanced_loader.data.mixture import MIX_BY
from balanced_loader.loader import ORDERS
from balanced_loader.loader_args import MAX_PREFETCH_STEPS, check_long_docs, check_planner_workers, integer
from balanced_loader.planning import fixed_pools, pool_shapes
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.registry import POLICIES
from balanced_loader.schedule import setting, weight_schedule
from balanced_loader.strict import from_dict, read_yaml, yaml_loads
from parallel_runtime.engines.attention import DENSE_IMPLS, IMPLS
from parallel_runtime.engines.context import ENGINES
from parallel_runtime.hf.config import (
    PRETRAINED,
    check_hf_config,
    check_hf_recompute,
    check_hf_shape,
    hf_config,
    kv_heads,
    normalize,
)
from parallel_runtime.model import ModelConfig
from parallel_runtime.training.optimizer import AdamWConfig as OptimizerConfig

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
PLAN_SOURCES = ("local", "broadcast")
STDLIB = "stdlib"


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureEntry:
    """One source of ``data.mixture``: its name, where it is, and its weight (a number or a schedule)."""

    name: str
    source: str  # a shard folder or a .jsonl (relative paths as data.source)
    weight: float | tuple[tuple[int, float], ...] = 1.0  # or [[step, weight], ...], linear between steps


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where the docs come from and how global batches are cut."""

    source: str = STDLIB  # "stdlib" (CPython's .py files, built once into shards_dir), a shard folder, a .jsonl
    shards_dir: str = ".demo/stdlib-shards"  # where the stdlib corpus is built (relative to the working dir)
    stdlib_limit: int | None = None  # only the first N stdlib files (small test corpora)
    mixture: tuple[MixtureEntry, ...] | None = None  # several sources at set shares of every step (instead of source)
    mixture_by: str = "tokens"  # the weights are shares of each step's tokens | docs
    # token budget of one step; or a schedule [[step, tokens], ...] (batch-size ramp-up)
    global_batch_tokens: int | tuple[tuple[int, int], ...] = 8192
    # context limit, longer docs follow long_docs; or a schedule [[step, tokens], ...] (sequence-length warm-up)
    max_seq_len: int | tuple[tuple[int, int], ...] = 1024
    long_docs: str = "split"  # split | truncate | drop | error
    shuffle: bool = True
    shuffle_window: int = 65536
    order: str = "any"  # strict (with shuffle: false): steps follow the source order exactly
    prefetch_steps: int = 2  # plans computed ahead in the background
    planner_workers: int = 0  # 0: a thread; N: processes
    read_timeout_s: float = 60.0  # a remote source (URL): how long a read waits for a stalled server

    @property
    def longest_seq_len(self) -> int:
        """The largest ``max_seq_len`` of the run (the schedule's largest value)."""
        return setting(self.max_seq_len, "data.max_seq_len").largest


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    """The planning policy (balanced_loader.planning) and how ranks agree on its plans."""

    name: str = "hydra"
    tp: int | None = None  # static shape for one-pool policies (None: the policy's default)
    pp: int | None = None
    cp: int | None = None
    time_limit_s: float = 1.0  # per solver call (flexsp, hydraulis)
    candidates: str | None = None  # hydraulis candidates file
    extra: dict = field(default_factory=dict)  # policy knobs, e.g. pools: [{tp, pp, lanes}, ...]
    plan_source: str = "local"  # local: every rank plans (deterministic policies); broadcast: rank 0 plans
    compare: tuple[str, ...] = ()  # other policies run on the same batches for the balance report (not trained)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostConfig:
    """The contract-2 cost model: a cost file or a preset (exactly one), optional memory cap override."""

    file: str | None = None
    preset: str | None = None
    max_tokens_per_lane: int | None = None  # memory cap override for every shape
    lane_caps: dict = field(default_factory=dict)  # memory cap per shape, e.g. {1x1: 512, 1x2: 1024}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldConfig:
    """The processes and how they talk."""

    size: int = 1  # number of ranks (accelerate --num_processes)
    device: str = "cpu"  # cpu | cuda (one GPU per rank, LOCAL_RANK)
    backend: str = "auto"  # auto: nccl on cuda, gloo on cpu
    cp_engine: str = "ring"  # ring | ulysses | nested (Ulysses inside, ring across)
    cp_inner: int = 1  # Ulysses size of the nested engine
    timeout_s: float = 300.0  # collective timeout: a crashed peer ends the others within it
    threads: int = 1  # torch intra-op threads per rank on CPU
    # CPU (glibc): allocations of at least this many KiB get their own mapping, returned to the OS when
    # freed, at the cost of fresh zeroed pages for every activation (0: glibc's default, whose threshold
    # grows so that activations are reused from the heap: the fast default)
    heap_mmap_kb: int = 0
    # CPU (glibc): during a step, when the resident set and its part the heap does not have in use have
    # grown this many MiB since the last check or trim, free C-heap pages are handed back to the OS, but
    # only where that can lower the run's peak: above the process's highest resident mark, or within this
    # many MiB below it with train.recompute (training/peaks.py; 0: no trims during a step, one between
    # each of its phases)
    heap_trim_mb: int = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Execution knobs of the trainer."""

    dtype: str = "float32"  # working (compute) dtype; master weights and optimizer states are fp32
    attention: str = "auto"  # local attention kernel: auto | masked | loop | sdpa | flash
    checkpoint_every: int = 0  # also checkpoint every N steps (always at the end of a run)
    recompute: bool = False  # activation checkpointing: keep each block's input, recompute its inside in backward
    calibrate: bool = False  # closed loop: fit the cost model and per-rank speeds online (options: calibration:)
    trace: bool = False  # write the measured run as OUT/trace.json (Chrome / Perfetto trace events)
    # pull/push buckets in flight beside forward/backward (parallel_runtime.training.overlap): true, false or auto
    # (on GPUs; on CPU only where this machine's ranks x world.threads leave a core free: overlap_wanted)
    overlap: bool | str = "auto"


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeModelConfig(ModelConfig):
    """The native decoder's shape, or ``hf``: a transformers causal LM (then the other keys stay unset)."""

    hf: dict | None = None  # {model_type: llama, hidden_size: 64, ...} or {pretrained: folder} (a string: the folder)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    seed: int = 0
    steps: int = 10  # train until this global step (a resumed run continues up to it)
    data: DataConfig = field(default_factory=DataConfig)
    model: RecipeModelConfig = field(default_factory=RecipeModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)  # with train.calibrate
    path: str = ""  # the recipe file (set by load_recipe; relative paths resolve against its folder)

    # ---- derived ----------------------------------------------------------------------
    def resolve(self, p: str) -> str:
        """A path from the recipe: absolute, else next to the recipe if it exists there, else as given."""
        if os.path.isabs(p) or not self.path:
            return p
        near = os.path.join(os.path.dirname(os.path.abspath(self.path)), p)
        return near if os.path.exists(near) else p

    def cost_model(self) -> CostModel:
        from balanced_loader.presets import cost_preset

        c = self.cost
        if c.file:
            cost = CostModel.from_file(self.resolve(c.file))
        else:
            cost = cost_preset(c.preset, world_size=self.world.size)
        if c.max_tokens_per_lane is not None:
            cost = cost.with_base(max_tokens_per_lane=c.max_tokens_per_lane)
        return with_lane_caps(cost, c.lane_caps) if c.lane_caps else cost

    def plan_config(self, policy: str | None = None) -> dict[str, Any]:
        """The loader's ``plan_config`` for ``policy`` (default: the recipe's)."""
        p = self.policy
        out: dict[str, Any] = {"time_limit_s": p.time_limit_s}
        if policy in (None, p.name):
            out.update(tp=p.tp, pp=p.pp, cp=p.cp, candidates=p.candidates, extra=dict(p.extra))
        return out

    def loader_cp_inner(self) -> int:
        """The loader's ``cp_inner`` for the CP engine (the layout every engine reads)."""
        w = self.world
        if w.cp_engine == "ring":
            return 1
        if w.cp_engine == "ulysses":
            return math.lcm(*range(1, self.world.size + 1))  # gcd(inner, d) == d for every degree d
        return w.cp_inner

    def shapes(self) -> list[tuple[int, int]]:
        """(tp, pp) shapes plans of this recipe can use."""
        return sorted(self.shape_lanes())

    def policy_config(self) -> PlanConfig:
        """The recipe's policy as the planner's :class:`PlanConfig`."""
        p = self.policy
        return PlanConfig(policy=p.name, world_size=self.world.size, tp=p.tp, pp=p.pp, cp=p.cp, seed=self.seed,
                          time_limit_s=p.time_limit_s, candidates=p.candidates, extra=dict(p.extra))

    def shape_lanes(self) -> dict[tuple[int, int], int]:
        """The most lanes a pool of each (tp, pp) shape of this recipe has (the policy says)."""
        return pool_shapes(self.cost_model(), self.policy_config())


def parse_shape(key: Any, where: str) -> tuple[int, int]:
    """``"TPxPP"`` -> (tp, pp)."""
    try:
        tp, pp = (int(x) for x in str(key).lower().split("x"))
    except ValueError:
        raise ValueError(f"{where}: '{key}' is not a shape TPxPP (e.g. 1x2)") from None
    return tp, pp


def with_lane_caps(cost: CostModel, caps: dict) -> CostModel:
    """The cost model with ``max_tokens_per_lane`` set per shape (``{"1x1": 512, "1x2": 1024}``)."""
    base = cost.base.max_tokens_per_lane
    strategies = list(cost.strategies)
    for key, value in caps.items():
        where = f"cost.lane_caps.{key}"
        tp, pp = parse_shape(key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where} must be a token count >= 0, got {value!r}")
        cost.shape(tp, pp)  # the shape must be in the cost file
        if (tp, pp) == (1, 1):
            base = value
        else:
            strategies = [dataclasses.replace(s, max_tokens_per_lane=value) if (s.tp, s.pp) == (tp, pp) else s
                          for s in strategies]
    return cost.replace(max_tokens_per_lane=base, strategies=tuple(strategies))


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``key=value`` overrides (dotted keys, YAML values) applied to the raw recipe mapping."""
    import yaml

    out = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value (e.g. --set optimizer.lr=1e-3)")
        key, text = item.split("=", 1)
        try:
            value = yaml_loads(text)
        except yaml.YAMLError:
            raise ValueError(f"--set {key}: value {text!r} is not valid YAML") from None
        except ValueError as e:  # a mapping value that gives a key twice
            raise ValueError(f"--set {key}: {e}") from None
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            child = dict(child) if isinstance(child, dict) else {}
            node[p] = child
            node = child
        node[parts[-1]] = value
    return out


def recipe_from_dict(raw: Any, path: str = "") -> Recipe:
    """A validated recipe from a mapping (the YAML document)."""
    if not isinstance(raw, dict):
        raise ValueError("a recipe must be a YAML mapping with seed, steps, data, model, policy, cost, world, ...")
    if "seed" not in raw:
        raise ValueError("missing key 'seed': every recipe sets a top-level seed")
    if isinstance(raw.get("model"), dict) and "hf" in raw["model"]:
        raw = {**raw, "model": {**raw["model"], "hf": normalize(raw["model"]["hf"])}}
    if isinstance(raw.get("data"), dict) and isinstance(raw["data"].get("mixture"), str):
        raw = {**raw, "data": {**raw["data"], "mixture": _data_path_mixture(raw["data"]["mixture"])}}
    recipe = from_dict(Recipe, raw, "recipe", file=path)
    recipe = dataclasses.replace(recipe, path=path)
    hf = recipe.model.hf
    if hf is not None and isinstance(hf.get(PRETRAINED), str):  # the folder resolves against the recipe's
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(
            recipe.model, hf={**hf, PRETRAINED: os.path.abspath(recipe.resolve(hf[PRETRAINED]))}))
    validate(recipe)
    return recipe


def _data_path_mixture(text: str) -> list[dict[str, Any]]:
    """``data.mixture`` given as Megatron's data path (``"0.3 PREFIX_A 0.7 PREFIX_B"``, as ``--data-path``
    takes it) as the recipe's list of ``{name, source, weight}`` (names: the prefixes' base names)."""
    from balanced_loader.data.megatron import data_path_sources

    try:
        sources, weights = data_path_sources(text)
    except ValueError as e:
        raise ValueError(f"data.mixture: {e}") from None
    if weights is None:
        raise ValueError("data.mixture: a data path in a recipe carries a weight before every prefix "
                         "('0.3 PREFIX_A 0.7 PREFIX_B')")
    return [{"name": n, "source": p, "weight": weights[n]} for n, p in sources.items()]


def load_recipe(path: str, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file (one ValueError line naming the field)."""
    raw = read_yaml(path, "recipe", mapping=True)
    return recipe_from_dict(apply_overrides(raw, overrides or []), path)


def dump_recipe(recipe: Recipe) -> dict:
    """The recipe as a plain mapping (for logs and checkpoints)."""
    d = dataclasses.asdict(recipe)
    d.pop("path", None)
    return d


# ---- validation ---------------------------------------------------------------------------


def _positive(value: Any, name: str, *, zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not zero)):
        raise ValueError(f"{name} must be {'>= 0' if zero else 'positive'}, got {value}")


def validate(r: Recipe) -> None:
    """Cross-field checks: the world, the policy, the cost model and the model shape must agree."""
    _positive(r.steps, "steps", zero=True)
    d, p, c, w, o, t = r.data, r.policy, r.cost, r.world, r.optimizer, r.train
    for name in ("global_batch_tokens", "max_seq_len"):
        setting(getattr(d, name), f"data.{name}")  # a positive integer or a schedule of them
    for name in ("shuffle_window", "stdlib_limit"):
        _positive(getattr(d, name), f"data.{name}")
    _validate_mixture(d)
    # the loader's own checks (loader_args), named by their recipe keys
    integer(d.prefetch_steps, "data.prefetch_steps", 0, MAX_PREFETCH_STEPS)
    check_planner_workers(d.planner_workers, "data.planner_workers")
    check_long_docs(d.long_docs, LONG_DOC_MODES, "data.long_docs")
    _positive(d.read_timeout_s, "data.read_timeout_s")
    if p.name not in POLICIES:
        raise ValueError(f"policy.name: unknown policy '{p.name}'; choose one of {', '.join(POLICIES)}")
    for other in p.compare:
        if other not in POLICIES:
            raise ValueError(f"policy.compare: unknown policy '{other}'; choose among {', '.join(POLICIES)}")
    if p.plan_source not in PLAN_SOURCES:
        raise ValueError(f"policy.plan_source must be one of {', '.join(PLAN_SOURCES)}, got '{p.plan_source}'")
    for name in ("tp", "pp", "cp"):
        _positive(getattr(p, name), f"policy.{name}")
    if (c.file is None) == (c.preset is None):
        raise ValueError("cost: give exactly one of cost.file (a contract-2 cost file) or cost.preset")
    _positive(c.max_tokens_per_lane, "cost.max_tokens_per_lane")
    _positive(w.size, "world.size")
    _positive(w.timeout_s, "world.timeout_s")
    _positive(w.threads, "world.threads")
    if w.heap_mmap_kb < 0 or w.heap_mmap_kb > 1 << 20:
        raise ValueError(f"world.heap_mmap_kb must be in 0..{1 << 20} (KiB; 0 keeps glibc's default), "
                         f"got {w.heap_mmap_kb}")
    if w.heap_trim_mb < 0 or w.heap_trim_mb > 1 << 20:
        raise ValueError(f"world.heap_trim_mb must be in 0..{1 << 20} (MiB of resident growth between heap trims; "
                         f"0 never trims), got {w.heap_trim_mb}")
    if w.device not in DEVICES:
        raise ValueError(f"world.device must be one of {', '.join(DEVICES)}, got '{w.device}'")
    if w.backend not in BACKENDS:
        raise ValueError(f"world.backend must be one of {', '.join(BACKENDS)}, got '{w.backend}'")
    if w.backend == "nccl" and w.device != "cuda":
        raise ValueError("world.backend nccl needs world.device cuda")
    if w.cp_engine not in ENGINES:
        raise ValueError(f"world.cp_engine must be one of {', '.join(ENGINES)}, got '{w.cp_engine}'")
    _positive(w.cp_inner, "world.cp_inner")
    if w.cp_engine != "nested" and w.cp_inner != 1:
        raise ValueError(f"world.cp_inner applies to the nested engine only (cp_engine is '{w.cp_engine}')")
    for name in ("lr", "eps"):
        _positive(getattr(o, name), f"optimizer.{name}")
    _positive(o.weight_decay, "optimizer.weight_decay", zero=True)
    _positive(o.max_grad_norm, "optimizer.max_grad_norm", zero=True)
    _positive(o.warmup_steps, "optimizer.warmup_steps", zero=True)
    if not all(0 <= b < 1 for b in o.betas):
        raise ValueError(f"optimizer.betas must be in [0, 1), got {list(o.betas)}")
    if t.dtype not in DTYPES:
        raise ValueError(f"train.dtype must be one of {', '.join(DTYPES)}, got '{t.dtype}'")
    if t.attention not in IMPLS:
        raise ValueError(f"train.attention must be one of {', '.join(IMPLS)}, got '{t.attention}'")
    if w.device == "cuda" and t.attention in DENSE_IMPLS:
        raise ValueError(f"train.attention {t.attention} builds a dense [T, T] mask per microbatch (25 GB at 159K "
                         f"tokens); on world.device cuda use auto (flash-attention when installed, else per-doc "
                         f"SDPA), flash or loop")
    _positive(t.checkpoint_every, "train.checkpoint_every", zero=True)
    if isinstance(t.overlap, str) and t.overlap != "auto":
        raise ValueError(f"train.overlap must be true, false or auto, got '{t.overlap}'")
    r.cost_model()  # a missing or malformed cost file fails here
    if r.model.hf is not None:
        _validate_hf(r)
    _validate_world_shapes(r)


def _validate_mixture(d: DataConfig) -> None:
    """``data.mixture``: unique names, weights that weigh something, and no ``data.source`` beside it."""
    if d.order not in ORDERS or (d.order == "strict" and d.shuffle):
        raise ValueError(f"data.order must be one of {', '.join(ORDERS)}, got '{d.order}'" if d.order not in ORDERS
                         else "data.order strict keeps the source order: set data.shuffle: false")
    if d.mixture_by not in MIX_BY:
        raise ValueError(f"data.mixture_by must be one of {', '.join(MIX_BY)}, got '{d.mixture_by}'")
    if d.mixture is None:
        return
    if not d.mixture:  # an empty list is a mistake, never the stdlib corpus (data.source's default) in its place
        raise ValueError("data.mixture is an empty list: list its sources ({name, source, weight} each), or remove "
                         "data.mixture to train on data.source")
    if d.source != STDLIB:
        raise ValueError("data.source and data.mixture are both set; a mixture lists its sources itself")
    names = [e.name for e in d.mixture]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"data.mixture: source name '{dup[0]}' is listed twice")
    try:
        weight_schedule({e.name: e.weight for e in d.mixture}, sorted(names))
    except ValueError as e:
        raise ValueError(f"data.mixture: {e}") from None


def _validate_hf(r: Recipe) -> None:
    """``model.hf`` names the whole model: the native keys stay unset, the CP engines must run it, and
    ``train.recompute`` needs a model class with activation checkpointing."""
    native = RecipeModelConfig()
    for f in dataclasses.fields(ModelConfig):
        if getattr(r.model, f.name) != getattr(native, f.name):
            raise ValueError(f"model.{f.name} is set but model.hf names the whole model; remove model.{f.name} "
                             f"(set it inside model.hf)")
    check_hf_config(hf_config(r.model.hf), max_seq_len=r.data.longest_seq_len)
    if r.train.recompute:
        check_hf_recompute(hf_config(r.model.hf))


def _validate_world_shapes(r: Recipe) -> None:
    """The world must host every shape the policy may plan, and the model must split over it."""
    p, w = r.policy, r.world
    tp, pp = p.tp or 1, p.pp or 1
    if w.size % (tp * pp):
        raise ValueError(f"world.size {w.size} is not divisible by policy.tp x policy.pp = {tp} x {pp}")
    try:
        fixed_pools(r.policy_config())  # a layout fixed in the policy's options (pools) must fill the world
    except ValueError as e:
        raise ValueError(f"world.size / policy.extra: {e}") from None
    cost = r.cost_model()
    shapes = r.shape_lanes()
    if not shapes:
        raise ValueError(f"cost: no usable shape of the cost model fits world.size {w.size}")
    for (tp, pp), lanes in sorted(shapes.items()):
        check_shape(r.model, tp, pp, r.world, where=f"shape tp={tp}, pp={pp} of policy '{p.name}'",
                    degrees=allowed_degrees(lanes))
        sc = cost.shape(tp, pp)  # ValueError names a shape missing from the cost file
        if not sc.usable:
            raise ValueError(f"cost: shape tp={tp}, pp={pp} of policy '{p.name}' is marked unusable "
                             f"(max_tokens_per_lane: 0)")


def check_shape(model: ModelConfig, tp: int, pp: int, world: WorldConfig, *, where: str,
                degrees: list[int] | None = None) -> None:
    """ValueError naming the field when the model cannot run on a pool shape (tp, pp)."""
    if getattr(model, "hf", None) is not None:
        check_hf_shape(tp, pp, where=where)
        cfg = hf_config(model.hf)
        kv_local, kv_name = kv_heads(cfg), "model.hf.num_key_value_heads"
    else:
        if model.num_layers < pp:
            raise ValueError(f"{where}: model.num_layers ({model.num_layers}) is smaller than pp={pp}; "
                             f"every pipeline stage needs a layer")
        try:
            model.check_parallel(tp=tp)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        kv_local, kv_name = model.num_kv_heads // tp, "model.num_kv_heads / tp"
    if world.cp_engine == "ring":
        return
    for d in degrees if degrees is not None else allowed_degrees(world.size // (tp * pp)):
        inner = d if world.cp_engine == "ulysses" else math.gcd(world.cp_inner, d)
        if inner > 1 and kv_local % inner:
            raise ValueError(f"{where}: world.cp_engine {world.cp_engine} with Ulysses size {inner} needs "
                             f"{kv_name} ({kv_local}) divisible by it; use cp_engine ring or "
                             f"a smaller world.cp_inner")
