"""Contract 4: :class:`BalancedLoader`, one :class:`StepBatch` per optimizer step on every rank.

Each rank builds the same loader (only ``rank`` differs) and computes the same things:

1. the epoch's doc order, a pure function of (seed, epoch): shards permuted and docs
   shuffled in windows of ``shuffle_window`` for a shard folder, a full permutation otherwise;
2. the epoch's sequences: empty docs skipped, docs over ``max_seq_len`` handled by
   ``long_docs`` (counts in :class:`~balanced_loader.data.batching.DocStats`, never silent);
3. global batches of at most ``global_batch_tokens`` tokens, cut between docs (the segments
   of a split doc stay in one step; a doc larger than the budget is a step of its own);
4. a :class:`~balanced_loader.plan.StepPlan` per batch from the policy, planned ahead in the
   background (``prefetch_steps``; a thread, or ``planner_workers`` processes);
5. this rank's microbatches (:mod:`balanced_loader.materialize`), reading only the tokens of
   its own segments.

So every rank gets the same number of steps with no collective, and ``state_dict()`` (the
cursor plus the config it depends on) resumes exactly. Iteration is a cursor: ``for batch in
loader`` continues from the current position and stops after ``epochs`` epochs in total
(``epochs=None``: never stops); a loader that has finished stays finished.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel, allowed_degrees
from balanced_loader.data.batching import LONG_DOC_MODES, DocStats, batch_bounds, epoch_order, to_items
from balanced_loader.data.open import open_source
from balanced_loader.data.sources import Source
from balanced_loader.materialize import Microbatch, materialize_rank, num_valid_tokens
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning import get_policy, make_plan
from balanced_loader.planning.config import PlanConfig

log = logging.getLogger("balanced_loader")

STATE_FORMAT = "balanced-loader/loader-state"
STATE_VERSION = 1
_PLAN_CONFIG_KEYS = ("tp", "pp", "cp", "time_limit_s", "candidates", "extra")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBatch:
    """One optimizer step as seen by one rank."""

    step: int  # global step index, counted from the first step of epoch 0
    epoch: int
    step_in_epoch: int
    plan: StepPlan  # identical on every rank
    microbatches: tuple[Microbatch, ...]  # this rank's, in execution order
    num_valid_tokens: int  # the step's global number of label tokens (labels != -100)
    planner_wait_s: float  # time this step waited for its plan
    doc_stats: DocStats  # what the epoch did with empty and long docs
    rank: int

    @property
    def num_tokens(self) -> int:
        """Positions (tokens plus CP padding) in this rank's microbatches."""
        return sum(mb.num_tokens for mb in self.microbatches)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Epoch:
    epoch: int
    items: BatchItems  # the epoch's sequences, in order
    bounds: np.ndarray  # [num_steps + 1] offsets into items
    stats: DocStats

    @property
    def num_steps(self) -> int:
        return len(self.bounds) - 1

    def batch(self, i: int) -> BatchItems:
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        it = self.items
        return BatchItems(doc_ids=it.doc_ids[a:b], starts=it.starts[a:b], lengths=it.lengths[a:b])


def _plan_job(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    return make_plan(items, cost, config, step)


def resolve_cost(cost: Any, world_size: int) -> CostModel:
    """A :class:`CostModel`, a cost-file path (``.yaml``/``.yml``) or a preset name."""
    if isinstance(cost, CostModel):
        return cost
    if isinstance(cost, (str, os.PathLike)):
        name = os.fspath(cost)
        if name.endswith((".yaml", ".yml")):
            return CostModel.from_file(name)
        from balanced_loader.presets import cost_preset

        return cost_preset(name, world_size=world_size)
    raise ValueError("BalancedLoader needs a cost model: cost=CostModel, a cost file path, or a preset "
                     "name such as 'analytic:tiny@cpu'")


_FIXED_DEGREE_POLICIES = ("maxlen", "static-sp", "token-kk")  # one CP/SP degree dividing the lanes


def default_max_seq_len(cost: CostModel, config: PlanConfig) -> int:
    """The longest segment ``config.policy`` can plan: lane cap x the largest degree it may use.

    ``hydraulis`` runs one lane per pool on any usable shape; ``pools`` the layout in
    ``extra["pools"]``; the other policies one pool of shape ``(tp or 1, pp or 1)``: ``maxlen``,
    ``static-sp`` and ``token-kk`` with ``cp`` or a power of two dividing the lanes, the others on
    aligned power-of-two blocks of lanes (``cp`` when it is set).
    """
    if config.policy == "hydraulis":
        from balanced_loader.planning.solvers.candidates import usable_shapes

        return max(sc.max_tokens_per_lane for sc in usable_shapes(cost, config.world_size))
    layout = config.extra.get("pools") if config.policy == "pools" else None
    if isinstance(layout, list) and layout and all(
            isinstance(p, dict) and all(isinstance(p.get(k, 1), int) for k in ("tp", "pp", "lanes")) for p in layout):
        options = [(cost.shape(p.get("tp", 1), p.get("pp", 1)), p.get("lanes", 1)) for p in layout]
    else:  # one pool of the configured shape
        sc = cost.shape(config.tp or 1, config.pp or 1)
        options = [(sc, config.world_size // sc.gpus)]
    best = 0
    for sc, lanes in options:
        if not sc.usable or lanes < 1:
            continue
        if config.cp is not None:
            degree = min(config.cp, lanes)
        elif config.policy in _FIXED_DEGREE_POLICIES:
            degree = lanes & -lanes
        else:
            degree = max(allowed_degrees(lanes))
        best = max(best, sc.max_tokens_per_lane * degree)
    if best <= 0:
        raise ValueError(f"no usable shape of the cost model fits world size {config.world_size}; "
                         f"pass max_seq_len or a cost model with a usable shape")
    return best


class BalancedLoader:
    """Length-aware loader: global batches by token budget, planned by a policy, materialized per rank.

    ``source``: anything :func:`~balanced_loader.data.open.open_source` takes. ``cost``: a
    :class:`CostModel`, a cost file or a preset name. ``plan_config``: extra
    :class:`PlanConfig` fields (``tp``, ``pp``, ``cp``, ``time_limit_s``, ``candidates``,
    ``extra``). ``max_seq_len`` (the context limit) defaults to the largest segment the cost
    model's best shape holds at its largest degree. A source with lengths only yields plans
    and token-less microbatches (layout only, ``has_tokens`` False).
    """

    def __init__(self, source: Any, *, policy: str = "hydra", cost: Any = None, world_size: int,
                 rank: int = 0, global_batch_tokens: int, seed: int = 0, max_seq_len: int | None = None,
                 long_docs: str = "split", shuffle: bool = True, shuffle_window: int = 1 << 16,
                 epochs: int | None = 1, prefetch_steps: int = 2, planner_workers: int = 0,
                 plan_config: dict[str, Any] | PlanConfig | None = None, cp_inner: int = 1, pad_id: int = 0,
                 validate: bool = False) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if not isinstance(global_batch_tokens, int) or global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens must be a positive integer, got {global_batch_tokens!r}")
        if long_docs not in LONG_DOC_MODES:
            raise ValueError(f"long_docs must be one of {', '.join(LONG_DOC_MODES)}, got '{long_docs}'")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be a positive integer or None (endless), got {epochs!r}")
        if prefetch_steps < 0 or planner_workers < 0:
            raise ValueError("prefetch_steps and planner_workers must be >= 0")
        if shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {shuffle_window}")
        if cp_inner < 1:
            raise ValueError(f"cp_inner must be >= 1, got {cp_inner}")
        self.source: Source = open_source(source)
        self.cost = resolve_cost(cost, world_size)
        self.config = self._plan_config(policy, world_size, seed, plan_config)
        get_policy(self.config.policy)  # fail now, not in the first step
        self.policy = self.config.policy
        self.world_size = world_size
        self.rank = rank
        self.global_batch_tokens = global_batch_tokens
        self.seed = int(seed)
        self.max_seq_len = int(max_seq_len) if max_seq_len is not None else default_max_seq_len(self.cost, self.config)
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.long_docs = long_docs
        self.shuffle = bool(shuffle)
        self.shuffle_window = int(shuffle_window)
        self.epochs = epochs
        self.prefetch_steps = int(prefetch_steps)
        self.planner_workers = int(planner_workers)
        self.cp_inner = int(cp_inner)
        self.pad_id = int(pad_id)
        self.validate = bool(validate)
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()
        self._futures: dict[int, tuple[int, int, Future]] = {}  # global step -> (epoch, step_in_epoch, plan)
        self._executor: Executor | None = None
        self._source_tokens: int | None = None
        self._valid_lengths: np.ndarray | None = None
        self.epoch = 0
        self.step_in_epoch = 0
        self.step = 0
        if self._get_epoch(0).num_steps == 0:
            raise ValueError(f"{self.source.describe()} has no tokens to train on "
                             f"({self._get_epoch(0).stats.empty} empty docs)")

    @staticmethod
    def _plan_config(policy: str, world_size: int, seed: int, extra: Any) -> PlanConfig:
        if isinstance(extra, PlanConfig):
            if extra.world_size != world_size or extra.policy != policy:
                raise ValueError(f"plan_config has policy '{extra.policy}' and world_size {extra.world_size}, "
                                 f"the loader '{policy}' and {world_size}; make them agree")
            return extra
        extra = dict(extra or {})
        bad = sorted(set(extra) - set(_PLAN_CONFIG_KEYS))
        if bad:
            raise ValueError(f"plan_config: unknown key(s) {bad}; allowed: {list(_PLAN_CONFIG_KEYS)}")
        return PlanConfig(policy=policy, world_size=world_size, seed=int(seed), **extra)

    # ---- epochs and steps ------------------------------------------------
    def _get_epoch(self, epoch: int) -> _Epoch:
        ep = self._epochs.get(epoch)
        if ep is not None:
            return ep
        src = self.source
        order = epoch_order(src.num_docs, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                            shard_bounds=src.shard_bounds, window=self.shuffle_window)  # [num_docs]
        lengths = np.asarray(src.lengths[order], dtype=np.int64)  # [num_docs]
        items, stats = to_items(lengths, order, self.max_seq_len, self.long_docs)
        bounds = batch_bounds(items.lengths, self.global_batch_tokens, items.starts)  # [num_steps + 1]
        ep = _Epoch(epoch=epoch, items=items, bounds=bounds.astype(np.int64), stats=stats)
        self._epochs[epoch] = ep
        while len(self._epochs) > 3:
            self._epochs.popitem(last=False)
        if self.rank == 0:
            unusual = {k: v for k, v in stats.to_json().items() if k not in ("docs", "tokens") and v}
            msg = (f"epoch {epoch}: {stats.docs} docs, {stats.tokens} tokens, {ep.num_steps} steps "
                   f"(max_seq_len {self.max_seq_len}, long_docs={self.long_docs})")
            if unusual:
                log.warning("%s; %s", msg, ", ".join(f"{k} {v}" for k, v in unusual.items()))
            else:
                log.info("%s", msg)
        return ep

    def steps_in_epoch(self, epoch: int) -> int:
        return self._get_epoch(epoch).num_steps

    def epoch_stats(self, epoch: int) -> DocStats:
        """Empty, split, truncated and dropped docs of one epoch."""
        return self._get_epoch(epoch).stats

    def __len__(self) -> int:
        """Total steps of all ``epochs`` (not only the ones left)."""
        if self.epochs is None:
            raise TypeError("an endless BalancedLoader (epochs=None) has no length")
        return sum(self.steps_in_epoch(e) for e in range(self.epochs))

    def _finished(self, epoch: int) -> bool:
        return self.epochs is not None and epoch >= self.epochs

    def _cursor_after(self, epoch: int, s: int) -> tuple[int, int]:
        s += 1
        if s >= self._get_epoch(epoch).num_steps:
            return epoch + 1, 0
        return epoch, s

    # ---- background planning ----------------------------------------------
    def _submit(self, epoch: int, s: int, step: int) -> None:
        items = self._get_epoch(epoch).batch(s)
        if self._executor is None:
            if self.planner_workers > 0:
                # the platform's default start method; with spawn (macOS, Windows) the script's
                # entry point needs the usual ``if __name__ == "__main__":`` guard
                self._executor = ProcessPoolExecutor(self.planner_workers)
            else:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="balanced-loader-planner")
        self._futures[step] = (epoch, s, self._executor.submit(_plan_job, items, self.cost, self.config, step))

    def _schedule(self) -> None:
        """Keep plans for the current step and the next ``prefetch_steps`` in flight."""
        epoch, s, step = self.epoch, self.step_in_epoch, self.step
        for _ in range(self.prefetch_steps + 1):
            if self._finished(epoch):
                break
            if step not in self._futures:
                self._submit(epoch, s, step)
            epoch, s = self._cursor_after(epoch, s)
            step += 1

    def _plan_now(self) -> tuple[StepPlan, float]:
        t0 = time.perf_counter()
        if self.prefetch_steps == 0 and self.planner_workers == 0:
            plan = make_plan(self._get_epoch(self.epoch).batch(self.step_in_epoch), self.cost, self.config, self.step)
            return plan, time.perf_counter() - t0
        self._schedule()
        epoch, s, fut = self._futures.pop(self.step)
        assert (epoch, s) == (self.epoch, self.step_in_epoch)
        try:
            plan = fut.result()
        except BrokenProcessPool as e:
            self.close()
            raise RuntimeError(f"the planner process pool died ({e}); with the spawn start method guard the "
                               f"script with if __name__ == '__main__', or use planner_workers=0") from e
        wait = time.perf_counter() - t0
        self._schedule()  # refill behind this step
        return plan, wait

    # ---- iteration -----------------------------------------------------------
    def __iter__(self) -> BalancedLoader:
        return self

    def __next__(self) -> StepBatch:
        if self._finished(self.epoch):
            self.close()
            raise StopIteration
        ep = self._get_epoch(self.epoch)
        plan, wait = self._plan_now()
        if self.validate:
            plan.validate(self._lengths_for_validation(ep), self.cost,
                          doc_ids=np.unique(ep.batch(self.step_in_epoch).doc_ids))
        batch = StepBatch(step=self.step, epoch=self.epoch, step_in_epoch=self.step_in_epoch, plan=plan,
                          microbatches=tuple(self.microbatches(plan, self.rank)),
                          num_valid_tokens=num_valid_tokens(plan), planner_wait_s=wait, doc_stats=ep.stats,
                          rank=self.rank)
        self.epoch, self.step_in_epoch = self._cursor_after(self.epoch, self.step_in_epoch)
        self.step += 1
        return batch

    def microbatches(self, plan: StepPlan, rank: int) -> list[Microbatch]:
        """Any rank's microbatches of a plan (a whole cluster can be materialized in one process)."""
        src = self.source if self.source.has_tokens else None
        return materialize_rank(plan, rank, src, cp_inner=self.cp_inner, pad_id=self.pad_id)

    def _lengths_for_validation(self, ep: _Epoch) -> np.ndarray:
        if self.long_docs != "truncate" or ep.stats.truncated == 0:
            return self.source.lengths
        if self._valid_lengths is None:
            self._valid_lengths = np.minimum(self.source.lengths, self.max_seq_len)
        return self._valid_lengths

    # ---- resume ------------------------------------------------------------------
    def _source_num_tokens(self) -> int:
        if self._source_tokens is None:
            self._source_tokens = int(np.asarray(self.source.lengths).sum())
        return self._source_tokens

    def _identity(self) -> dict[str, Any]:
        return {"policy": self.policy, "world_size": self.world_size, "seed": self.seed,
                "global_batch_tokens": self.global_batch_tokens, "max_seq_len": self.max_seq_len,
                "long_docs": self.long_docs, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                "tp": self.config.tp, "pp": self.config.pp, "cp": self.config.cp,
                "num_docs": self.source.num_docs, "num_tokens": self._source_num_tokens(),
                # a hash of the lengths in doc order (computed once; a shard folder's comes from index.json):
                # a permuted or edited dataset with the same totals is a different source
                "lengths_fingerprint": self.source.fingerprint()}

    def state_dict(self) -> dict[str, Any]:
        """The cursor and everything the remaining steps depend on (plain JSON-able values)."""
        return {"format": STATE_FORMAT, "version": STATE_VERSION, **self._identity(),
                "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was saved; refuses a state of a different setup."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a BalancedLoader state: expected \"format\": \"{STATE_FORMAT}\"")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not supported "
                             f"(this loader knows {STATE_VERSION})")
        mine = self._identity()
        if "lengths_fingerprint" not in state:  # a state saved before fingerprints: counts are all it has
            log.warning("the loader state has no lengths fingerprint (saved by an older version); the source "
                        "is checked by its doc and token counts only")
            mine.pop("lengths_fingerprint")
        for key in ("world_size", "policy"):
            if state.get(key) != mine[key]:
                raise ValueError(f"the loader state was saved with {key}={state.get(key)!r} but this loader "
                                 f"has {key}={mine[key]!r}; exact resume needs the same {key} (start a "
                                 f"fresh loader from an epoch boundary to change it)")
        for key, value in mine.items():
            if state.get(key) != value:
                what = ("the source changed" if key.startswith(("num_", "lengths_"))
                        else "the loader config changed")
                raise ValueError(f"the loader state was saved with {key}={state.get(key)!r} but this loader "
                                 f"has {key}={value!r} ({what}); exact resume needs the same setup")
        cursor = []
        for key in ("epoch", "step_in_epoch", "step"):
            v = state.get(key)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"malformed loader state: the cursor's {key!r} must be an integer >= 0, got "
                                 f"{v!r}; pass a dict from BalancedLoader.state_dict()")
            cursor.append(int(v))
        epoch, s, step = cursor
        if self.epochs is not None and (epoch > self.epochs or (epoch == self.epochs and s)):
            raise ValueError(f"loader state cursor (epoch {epoch}, step {s}) is past the last of this "
                             f"loader's {self.epochs} epoch(s)")
        if step < s or (epoch == 0 and step != s):
            raise ValueError(f"malformed loader state: global step {step} cannot be step {s} of epoch {epoch}")
        if s and s >= self._get_epoch(epoch).num_steps:
            raise ValueError(f"loader state cursor (epoch {epoch}, step {s}) is outside the epoch")
        self._cancel()
        self.epoch, self.step_in_epoch, self.step = epoch, s, step

    # ---- shutdown ------------------------------------------------------------------
    def _cancel(self) -> None:
        for _, _, fut in self._futures.values():
            fut.cancel()
        self._futures.clear()

    def close(self) -> None:
        """Stop the background planner (iteration restarts it when needed)."""
        self._cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> BalancedLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_executor", None) is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> str:
        fields_ = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}" for f in fields(self.config)
                            if getattr(self.config, f.name) not in (None, {}))
        return (f"BalancedLoader({self.source.describe()}, rank {self.rank}/{self.world_size}, "
                f"{self.global_batch_tokens} tokens/step, max_seq_len {self.max_seq_len}, {fields_})")
