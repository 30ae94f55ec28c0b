"""Online calibration with injected timings: the robust fit recovers known contract-2 coefficients, per-rank
speeds follow wall time with hysteresis (no oscillation) on a grid, options are checked, and the
calibrator's state resumes exactly (and at another world size keeps the coefficients)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from balanced_loader.calibration import CalibrationOptions, Calibrator, Samples, sample_rows
from balanced_loader.calibration.fit import FitSettings, coefficients, features, fit_model, fit_shape, predict
from balanced_loader.calibration.speeds import SpeedTracker, raw_speeds
from balanced_loader.cost import CostModel

TRUE = CostModel.from_dict({
    "quadratic_ms": 2e-5, "linear_ms": 0.01, "microbatch_ms": 1.5, "comm_bytes_per_token": 2e5,
    "bandwidth_gbs": {2: 50.0, 4: 20.0}, "max_tokens_per_lane": 4096,
    "strategies": [{"tp": 2, "pp": 1, "quadratic_ms": 1e-5, "linear_ms": 0.006, "microbatch_ms": 1.0}]})
PRIOR = TRUE.scaled(3.0)  # every time key 3x off


def _groups(rng, n: int, *, degrees=(1, 2, 4), tp: int = 1, single_length: int | None = None):
    """``n`` random groups ``(tp, pp, degree, cp_inner, lengths)``: 1-4 docs of 16-2,000 tokens."""
    out = []
    for _ in range(n):
        k = 1 if single_length else int(rng.integers(1, 5))
        lens = [single_length] * k if single_length else rng.integers(16, 2000, k).tolist()
        out.append((tp, 1, int(rng.choice(degrees)), 1, lens))
    return out


def _true_ms(groups, model: CostModel = TRUE) -> list[float]:
    return [model.shape(tp, pp).group_ms(lens, d) / pp for tp, pp, d, _, lens in groups]


def _samples(groups, compute, wall=None, *, step: int = 0, rank: int = 0) -> Samples:
    return sample_rows(step, rank, groups, compute, compute if wall is None else wall)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_fit_recovers_known_coefficients_from_a_prior_3x_off():
    rng = np.random.default_rng(0)
    groups = _groups(rng, 300)
    meas = np.asarray(_true_ms(groups)) * (1 + rng.normal(0, 0.02, len(groups)))  # 2% noise
    s = _samples(groups, meas.tolist())
    before = predict(PRIOR, s)
    assert np.median(np.abs(before - meas) / meas) > 1.5  # the prior is far off
    model, rep = fit_model(PRIOR, s, FitSettings())
    err = np.abs(predict(model, s) - meas) / meas
    assert np.median(err) <= 0.05 and rep["1x1"].kind == "fit" and rep["1x1"].error_after <= 0.05
    got, want = coefficients(model.base), coefficients(TRUE.base)
    for name, g, w in zip(("microbatch_ms", "quadratic_ms", "linear_ms", "comm_bytes_per_token"), got, want):
        assert _rel(g, w) <= 0.1, (name, g, w)
    # a shape without samples is rescaled by the fitted shapes' change (about 1/3 here); caps are kept
    tp2, true2 = model.shape(2, 1), TRUE.shape(2, 1)
    assert _rel(tp2.linear_ms, true2.linear_ms) <= 0.1 and tp2.max_tokens_per_lane == true2.max_tokens_per_lane
    assert model.bandwidth_gbs == TRUE.bandwidth_gbs


def test_outliers_are_dropped():
    rng = np.random.default_rng(1)
    groups = _groups(rng, 200)
    meas = np.asarray(_true_ms(groups)) * (1 + rng.normal(0, 0.01, len(groups)))
    bad = rng.choice(len(groups), 10, replace=False)  # 5%: a preempted microbatch, 10x its time
    meas[bad] *= 10
    _, rep_kept = fit_model(PRIOR, _samples(groups, meas.tolist()), FitSettings(outlier_mad=1e3))
    model, rep = fit_model(PRIOR, _samples(groups, meas.tolist()), FitSettings())
    assert rep["1x1"].dropped >= len(bad) and rep_kept["1x1"].dropped == 0
    good = np.setdiff1d(np.arange(len(groups)), bad)
    clean = _samples([groups[i] for i in good], meas[good].tolist())
    err = np.abs(predict(model, clean) - clean.compute_ms) / clean.compute_ms
    assert np.median(err) <= 0.02
    assert _rel(model.linear_ms, TRUE.linear_ms) <= 0.05


def test_a_column_without_signal_keeps_the_prior():
    rng = np.random.default_rng(2)
    groups = _groups(rng, 100, degrees=(1,))  # every group on one lane: no CP communication measured
    s = _samples(groups, _true_ms(groups))
    model, _ = fit_model(PRIOR, s, FitSettings())
    assert _rel(model.linear_ms, TRUE.linear_ms) <= 0.02
    # comm_bytes_per_token cannot be seen: it keeps the prior's value rescaled to the level seen, never 0
    assert model.comm_bytes_per_token > 0
    assert _rel(model.comm_bytes_per_token, TRUE.comm_bytes_per_token) <= 0.1
    # all docs of one length: sum s^2 is a multiple of sum s; the fit still predicts, and no key is negative
    one = _groups(rng, 50, single_length=512)
    m1, _ = fit_model(PRIOR, _samples(one, _true_ms(one)), FitSettings())
    pred = predict(m1, _samples(one, _true_ms(one)))
    assert np.allclose(pred, _true_ms(one), rtol=0.02)
    assert min(coefficients(m1.base)) >= 0


def test_few_samples_only_rescale():
    rng = np.random.default_rng(3)
    groups = _groups(rng, 5)
    model, rep = fit_model(PRIOR, _samples(groups, _true_ms(groups)), FitSettings(min_samples=8))
    assert rep["1x1"].kind == "scale" and rep["1x1"].samples == 5
    ratio = rep["1x1"].ratio
    assert 0.2 < ratio < 0.5  # measured / predicted with a prior 3x off
    assert coefficients(model.base) == pytest.approx(coefficients(PRIOR.base) * ratio)


# ---- speeds ------------------------------------------------------------------------------------


def test_raw_speed_is_predicted_over_wall():
    rng = np.random.default_rng(4)
    groups = _groups(rng, 8, degrees=(1,))
    comp = _true_ms(groups)
    s = Samples.concat([_samples(groups, comp, step=0, rank=0),
                        _samples(groups, comp, [2 * c for c in comp], step=0, rank=1)])
    raw = raw_speeds(s, predict(TRUE, s), 3)
    assert raw[0] == pytest.approx(1.0) and raw[1] == pytest.approx(0.5) and np.isnan(raw[2])


def test_speeds_move_beyond_hysteresis_only_and_on_the_grid():
    t = SpeedTracker(3, smoothing=0.5, hysteresis=0.1, quantum=0.05)
    assert t.update(np.array([1.0, 0.5, np.nan])) and t.in_use.tolist() == [1.0, 0.5, 1.0]
    # noise within the hysteresis never changes the speeds in use (no oscillation)
    rng = np.random.default_rng(5)
    for _ in range(50):
        noisy = np.array([1.0, 0.5, 1.0]) * (1 + rng.uniform(-0.08, 0.08, 3))
        assert not t.update(noisy)
        assert t.in_use.tolist() == [1.0, 0.5, 1.0]
    # a real change moves it, smoothed, to the nearest multiple of the quantum (relative to the fastest)
    t2 = SpeedTracker(2, smoothing=1.0, hysteresis=0.1, quantum=0.05)
    assert t2.update(np.array([1.0, 0.537])) and t2.in_use.tolist() == [1.0, 0.55]
    assert t2.update(np.array([1.0, 0.001])) and t2.in_use.tolist() == [1.0, 0.05]  # never below one quantum
    assert t2.update(np.array([2.0, 1.0])) and t2.in_use.tolist() == [1.0, 0.5]  # speeds are relative
    t3 = SpeedTracker(2, smoothing=0.5, hysteresis=0.1, quantum=0.05)
    t3.update(np.array([1.0, 1.0]))
    assert not t3.update(np.array([1.0, 0.85]))  # smoothed 0.925: within 10% of 1
    assert t3.update(np.array([1.0, 0.6]))  # smoothed 0.7625 -> 0.75
    assert t3.in_use.tolist() == [1.0, 0.75]
    # a rank that recovers returns to exactly the speed of the fastest (not stuck one quantum below)
    for _ in range(8):
        t3.update(np.array([1.0, 1.0]))
    assert t3.in_use.tolist() == [1.0, 1.0]
    t4 = SpeedTracker(1, smoothing=1.0, hysteresis=0.1, quantum=0.05)
    assert not t4.update(np.array([0.5])) and t4.in_use.tolist() == [1.0]  # one rank: nothing to balance
    with pytest.raises(ValueError, match="speeds for 2 ranks"):
        t3.load_state_dict({"smoothed": [1.0], "in_use": [1.0]})
    with pytest.raises(ValueError, match="positive"):
        t3.load_state_dict({"smoothed": [None, None], "in_use": [0.0, 1.0]})


# ---- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, needle", [
    ({"window": 0}, "'window' must be an integer in 1.."),
    ({"every": 0}, "'every' must be an integer in 1.."),
    ({"first": -1}, "'first' must be an integer"),
    ({"every": "2"}, "'every' must be an integer"),
    ({"every": 2.0}, "'every' must be an integer"),
    ({"every": True}, "'every' must be an integer"),
    ({"speeds": "yes"}, "'speeds' must be true or false"),
    ({"speed_smoothing": float("nan")}, "'speed_smoothing'"),
    ({"speed_quantum": 0}, "'speed_quantum'"),
    ({"speed_hysteresis": -0.1}, "'speed_hysteresis'"),
    ({"windw": 4}, "windw"),
    ("yes", "calibrate must be True, a mapping"),
    (4, "calibrate must be True, a mapping"),
])
def test_bad_calibration_options_are_one_line(value, needle):
    with pytest.raises(ValueError) as e:
        CalibrationOptions.of(value)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_good_calibration_options():
    assert CalibrationOptions.of(True) == CalibrationOptions()
    o = CalibrationOptions.of({"every": 3, "window": 5, "speeds": False})
    assert (o.every, o.window, o.speeds) == (3, 5, False) and CalibrationOptions.of(o) is o


# ---- the calibrator ------------------------------------------------------------------------------

WORLD = 4
SPEED = [1.0, 1.0, 0.5, 1.0]


def _step_samples(step: int, rng) -> Samples:
    """Every rank's samples of one step: compute the true model's, wall = compute / speed, 1% noise."""
    parts = []
    for r in range(WORLD):
        groups = _groups(rng, 6, degrees=(1, 2))
        comp = np.asarray(_true_ms(groups)) * (1 + rng.normal(0, 0.01, len(groups)))
        parts.append(_samples(groups, comp.tolist(), (comp / SPEED[r]).tolist(), step=step, rank=r))
    return Samples.concat(parts)


def test_calibrator_fits_on_schedule_and_finds_the_slow_rank():
    cal = Calibrator(PRIOR, WORLD, CalibrationOptions(every=2, first=2, window=4))
    rng = np.random.default_rng(6)
    fits = {}
    for step in range(8):
        up = cal.observe(step, _step_samples(step, rng))
        if up is not None:
            fits[step] = up
    assert sorted(fits) == [1, 3, 5, 7]  # after `first` steps, then every 2
    first = fits[1]
    assert first.error_before > 1.5 and first.error_after < 0.05
    assert first.speeds == [1.0, 1.0, 0.5, 1.0] and first.speeds_changed
    assert not fits[3].speeds_changed  # noise does not move them again
    assert first.cost.rank_speeds(WORLD).tolist() == SPEED and not first.cost.uniform
    assert _rel(first.cost.linear_ms, TRUE.linear_ms) < 0.1
    assert set(cal.window.step.tolist()) == {4, 5, 6, 7}  # old samples are forgotten
    with pytest.raises(ValueError, match="name rank 4 but the world has 4"):
        cal.observe(8, _samples(*_one(), step=8, rank=4))
    # nan or negative measurements are skipped, not fitted
    n = len(cal.window)
    g, c = _one()
    cal.observe(9, _samples(g, [float("nan")] * len(c), step=9))
    cal.observe(10, _samples(g, [-1.0] * len(c), step=10))
    assert len(cal.window) <= n


def _one():
    rng = np.random.default_rng(7)
    groups = _groups(rng, 3)
    return groups, _true_ms(groups)


def test_calibrator_state_resumes_exactly_and_at_another_world_keeps_coefficients():
    opts = CalibrationOptions(every=2, first=2, window=4)
    rng = np.random.default_rng(8)
    steps = [_step_samples(s, rng) for s in range(9)]
    a = Calibrator(PRIOR, WORLD, opts)
    for s in range(4):
        a.observe(s, steps[s])
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints hold plain JSON
    b = Calibrator(PRIOR, WORLD, opts)
    b.load_state_dict(state)
    for s in range(4, 9):
        ua, ub = a.observe(s, steps[s]), b.observe(s, steps[s])
        assert (ua is None) == (ub is None)
        if ua is not None:
            assert ua.cost == ub.cost and ua.speeds == ub.speeds and ua.to_json() == ub.to_json()
    assert a.cost == b.cost and a.state_dict() == b.state_dict()
    # another world size: the fitted coefficients stay, speeds and samples start afresh
    c = Calibrator(PRIOR, 2, opts)
    c.load_state_dict(state)
    fitted = CostModel.from_dict(state["cost"])
    assert coefficients(c.cost.base) == pytest.approx(coefficients(fitted.base))
    assert c.cost.lane_speed == () and c.speeds.in_use.tolist() == [1.0, 1.0] and len(c.window) == 0
    assert c.cost.rank_speeds(2).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="not a calibration state"):
        c.load_state_dict({"format": "x"})


def test_calibrator_with_device_classes_fits_each_class():
    slow_true = TRUE.scaled(2.0)  # the "old" class: twice the time
    prior = TRUE.with_classes({"old": TRUE, "new": TRUE}, [("old", 2), ("new", 2)])
    cal = Calibrator(prior, WORLD, CalibrationOptions(every=1, first=1, speeds=False))
    rng = np.random.default_rng(9)
    parts = []
    for r in range(WORLD):
        groups = _groups(rng, 20, degrees=(1, 2))
        comp = _true_ms(groups, slow_true if r < 2 else TRUE)
        parts.append(_samples(groups, comp, step=0, rank=r))
    up = cal.observe(0, Samples.concat(parts))
    assert up is not None and set(up.shapes) == {"old:1x1", "new:1x1"}
    assert up.cost.class_names == ("old", "new") and up.cost.rank_classes == prior.rank_classes
    assert _rel(up.cost.class_model("old").linear_ms, 2 * TRUE.linear_ms) < 0.05
    assert _rel(up.cost.class_model("new").linear_ms, TRUE.linear_ms) < 0.05
    assert up.cost.lane_speed == ()
    assert CostModel.from_dict(up.cost.to_dict()) == up.cost


def test_calibrator_at_another_world_takes_this_worlds_class_map_and_speeds():
    opts = CalibrationOptions(every=1, first=1)
    prior4 = TRUE.with_classes({"old": TRUE, "new": TRUE}, [("old", 2), ("new", 2)])
    a = Calibrator(prior4, WORLD, opts)
    rng = np.random.default_rng(10)
    for s in range(2):
        a.observe(s, _step_samples(s, rng))
    assert a.cost.lane_speed == ((2, 0.5),)
    state = json.loads(json.dumps(a.state_dict()))
    prior2 = TRUE.with_classes({"old": TRUE, "new": TRUE}, [("old", 1), ("new", 1)]).with_speeds({1: 0.8})
    b = Calibrator(prior2, 2, opts)
    b.load_state_dict(state)
    assert b.cost.rank_classes == (("old", 1), ("new", 1)) and b.cost.lane_speed == ((1, 0.8),)
    assert b.speeds.in_use.tolist() == [1.0, 0.8]
    assert b.cost.class_model("old") == a.cost.class_model("old")  # the fitted coefficients
    assert b.cost.rank_class_index(2).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"device classes \['old', 'new'\], this loader's \[\]"):
        Calibrator(TRUE, 2, opts).load_state_dict(state)


def test_the_plain_fit_is_ordinary_least_squares_on_milliseconds():
    """``robust=False`` (the cost-file profiler's fit): unweighted, no ridge, no row dropped, the prior not
    rescaled; on a well-posed problem it is the least-squares solution itself."""
    rng = np.random.default_rng(3)
    groups = _groups(rng, 120)
    meas = np.asarray(_true_ms(groups)) * (1 + rng.normal(0, 0.01, len(groups)))
    meas[:6] *= 1.6  # rows the robust fit drops as outliers
    s = _samples(groups, meas.tolist())
    sc, rep = fit_shape(PRIOR.base, s, FitSettings(robust=False))
    a = features(PRIOR.base, s)  # [n, 4]
    lsq, *_ = np.linalg.lstsq(a, meas, rcond=None)
    assert (lsq > 0).all()  # interior: NNLS and least squares agree
    assert coefficients(sc) == pytest.approx(lsq, rel=1e-7)
    assert rep.kind == "fit" and rep.dropped == 0
    assert FitSettings().robust and fit_shape(PRIOR.base, s, FitSettings())[1].dropped > 0  # the default drops them


def test_a_fit_of_some_coefficients_holds_the_others_at_the_prior():
    rng = np.random.default_rng(4)
    groups = _groups(rng, 200, degrees=(2, 4))
    meas = _true_ms(groups)
    prior = replace(TRUE.base, comm_bytes_per_token=1.0)  # only the bytes per token wrong
    for robust in (False, True):
        sc, _ = fit_shape(prior, _samples(groups, meas), FitSettings(robust=robust, free=("comm_bytes_per_token",)))
        assert (sc.microbatch_ms, sc.quadratic_ms, sc.linear_ms) == (prior.microbatch_ms, prior.quadratic_ms,
                                                                    prior.linear_ms)
        # exact times: the plain fit is exact; the robust one's ridge pulls a little to the (rescaled) prior
        assert _rel(sc.comm_bytes_per_token, TRUE.base.comm_bytes_per_token) <= (0.05 if robust else 1e-6), robust
    with pytest.raises(ValueError, match="must name some of"):
        FitSettings(free=("bandwidth_gbs",))
    with pytest.raises(ValueError, match="must name some of"):
        FitSettings(free=())
