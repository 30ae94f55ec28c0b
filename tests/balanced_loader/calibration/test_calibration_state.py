"""Reliability III (issue 38), calibration: a saved state is checked field by field before anything changes
(a checkpoint naming rank 99, a history that is a string, no cost, negative times, rank -1, lane speeds of
ranks outside the world: one line each, never a traceback at the next fit); samples with zero, tiny or
huge times are dropped and counted; samples of steps outside the window are ignored."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from balanced_loader import BalancedLoader
from balanced_loader.calibration import CalibrationOptions, Calibrator, Samples, sample_rows
from balanced_loader.cost import CostModel

TRUE = CostModel.from_dict({"quadratic_ms": 2e-5, "linear_ms": 0.01, "microbatch_ms": 1.5,
                            "comm_bytes_per_token": 2e5, "bandwidth_gbs": {2: 50.0}, "max_tokens_per_lane": 4096})
PRIOR = TRUE.scaled(3.0)
WORLD = 2
OPTS = CalibrationOptions(every=2, first=2, window=4)


def _step(step: int, rng, *, scale: float = 1.0, world: int = WORLD) -> Samples:
    """Every rank's samples of one step: the true model's times (1% noise), times ``scale``."""
    parts = []
    for r in range(world):
        groups = [(1, 1, int(rng.choice([1, 2])), 1, rng.integers(16, 2000, int(rng.integers(1, 4))).tolist())
                  for _ in range(6)]
        comp = [TRUE.shape(1, 1).group_ms(g[4], g[2]) * (1 + rng.normal(0, 0.01)) * scale for g in groups]
        parts.append(sample_rows(step, r, groups, comp, comp))
    return Samples.concat(parts)


@pytest.fixture(scope="module")
def state():
    cal = Calibrator(PRIOR, WORLD, OPTS)
    rng = np.random.default_rng(1)
    for s in range(4):
        cal.observe(s, _step(s, rng))
    return json.loads(json.dumps(cal.state_dict()))


def _with(state, path, value):
    d = copy.deepcopy(state)
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


RANK = 1  # the column of a sample row that holds its rank
CASES = {
    "window names rank 99": (("window", "rows", 0, RANK), 99, r"window: row 0 has rank 99; expected a rank of the "
                                                              r"world \(0..1\)"),
    "window names rank -1": (("window", "rows", 0, RANK), -1, "row 0 has rank -1"),
    "negative compute time": (("window", "rows", 0, 8), -5.0, "row 0 has compute_ms -5.0; expected a finite number"),
    "a string in a row": (("window", "rows", 0, 8), "fast", "row 0 must be a list of 10 numbers"),
    "a fractional rank": (("window", "rows", 0, RANK), 0.5, "row 0 has rank 0.5; expected an integer"),
    "a shape the cost lacks": (("window", "rows", 0, 3), 99, r"window: shape tp=1, pp=99 is not in the cost file"),
    "tokens 1e300": (("window", "rows", 0, 6), 1e300, "row 0 has tokens 1e.300; expected at most 2..40"),
    "sumsq below tokens": (("window", "rows", 0, 7), 1.0, "row 0 has sumsq 1.0; expected between tokens"),
    "history is a string": (("history",), "fits", "history must be a list of fit reports, got str"),
    "history entry without a step": (("history", 0, "step"), KeyError, r"history\[0\].step must be an integer"),
    "no cost": (("cost",), KeyError, "missing 'cost'"),
    "a cost that does not parse": (("cost", "linear_ms"), "slow", "cost: 'linear_ms' must be a number"),
    "a cost without a key": (("cost", "linear_ms"), KeyError, "missing key 'linear_ms'"),
    "lane speed of rank 99": (("cost", "lane_speed"), {"99": 0.5}, "lane_speed lists rank 99 but the world has 2"),
    "steps_seen a float": (("steps_seen",), 4.5, "steps_seen must be an integer"),
    "speeds in use negative": (("speeds", "in_use", 0), -1.0, r"in_use\[0\] must be a positive number"),
    "speeds a string": (("speeds", "smoothed", 1), "x", r"smoothed\[1\] must be a positive number"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_calibration_state_is_one_line_and_changes_nothing(case, state):
    path, value, needle = CASES[case]
    cal = Calibrator(PRIOR, WORLD, OPTS)
    before = json.dumps(cal.state_dict())
    with pytest.raises(ValueError, match=needle):
        cal.load_state_dict(_with(state, path, value))
    assert json.dumps(cal.state_dict()) == before  # nothing half-applied
    # and the good state still resumes and fits (the cases above were: IndexError / TypeError / KeyError)
    cal.load_state_dict(state)
    rng = np.random.default_rng(9)
    ups = [cal.observe(s, _step(s, rng)) for s in range(4, 8)]
    assert any(u is not None for u in ups)


def _loader(**kw):
    return BalancedLoader(np.random.default_rng(0).integers(1, 200, 300), policy="greedy", cost=PRIOR,
                          world_size=WORLD, rank=0, global_batch_tokens=1500, max_seq_len=128,
                          calibrate={"every": 2, "first": 2}, **kw)


def test_a_loader_state_with_a_bad_calibration_or_cost_schedule_is_one_line():
    ld = _loader()
    rng = np.random.default_rng(2)
    for _s in range(4):
        b = next(ld)
        ld.observe(b, _step(b.step, rng), gathered=True)
    good = json.loads(json.dumps(ld.state_dict()))
    ld.close()
    for path, value, needle in ((("calibration", "window", "rows", 0, RANK), 99, "row 0 has rank 99"),
                                (("calibration", "history"), "x", "history must be a list"),
                                (("costs",), "x", "costs must be a list"),
                                (("costs", 0, 0), -1, "starts at step -1"),
                                (("costs", 0, 1, "lane_speed"), {"5": 0.5}, "lane_speed lists rank 5")):
        fresh = _loader()
        with pytest.raises(ValueError, match=needle):
            fresh.load_state_dict(_with(good, path, value))
        fresh.close()


@pytest.mark.parametrize("bad", [0.0, 1e-300, 1e300])
def test_zero_tiny_and_huge_times_are_dropped_and_counted_not_fitted(bad):
    rng = np.random.default_rng(3)
    clean = Calibrator(PRIOR, WORLD, CalibrationOptions(every=1, first=4, window=8))
    dirty = Calibrator(PRIOR, WORLD, CalibrationOptions(every=1, first=4, window=8))
    ups = []
    for s in range(6):
        good = _step(s, rng)
        clean.observe(s, good)
        if s == 1:  # one step of zero (or absurd) measured times: a CPU timer around asynchronous GPU work
            wrong = Samples(**{**{f: getattr(good, f) for f in good.__dataclass_fields__},
                               "compute_ms": np.full(len(good), bad), "wall_ms": np.full(len(good), bad)})
            ups.append(dirty.observe(s, wrong))
        else:
            ups.append(dirty.observe(s, good))
    fits = [u for u in ups if u is not None]
    assert fits[0].dropped == 12 and fits[0].to_json()["dropped_samples"] == 12
    assert fits[-1].error_after < 0.05  # was: quadratic and fixed cost pulled to 0, error 0.99
    assert dirty.cost.base.microbatch_ms > 0.5 * TRUE.microbatch_ms
    assert dirty.cost.base.quadratic_ms > 0.5 * TRUE.quadratic_ms


def test_samples_of_steps_outside_the_window_are_ignored():
    rng = np.random.default_rng(4)
    cal = Calibrator(PRIOR, WORLD, CalibrationOptions(every=100, first=100, window=4))
    cal.observe(0, _step(10**12, rng))  # samples that say step 10**12, observed at step 0
    assert len(cal.window) == 0 and cal.dropped == 12
    for s in range(1, 6):
        cal.observe(s, _step(s, rng))
    assert sorted(set(cal.window.step.tolist())) == [2, 3, 4, 5]
    cal.observe(10**12, _step(10**12, rng))  # a step far ahead: the earlier ones leave the window
    cal.observe(7, _step(7, rng))  # and a step far ahead does not stay forever either
    assert sorted(set(cal.window.step.tolist())) == [7]
    with pytest.raises(ValueError, match="step must be an integer in 0..2"):
        cal.observe(2**70, _step(1, rng))


def test_a_timer_in_a_process_running_cuda_work_uses_events_or_refuses(monkeypatch):
    """A CPU timer around asynchronous GPU work reads about 0 (was: MicrobatchTimer's default, cuda=False,
    on a GPU): unset, it uses CUDA events once the process has initialized CUDA; cuda=False is refused."""
    import torch

    from balanced_loader.calibration import MicrobatchTimer

    assert MicrobatchTimer(0, 0).cuda is False  # this machine: no CUDA initialized, CPU time
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert MicrobatchTimer(0, 0).cuda is True
    with pytest.raises(ValueError, match=r"cuda=False\) in a process that runs CUDA work.*pass cuda=True"):
        MicrobatchTimer(0, 0, cuda=False)
