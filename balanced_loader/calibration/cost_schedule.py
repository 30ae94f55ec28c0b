"""The loader's cost models over steps: which cost model plans which step, and the closed loop that feeds it.

A plan is made ahead (``prefetch_steps``) with the cost model in force for its step. A new model
(:meth:`CostSchedule.set`) applies from the first step no rank has planned yet, which every rank
knows: the loader plans exactly ``prefetch_steps`` ahead of its cursor. So plans made ahead keep the
cost they were made with, every rank switches at the same step, and a resumed loader plans each
step with the model the uninterrupted run used (the schedule is part of the loader state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from balanced_loader.calibration.calibrator import CalibrationOptions, Calibrator, Update, for_world
from balanced_loader.calibration.samples import MAX_STEP, Samples, agree_cost, gather_samples
from balanced_loader.cost import CostModel


class CostSchedule:
    """``[(from_step, cost model)]`` in step order, and the optional :class:`Calibrator` that extends it."""

    def __init__(self, cost: CostModel, world_size: int, calibrate: Any = False) -> None:
        self.entries: list[tuple[int, CostModel]] = [(0, cost)]
        self.world_size = world_size
        self.calibrator = None if calibrate is False or calibrate is None else \
            Calibrator(cost, world_size, CalibrationOptions.of(calibrate))

    def at(self, step: int) -> CostModel:
        """The cost model that plans ``step``."""
        out = self.entries[0][1]
        for first, cost in self.entries:
            if first > step:
                break
            out = cost
        return out

    def set(self, cost: CostModel, from_step: int) -> int:
        """Plan steps ``>= from_step`` with ``cost`` (replacing later entries); returns ``from_step``."""
        if not isinstance(cost, CostModel):
            raise ValueError(f"set_cost needs a CostModel, got {type(cost).__name__}")
        self.entries = [e for e in self.entries if e[0] < from_step] + [(int(from_step), cost)]
        return int(from_step)

    def observe(self, step: int, samples: Samples, from_step: int, *, gathered: bool,
                agree: Callable[[CostModel], CostModel] | None = None, comm: Any = None,
                world_size: int = 1) -> Update | None:
        """One step's samples into the calibrator; a new cost model from ``from_step`` when it fits.

        ``gathered``: ``samples`` already hold every rank's (the same on every rank); else this rank's,
        all-gathered here through ``comm`` (the loop's collectives, e.g. ``torch.distributed``; needed when
        ``world_size`` > 1), and the fit of rank 0 is the one every rank uses (``agree``, default
        :func:`agree_cost` through ``comm``)."""
        if not gathered and comm is None and world_size > 1:
            raise ValueError(f"observe() on {world_size} ranks needs every rank's samples: pass comm=torch.distributed "
                             f"(or the samples all-gathered, with gathered=True); each rank fitting its own would "
                             f"plan differently")
        if self.calibrator is None:
            raise ValueError("observe() feeds the closed loop: create the loader with calibrate=True "
                             "(or a mapping of calibration options)")
        if not isinstance(samples, Samples):
            raise ValueError(f"observe() needs Samples (e.g. MicrobatchTimer.samples()), got "
                             f"{type(samples).__name__}")
        up = self.calibrator.observe(int(step), samples if gathered else gather_samples(samples, comm))
        if up is None:
            return None
        cost = (agree or (lambda c: c if gathered else agree_cost(c, comm)))(up.cost)
        self.calibrator.cost = cost
        self.set(cost, from_step)
        return up

    # ---- loader state ------------------------------------------------------------------
    def state_dict(self, step: int) -> dict[str, Any]:
        """The entries that plan ``step`` and later ones, and the calibrator's state."""
        keep = [e for e in self.entries if e[0] > step]
        current = [e for e in self.entries if e[0] <= step][-1:]
        out: dict[str, Any] = {"costs": [[first, cost.to_dict()] for first, cost in current + keep]}
        if self.calibrator is not None:
            out["calibration"] = self.calibrator.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (a state without it keeps the loader's own cost model).

        Checked whole before anything changes: ``costs`` is a list of ``[from_step, cost model]`` with
        increasing steps and models that parse (lane speeds and class maps for this world when it is the
        saved one), and the calibration state (:meth:`Calibrator.load_state_dict`)."""
        raw = state.get("costs")
        entries = None
        if raw is not None and (self.calibrator is not None or (isinstance(raw, list) and len(raw) > 1)):
            entries = self._entries(raw, state.get("world_size"))
        if self.calibrator is not None and state.get("calibration") is not None:
            self.calibrator.load_state_dict(state["calibration"])
        if entries:
            self.entries = [(0, entries[0][1])] + entries[1:]  # the first one plans every earlier step

    def _entries(self, raw: Any, saved: Any) -> list[tuple[int, CostModel]]:
        bad = "malformed loader state: costs"
        if not isinstance(raw, list):
            raise ValueError(f"{bad} must be a list of [from_step, cost model], got {type(raw).__name__}")
        entries: list[tuple[int, CostModel]] = []
        for i, e in enumerate(raw):
            if not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[1], dict):
                raise ValueError(f"{bad}: entry {i} must be [from_step, cost model mapping], got {str(e)[:60]}")
            first = e[0]
            if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < MAX_STEP or (
                    entries and first <= entries[-1][0]):
                raise ValueError(f"{bad}: entry {i} starts at step {str(first)[:40]}; steps must be integers that "
                                 f"increase")
            try:
                cost = CostModel.from_dict(e[1], where=f"loader state: cost from step {first}")
            except (TypeError, KeyError, AttributeError) as err:
                raise ValueError(f"{bad}: the cost from step {first} is malformed ({type(err).__name__}: {err})") \
                    from None
            except ValueError as err:
                raise ValueError(f"{bad}: {err}") from None
            if saved is not None and saved != self.world_size:  # per-rank keys are this world's
                cost = for_world(cost, self.entries[0][1], "loader state")
            else:
                try:
                    cost.rank_speeds(self.world_size)
                    cost.rank_class_index(self.world_size)
                except ValueError as err:
                    raise ValueError(f"{bad}: the cost from step {first}: {err}") from None
            entries.append((first, cost))
        return entries
