"""Contract 4: :class:`BalancedLoader`, one :class:`StepBatch` per optimizer step on every rank.

Each rank builds the same loader (only ``rank`` differs) and computes the same things:

1. the epoch's doc order, a pure function of (seed, epoch), evaluated lazily by position
   (:class:`~balanced_loader.batches.order.EpochOrder`): shards, or blocks of doc_ids,
   permuted, and docs shuffled in windows of ``shuffle_window``;
2. global batches of *sequences* (a doc of at most ``max_seq_len`` tokens, or one ``max_seq_len``
   piece of a longer doc: :mod:`balanced_loader.batches.sequences`), cut from that order as the
   cursor reaches them: every step holds between ``global_batch_tokens - max_seq_len`` and
   ``global_batch_tokens`` tokens (the last step of a finite run may hold fewer), and the pieces
   of a long doc are shuffled like docs and may train in different steps; empty docs skipped,
   docs over ``max_seq_len`` handled by ``long_docs`` (counts in
   :class:`~balanced_loader.batches.items.DocStats`, never silent). Nothing is built over all
   docs, so memory does not grow with the source;
4. a :class:`~balanced_loader.plan.StepPlan` per batch from the policy, planned ahead in the
   background (``prefetch_steps``; a thread, or ``planner_workers`` processes);
5. this rank's microbatches (:mod:`balanced_loader.materialize`), reading only the tokens of
   its own segments.

So every rank gets the same number of steps with no collective, and ``state_dict()`` (the
cursor: epoch, step and each source's place, :class:`~balanced_loader.batches.stream.Cursor`, plus
the config the batches depend on) resumes exactly, at any world size: the batches never depend on it, only their
assignment to ranks does. ``len()``, :meth:`BalancedLoader.steps_in_epoch` and
:meth:`BalancedLoader.epoch_stats` need one streaming pass over the epoch, made on demand.
Iteration is a cursor: ``for batch in loader`` continues from the current position and stops
after ``epochs`` epochs in total (``epochs=None``: never stops); a loader that has finished
stays finished.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from balanced_loader.batches.epochs import EpochCuts
from balanced_loader.batches.items import LONG_DOC_MODES, DocStats
from balanced_loader.batches.stream import BatchStream, Cut, stream_for
from balanced_loader.calibration.cost_schedule import CostSchedule
from balanced_loader.cost import CostModel
from balanced_loader.data.mixture import MixtureSource
from balanced_loader.data.open import open_source
from balanced_loader.data.sources import Source
from balanced_loader.loader_args import (  # resolve_world: the loader's rank and world size, public here too
    check_budget_holds_a_sequence,
    check_loader_args,
    check_pad_id,
    resolve_world,
    smallest,
)
from balanced_loader.materialize import (
    Microbatch,
    materialize_rank,
    max_microbatches,
    num_valid_tokens,
    padding_microbatch,
    rank_place,
)
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning import get_policy, longest_segment, make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.presets import resolve_cost
from balanced_loader.schedule import setting

log = logging.getLogger("balanced_loader")
ORDERS = ("any", "strict")  # strict (with shuffle=False): steps follow the source order exactly

STATE_FORMAT = "balanced-loader/loader-state"
STATE_VERSION = 3  # 3: steps of sequences; the cursor holds each source's place (window, unit, offset)
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
    doc_stats: DocStats  # what this step did with empty and long docs (whole epoch: loader.epoch_stats)
    rank: int
    sequences: BatchItems  # the step's sequences (what its plan tiles; the same on every rank)
    mixture_tokens: dict[str, int] | None = None  # a mixture's tokens per source in the step (same on every rank)

    @property
    def num_tokens(self) -> int:
        """Positions (tokens plus CP padding) in this rank's microbatches."""
        return sum(mb.num_tokens for mb in self.microbatches)


def _plan_job(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    return make_plan(items, cost, config, step)


def default_max_seq_len(cost: CostModel, config: PlanConfig) -> int:
    """The longest segment ``config.policy`` can plan (:func:`balanced_loader.planning.longest_segment`)."""
    best = longest_segment(cost, config)
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

    ``rank``/``world_size`` default to the initialized process group, else ``RANK``/``WORLD_SIZE``
    (:func:`resolve_world`). ``cp=1`` (same as ``plan_config={"cp": 1}``) asks for plain data
    parallelism: every group is one lane, and every rank gets the same number of microbatches
    per step (padding microbatches where it has fewer), which is what a DDP/accelerate loop
    over a transformers model needs; ``mb.to_hf()`` gives its inputs.

    A mixture (:func:`balanced_loader.mix`) holds each source's share in every step
    (``StepBatch.mixture_tokens``); ``global_batch_tokens`` and ``max_seq_len`` may be schedules
    ``[(step, value), ...]`` (piecewise linear, constant after the last point); either way the
    batches come from a :class:`~balanced_loader.batches.stream.BatchStream` (docs/mixtures.md).
    ``order="strict"`` (with ``shuffle=False``) promises steps in the source order exactly.
    """

    def __init__(self, source: Any, *, policy: str = "hydra", cost: Any = None, world_size: int | None = None,
                 rank: int | None = None, global_batch_tokens: int, seed: int = 0, max_seq_len: int | None = None,
                 long_docs: str = "split", shuffle: bool = True, shuffle_window: int = 1 << 16,
                 epochs: int | None = 1, prefetch_steps: int = 2, planner_workers: int = 0,
                 plan_config: dict[str, Any] | PlanConfig | None = None, cp: int | None = None, cp_inner: int = 1,
                 pad_id: int = 0, validate: bool = False, order: str = "any", calibrate: Any = False) -> None:
        # every argument is checked (type, range, bounds) before the source is opened: no pass over the data
        # for a typo (balanced_loader.loader_args); the token settings may be schedules (balanced_loader.schedule)
        rank, world_size = resolve_world(rank, world_size)
        scheduled = isinstance(global_batch_tokens, (list, tuple)), isinstance(max_seq_len, (list, tuple))
        a = check_loader_args(policy=policy, global_batch_tokens=1 if scheduled[0] else global_batch_tokens,
                              seed=seed, max_seq_len=None if scheduled[1] else max_seq_len, long_docs=long_docs,
                              long_doc_modes=LONG_DOC_MODES, shuffle=shuffle, shuffle_window=shuffle_window,
                              epochs=epochs, prefetch_steps=prefetch_steps, planner_workers=planner_workers,
                              cp_inner=cp_inner, pad_id=pad_id, validate=validate)
        seed, epochs = a["seed"], a["epochs"]
        budget = setting(global_batch_tokens if scheduled[0] else a["global_batch_tokens"], "global_batch_tokens")
        if order not in ORDERS or (order == "strict" and shuffle):
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}" if order not in ORDERS
                             else "order='strict' keeps the source order: pass shuffle=False")
        limit = None if max_seq_len is None else setting(max_seq_len if scheduled[1] else a["max_seq_len"],
                                                         "max_seq_len")
        self.cost = resolve_cost(cost, world_size)
        # which cost model plans which step; calibrate=True: the closed loop (observe) extends it
        self.costs = CostSchedule(self.cost, world_size, calibrate)
        self.config = self._plan_config(policy, world_size, seed, plan_config, cp)
        get_policy(self.config.policy)  # fail now, not in the first step
        self.policy = self.config.policy
        self.world_size = world_size
        self.rank = rank
        self.seed = int(seed)
        if limit is None:  # the longest segment the policy plans, within the smallest budget of the run
            limit = setting(min(default_max_seq_len(self.cost, self.config), smallest(budget)), "max_seq_len")
        check_budget_holds_a_sequence(budget, limit)
        # each an int, or a schedule [[step, value], ...]
        self.global_batch_tokens, self.max_seq_len = budget.to_json(), limit.to_json()
        self.order = order
        self.source: Source = open_source(source)
        check_pad_id(a["pad_id"], self.source)
        self.long_docs = long_docs
        self.shuffle = bool(shuffle)
        self.shuffle_window = int(shuffle_window)
        self.epochs = epochs
        self.prefetch_steps = int(prefetch_steps)
        self.planner_workers = int(planner_workers)
        self.cp_inner = int(cp_inner)
        self.pad_id = int(pad_id)
        self.validate = bool(validate)
        self._epochs: OrderedDict[int, EpochCuts] = OrderedDict()
        self._said_small = False  # the warning that a pass is smaller than a step, said once
        # the global batches, one source or a mixture (its cursors say where steps start)
        self._stream: BatchStream = stream_for(self.source, seed=self.seed, shuffle=self.shuffle,
                                               window=self.shuffle_window, max_seq_len=limit,
                                               global_batch_tokens=budget, long_docs=long_docs, epochs=epochs)
        self._futures: dict[int, tuple[int, int, Future]] = {}  # global step -> (epoch, step_in_epoch, plan)
        self._executor: Executor | None = None
        self.epoch = 0
        self.step_in_epoch = 0
        self.step = 0
        first = self._cut(0, 0)  # reads up to the first doc with tokens
        if not len(first.items):
            raise ValueError(f"{self.source.describe()} has no tokens to train on "
                             f"({first.stats.empty} empty docs)")

    @staticmethod
    def _plan_config(policy: str, world_size: int, seed: int, extra: Any, cp: int | None) -> PlanConfig:
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            raise ValueError(f"cp must be a positive integer (1: plain data parallelism), got {cp!r}")
        if isinstance(extra, PlanConfig):
            if extra.world_size != world_size or extra.policy != policy:
                raise ValueError(f"plan_config has policy '{extra.policy}' and world_size {extra.world_size}, "
                                 f"the loader '{policy}' and {world_size}; make them agree")
            if cp is not None and extra.cp != cp:
                raise ValueError(f"cp={cp} but plan_config has cp={extra.cp}; set it in one place")
            return extra
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"plan_config must be a dict or a PlanConfig, got {type(extra).__name__}")
        extra = dict(extra or {})
        bad = sorted(set(extra) - set(_PLAN_CONFIG_KEYS))
        if bad:
            raise ValueError(f"plan_config: unknown key(s) {bad}; allowed: {list(_PLAN_CONFIG_KEYS)}")
        if cp is not None:
            if extra.get("cp", cp) != cp:
                raise ValueError(f"cp={cp} but plan_config has cp={extra['cp']}; set it in one place")
            extra["cp"] = cp
        return PlanConfig(policy=policy, world_size=world_size, seed=int(seed), **extra)

    # ---- epochs and steps ------------------------------------------------
    def _get_epoch(self, epoch: int) -> EpochCuts:
        ep = self._epochs.get(epoch)
        if ep is not None:
            self._epochs.move_to_end(epoch)
            return ep
        ep = EpochCuts(epoch, self._stream.epoch(epoch))
        self._epochs[epoch] = ep
        for old in list(self._epochs)[:-(self.prefetch_steps + 3)]:  # never the cursor's: it knows where to go on
            if old != self.epoch:
                del self._epochs[old]
        return ep

    def _cut(self, epoch: int, s: int) -> Cut:
        """Step ``s`` of ``epoch``; rank 0 logs the epoch's counts when its last step is cut."""
        ep = self._get_epoch(epoch)
        c = ep.cut(s)
        if self.rank == 0 and not ep.logged and ep.is_end(c) and len(c.items):
            ep.logged = True
            st = ep.stats if ep.stats is not None else ep.seen
            part = "" if ep.seen_from == 0 or ep.stats is not None else f" (steps {ep.seen_from}-{s})"
            unusual = {k: v for k, v in st.to_json().items() if k not in ("docs", "tokens") and v}
            msg = (f"epoch {epoch}{part}: {st.docs} docs, {st.tokens} tokens, {ep.num_steps} steps "
                   f"(max_seq_len {self.max_seq_len}, long_docs={self.long_docs})")
            budget = int(self._stream.budget.at(self.step))
            if ep.num_steps == 1 and 0 < st.tokens < budget - (self._stream.limit_at(self.step) or 0):
                if self._said_small:
                    return c  # said once: every epoch is one such step
                self._said_small = True
                # a step never holds one sequence twice: each step is one pass, short of the budget
                unusual["pass_smaller_than_a_step"] = (f"{st.tokens} tokens per pass, global_batch_tokens "
                                                       f"{budget}: every step is one pass (lower the budget)")
            if unusual:
                log.warning("%s; %s", msg, ", ".join(f"{k} {v}" for k, v in unusual.items()))
            else:
                log.info("%s", msg)
        return c

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps of one epoch (one streaming pass over the epoch the first time, unless it was consumed)."""
        ep = self._get_epoch(epoch)
        return ep.num_steps if ep.num_steps is not None else ep.summary()[0]

    def epoch_stats(self, epoch: int) -> DocStats:
        """Empty, split, truncated and dropped docs of one epoch (one streaming pass, made once)."""
        return self._get_epoch(epoch).summary()[1]

    def __len__(self) -> int:
        """Total steps of all ``epochs`` (not only the ones left); one streaming pass per epoch, made once."""
        if self.epochs is None:
            raise TypeError("an endless BalancedLoader (epochs=None) has no length")
        return sum(self.steps_in_epoch(e) for e in range(self.epochs))

    def _finished(self, epoch: int) -> bool:
        return self.epochs is not None and epoch >= self.epochs

    def _cursor_after(self, epoch: int, s: int) -> tuple[int, int]:
        if self._get_epoch(epoch).is_end(self._cut(epoch, s)):
            return epoch + 1, 0
        return epoch, s + 1

    # ---- background planning ----------------------------------------------
    def _submit(self, epoch: int, s: int, step: int) -> None:
        items = self._cut(epoch, s).items
        if self._executor is None:
            if self.planner_workers > 0:
                # the platform's default start method; with spawn (macOS, Windows) the script's
                # entry point needs the usual ``if __name__ == "__main__":`` guard
                self._executor = ProcessPoolExecutor(self.planner_workers)
            else:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="balanced-loader-planner")
        cost = self.costs.at(step)
        self._futures[step] = (epoch, s, self._executor.submit(_plan_job, items, cost, self.config, step))

    def _schedule(self, ahead: int = 0) -> None:
        """Keep plans for the current step and the next ``prefetch_steps`` in flight (from ``ahead`` steps on:
        the refill after the current step's plan was taken must not plan it again)."""
        epoch, s, step = self.epoch, self.step_in_epoch, self.step
        for _ in range(ahead):
            epoch, s = self._cursor_after(epoch, s)
            step += 1
        for _ in range(self.prefetch_steps + 1 - ahead):
            if self._finished(epoch):
                break
            if step not in self._futures:
                self._submit(epoch, s, step)
            epoch, s = self._cursor_after(epoch, s)
            step += 1

    def _plan_now(self) -> tuple[StepPlan, float]:
        t0 = time.perf_counter()
        if self.prefetch_steps == 0 and self.planner_workers == 0:
            plan = make_plan(self._cut(self.epoch, self.step_in_epoch).items, self.costs.at(self.step), self.config,
                             self.step)
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
        if not self._finished(self.epoch):
            self._schedule(ahead=1)  # refill behind this step
        return plan, wait

    # ---- iteration -----------------------------------------------------------
    def __iter__(self) -> BalancedLoader:
        return self

    def __next__(self) -> StepBatch:
        if self._finished(self.epoch):
            self.close()
            raise StopIteration
        cut = self._cut(self.epoch, self.step_in_epoch)
        plan, wait = self._plan_now()
        if self.validate:
            plan.validate(cut.items, self.costs.at(self.step))
        batch = StepBatch(step=self.step, epoch=self.epoch, step_in_epoch=self.step_in_epoch, plan=plan,
                          microbatches=tuple(self.microbatches(plan, self.rank)),
                          num_valid_tokens=num_valid_tokens(plan), planner_wait_s=wait, doc_stats=cut.stats,
                          rank=self.rank, sequences=cut.items, mixture_tokens=cut.mixture_tokens)
        self.epoch, self.step_in_epoch = self._cursor_after(self.epoch, self.step_in_epoch)
        self.step += 1
        self._get_epoch(self.epoch).forget_before(self.step_in_epoch)
        return batch

    # ---- the closed loop ------------------------------------------------------
    def set_cost(self, cost: CostModel) -> int:
        """Plan with ``cost`` from the first step not planned yet (returned, the same on every rank)."""
        return self.costs.set(cost, self.step + self.prefetch_steps)

    def observe(self, step: Any, samples: Any, *, comm: Any = None, gathered: bool = False, agree: Any = None) -> Any:
        """Measured microbatches of a step (``calibrate=True``): every few steps a fitted cost model with
        lane speeds plans the steps not planned yet (:meth:`balanced_loader.calibration.CostSchedule.observe`);
        returns the fit's :class:`~balanced_loader.calibration.Update` or None. ``comm``: the loop's
        collectives (``torch.distributed``) that gather every rank's samples, needed on several ranks unless
        the samples are ``gathered`` already."""
        return self.costs.observe(getattr(step, "step", step), samples, self.step + self.prefetch_steps,
                                  gathered=gathered, agree=agree, comm=comm, world_size=self.world_size)

    def microbatches(self, plan: StepPlan, rank: int) -> list[Microbatch]:
        """Any rank's microbatches of a plan (a whole cluster can be materialized in one process).

        Under ``cp=1`` (plain data parallelism) every rank gets the step's largest count: a rank
        with fewer groups gets padding microbatches (one pad token, no label) at the end, so a
        DDP loop runs the same number of forward/backward passes everywhere (no collective: the
        count comes from the plan, which every rank has).
        """
        src = self.source if self.source.has_tokens else None
        out = materialize_rank(plan, rank, src, cp_inner=self.cp_inner, pad_id=self.pad_id)
        if self.config.cp == 1:
            want = max_microbatches(plan)
            if len(out) < want:
                place = rank_place(plan, rank)
                out += [padding_microbatch(place, lane=place.lane, pad_id=self.pad_id) for _ in range(want - len(out))]
        return out

    # ---- resume ------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {"policy": self.policy, "seed": self.seed,
                "global_batch_tokens": self.global_batch_tokens, "max_seq_len": self.max_seq_len,
                "long_docs": self.long_docs, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                "tp": self.config.tp, "pp": self.config.pp, "cp": self.config.cp,
                # only where set (states saved without them stay loadable)
                **({"order": self.order} if self.order != "any" else {}),
                **({"mixture": {"by": self.source.by, "weights": self.source.weights.to_json()}}
                   if isinstance(self.source, MixtureSource) else {}),
                "num_docs": self.source.num_docs, "num_tokens": int(self.source.num_tokens),  # cached by the source
                # a hash of the lengths in doc order (computed once; a shard folder's comes from index.json):
                # a permuted or edited dataset with the same totals is a different source
                "lengths_fingerprint": self.source.fingerprint(),
                # and of the tokens (a shard folder's: its shards' crc32s): same lengths, other tokens differ too
                "tokens_fingerprint": self.source.tokens_fingerprint()}

    def state_dict(self) -> dict[str, Any]:
        """The cursor and everything the remaining batches depend on (plain JSON-able values).

        The cursor is (epoch, step in the epoch, global step, and where the next step starts: each
        source's place, with the epoch's first cursor so that its summary needs no replay);
        ``world_size`` is recorded for information only: a state loads at any world size and continues
        the same global batches.
        """
        names = self._stream.cursor_names
        cur = None if self._finished(self.epoch) else self._get_epoch(self.epoch).starts[self.step_in_epoch]
        position = {"cursor": cur.to_json(names) if cur is not None else None,
                    "epoch_start": self._stream.epoch_start(self.epoch).to_json(names)}
        return {"format": STATE_FORMAT, "version": STATE_VERSION, **self._identity(), "world_size": self.world_size,
                "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "step": self.step, "position": position,
                **self.costs.state_dict(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was saved, at this loader's world size; refuses a different setup."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a BalancedLoader state: expected \"format\": \"{STATE_FORMAT}\"")
        if state.get("version") != STATE_VERSION:
            older = (" (saved by an older version, whose steps were cut between docs: its steps cannot be "
                     "continued exactly; start a fresh loader, e.g. with skip of the steps already trained)"
                     if state.get("version") in (1, 2) else "")
            raise ValueError(f"loader state version {state.get('version')} is not supported "
                             f"(this loader knows {STATE_VERSION}){older}")
        mine = self._identity()
        for key in ("lengths_fingerprint", "tokens_fingerprint"):
            if key not in state:  # a state saved before this fingerprint: what it has is all it can check
                log.warning("the loader state has no %s (saved by an older version); the source is checked "
                            "without it", key)
                mine.pop(key)
        for key in ("policy",):
            if state.get(key) != mine[key]:
                raise ValueError(f"the loader state was saved with {key}={state.get(key)!r} but this loader "
                                 f"has {key}={mine[key]!r}; exact resume needs the same {key} (start a "
                                 f"fresh loader from an epoch boundary to change it)")
        for key, value in mine.items():
            if state.get(key) != value:
                what = ("the source changed" if key.startswith(("num_", "lengths_", "tokens_"))
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
        # each source's place, checked against the sources and replayed from the epoch's first step
        pos = self._stream.load(state.get("position"), epoch=epoch, step_in_epoch=s, step=step,
                                finished=self._finished(epoch))
        self.costs.load_state_dict(state)
        self._cancel()
        self._epochs.clear()  # cut afresh from the saved position
        if not self._finished(epoch):
            self._get_epoch(epoch).starts = {s: pos}
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
        # may run at interpreter exit, when the executor's machinery is half torn down: best effort, silent
        ex = getattr(self, "_executor", None)
        if ex is not None:
            self._executor = None
            try:  # noqa: SIM105 - contextlib may already be torn down
                ex.shutdown(wait=False, cancel_futures=True)
            except Exception:
                pass

    # ---- accelerate / torch DataLoader interop ------------------------------------
    # what accelerate's skip_first_batches reads off a DataLoader (its defaults would not fit a stream)
    batch_size = None  # one StepBatch per item: nothing for a DataLoader to collate
    drop_last = False
    num_workers = 0  # planning and reading run in the loader itself
    prefetch_factor = None

    @property
    def dataset(self) -> Any:
        """A torch ``IterableDataset`` that continues this loader from its cursor.

        It lets ``accelerator.skip_first_batches(loader, n)`` work: accelerate wraps it in a
        ``DataLoader`` that plans and reads the ``n`` skipped steps and drops them. To resume
        without that work, save ``loader.state_dict()`` and ``load_state_dict`` it instead.
        """
        from balanced_loader.dataset_view import iterable_view

        return iterable_view(self)

    def describe(self) -> str:
        fields_ = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}" for f in fields(self.config)
                            if getattr(self.config, f.name) not in (None, {}))
        return (f"BalancedLoader({self.source.describe()}, rank {self.rank}/{self.world_size}, "
                f"{self.global_batch_tokens} tokens/step, max_seq_len {self.max_seq_len}, {fields_})")
