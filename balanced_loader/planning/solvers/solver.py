"""One place that calls HiGHS (``scipy.optimize.milp``) and says what happened.

Determinism: HiGHS's branch and bound is deterministic for a fixed problem and fixed
limits, so the policies bound each solve by a *node limit* (deterministic work) and keep
the wall-clock ``time_limit`` only as a safety net. :class:`MilpResult` says which limit
ended the search, so a policy can record a time-limit hit (the one non-deterministic event)
in ``StepPlan.notes``. A missing or failing solver never raises: the result has ``x=None``
and a ``note``, and the caller falls back to its greedy plan.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

_WARNED: set[str] = set()


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpResult:
    """Outcome of one solve: the incumbent (or ``None``) and how the search ended."""

    x: np.ndarray | None  # [num_vars] incumbent, integral entries rounded
    objective: float  # objective of ``x`` (inf without one)
    optimal: bool  # solved to optimality (within ``rel_gap``)
    time_limit_hit: bool  # the wall-clock safety limit ended the search (not deterministic)
    node_limit_hit: bool  # the deterministic node limit ended the search
    infeasible: bool = False  # proven infeasible
    nodes: int = 0  # branch-and-bound nodes HiGHS explored
    seconds: float = 0.0  # wall time of the solve
    note: str = ""  # why there is no incumbent, or ""


def warn_once(message: str) -> None:
    """A ``RuntimeWarning`` the first time ``message`` is seen in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def reset_warnings() -> None:
    """Forget the messages :func:`warn_once` has shown (each warns again once; for tests)."""
    _WARNED.clear()


def solve_milp(c: np.ndarray, integrality: np.ndarray, lb: np.ndarray, ub: np.ndarray,
               rows: tuple[np.ndarray, np.ndarray, np.ndarray], row_lo: np.ndarray, row_hi: np.ndarray, *,
               time_limit_s: float, node_limit: int | None, rel_gap: float = 1e-4,
               highs_options: dict[str, float | int | bool] | None = None) -> MilpResult:
    """Minimize ``c @ x`` subject to ``row_lo <= A x <= row_hi`` and bounds, with HiGHS.

    ``rows`` is the sparse matrix as coordinates ``(row, col, value)``. Never raises for a
    solver problem: a missing scipy, an infeasible model or a limit without incumbent all
    return ``x=None`` with a ``note``.
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as e:  # scipy is a dependency; this is for broken installs
        note = f"HiGHS solver unavailable (scipy.optimize.milp: {e}); greedy fallback"
        warn_once(note)
        return MilpResult(x=None, objective=float("inf"), optimal=False, time_limit_hit=False,
                          node_limit_hit=False, note=note)
    r, col, val = rows
    a = coo_matrix((val, (r, col)), shape=(len(row_lo), len(c))).tocsr()
    options: dict[str, float | int | bool] = {"time_limit": float(time_limit_s), "mip_rel_gap": float(rel_gap),
                                              "presolve": True}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    options.update(highs_options or {})
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # scipy warns that extra options go to HiGHS verbatim
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            res = milp(c, integrality=integrality, bounds=Bounds(lb, ub),
                       constraints=LinearConstraint(a, row_lo, row_hi), options=options)
    except Exception as e:  # any solver crash becomes a fallback, never a crash
        note = f"HiGHS failed ({type(e).__name__}: {e}); greedy fallback"
        warn_once(note)
        return MilpResult(x=None, objective=float("inf"), optimal=False, time_limit_hit=False,
                          node_limit_hit=False, note=note)
    seconds = time.perf_counter() - t0
    nodes = int(getattr(res, "mip_node_count", 0) or 0)
    msg = str(getattr(res, "message", ""))
    time_hit = "Time limit" in msg
    node_hit = res.status in (1, 4) and not time_hit and ("limit" in msg.lower())
    x = getattr(res, "x", None)
    if x is None or res.status not in (0, 1, 4) or (res.status == 4 and not node_hit):
        why = "time limit" if time_hit else ("node limit" if node_hit else msg.split(".")[0] or "no solution")
        return MilpResult(x=None, objective=float("inf"), optimal=False, time_limit_hit=time_hit,
                          node_limit_hit=node_hit, infeasible=res.status == 2, nodes=nodes, seconds=seconds,
                          note=f"MILP without solution ({why})")
    x = np.asarray(x, dtype=np.float64).copy()
    integ = np.asarray(integrality) > 0
    x[integ] = np.round(x[integ])
    return MilpResult(x=x, objective=float(c @ x), optimal=res.status == 0, time_limit_hit=time_hit,
                      node_limit_hit=node_hit, nodes=nodes, seconds=seconds)
