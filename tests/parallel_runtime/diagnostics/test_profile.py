"""Cost-model calibration: the least-squares fit recovers known contract-2 coefficients, and a small real
profile on 2 gloo ranks writes a cost file that loads and reports its held-out error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_trainer import HETERO, small_run

from balanced_loader.cost import CostModel, ShapeCost
from parallel_runtime.diagnostics.profile import Case, fit, main, make_cases, report, shape_cost


def test_fit_recovers_the_coefficients_it_was_generated_with() -> None:
    truth = {(1, 1): ShapeCost(tp=1, pp=1, quadratic_ms=2e-4, linear_ms=0.04, microbatch_ms=6.0,
                               comm_bytes_per_token=2048, bandwidth_gbs=((2, 0.05), (4, 0.02)),
                               max_tokens_per_lane=512),
             (1, 2): ShapeCost(tp=1, pp=2, quadratic_ms=3e-4, linear_ms=0.02, microbatch_ms=9.0,
                               comm_bytes_per_token=2048, bandwidth_gbs=((2, 0.08),), max_tokens_per_lane=1024)}
    caps = {k: v.max_tokens_per_lane for k, v in truth.items()}
    cases = make_cases([(1, 1), (1, 2)], {(1, 1): [1, 2, 4], (1, 2): [1, 2]}, caps, grid=6)
    assert {(c.tp, c.pp, c.degree) for c in cases} == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2)}
    assert all(sum(c.lengths) <= caps[(c.tp, c.pp)] * c.degree for c in cases)
    times = [truth[(c.tp, c.pp)].group_ms(c.lengths, c.degree) for c in cases]
    cost = fit(cases, times, comm_bytes_per_token=2048, caps=caps)
    for key, want in truth.items():
        got = cost.shape(*key)
        for f in ("quadratic_ms", "linear_ms", "microbatch_ms"):
            assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-6), (key, f)
        assert dict(got.bandwidth_gbs) == pytest.approx(dict(want.bandwidth_gbs), rel=1e-6)
    held = [Case(tp=1, pp=1, degree=2, lengths=(700,), held_out=True), Case(tp=1, pp=1, degree=1, lengths=(90, 33),
                                                                          held_out=True)]
    rep = report(cost, cases + held, times + [truth[(1, 1)].group_ms(c.lengths, c.degree) for c in held])
    assert rep["held_out"]["cases"] == 2 and rep["held_out"]["median_abs_err"] < 1e-6
    # noisy times: still close, and the cost file round-trips
    rng = np.random.default_rng(0)
    noisy = fit(cases, [t * rng.uniform(0.97, 1.03) for t in times], comm_bytes_per_token=2048, caps=caps)
    assert np.median([abs(noisy.group_ms(c.lengths, c.degree, c.tp, c.pp) - t) / t
                      for c, t in zip(cases, times)]) < 0.03
    assert CostModel.from_dict(noisy.to_dict()).shape(1, 2).quadratic_ms == noisy.shape(1, 2).quadratic_ms


def test_the_fit_is_plain_least_squares_on_milliseconds_through_calibration() -> None:
    """The profiler fits through calibration's fit set to plain NNLS: on noisy times its degree-1 coefficients
    are the least-squares solution on milliseconds, and each degree's bandwidth the least-squares per-token
    residual, as the profiler has always fitted them."""
    sc = ShapeCost(tp=1, pp=2, quadratic_ms=3e-4, linear_ms=0.02, microbatch_ms=9.0, comm_bytes_per_token=2048,
                   bandwidth_gbs=((2, 0.05), (4, 0.02)), max_tokens_per_lane=512)
    cases = make_cases([(1, 2)], {(1, 2): [1, 2, 4]}, {(1, 2): 512}, grid=7)
    rng = np.random.default_rng(1)
    times = [sc.group_ms(c.lengths, c.degree) * rng.uniform(0.95, 1.05) for c in cases]
    got = shape_cost(cases, times, tp=1, pp=2, comm_bytes_per_token=2048, cap=512)
    one = [(c, t) for c, t in zip(cases, times) if c.degree == 1]
    a = np.array([[float(sum(n * n for n in c.lengths)), float(sum(c.lengths)), 1.0] for c, _ in one])  # [n, 3]
    lsq, *_ = np.linalg.lstsq(a, np.array([t for _, t in one]), rcond=None)
    assert (lsq > 0).all()  # interior: NNLS is least squares
    assert [got.quadratic_ms, got.linear_ms, got.microbatch_ms] == pytest.approx(lsq, rel=1e-7)
    for d, bw in got.bandwidth_gbs:
        sel = [(c, t) for c, t in zip(cases, times) if c.degree == d]
        res = np.array([t - got.microbatch_ms - sum(got.compute_ms(n) for n in c.lengths) / d for c, t in sel])
        tok = np.array([sum(c.lengths) / d for c, _ in sel])
        assert bw == pytest.approx(2048 / (float(tok @ res / (tok @ tok)) * 1e6), rel=1e-7), d
    assert got.max_tokens_per_lane == 512 and got.comm_bytes_per_token == 2048


def test_profile_arguments_fail_in_one_line(capsys) -> None:
    assert main(["--recipe", HETERO, "--shapes", "1by2"]) == 2
    assert capsys.readouterr().err.strip() == "profile: error: --shapes: '1by2' is not TPxPP (e.g. 1x1,1x2)"
    assert main(["--recipe", HETERO, "--shapes", "1x1,1x3"]) == 2
    assert "tp=1 x pp=3 does not divide world.size 4" in capsys.readouterr().err
    assert main(["--recipe", HETERO, "--shapes", "0x1"]) == 2
    assert capsys.readouterr().err.strip() == "profile: error: --shapes: '0x1' is not TPxPP (e.g. 1x1,1x2)"
    assert main(["--recipe", HETERO, "--degrees", "1,two"]) == 2
    assert "--degrees: '1,two' is not a list of CP degrees" in capsys.readouterr().err
    assert main(["--recipe", HETERO, "--degrees", "0,2"]) == 2
    assert "--degrees: CP degrees must be >= 1" in capsys.readouterr().err
    assert main(["--recipe", HETERO, "--set", "model.num_kv_heads=2", "--shapes", "1x1", "--degrees", "1,4"]) == 2
    assert "--shapes 1x1: world.cp_engine ulysses with Ulysses size 4 needs" in capsys.readouterr().err


@pytest.mark.multirank
def test_a_small_real_profile_writes_a_cost_file(tmp_path: Path) -> None:
    sets = small_run(tmp_path)
    sets = [*sets, "world.size=2", "policy.extra.pools=[{tp: 1, pp: 1, lanes: 2}]"]
    out, js = tmp_path / "cost.yaml", tmp_path / "profile.json"
    args = ["--recipe", HETERO, "--shapes", "1x1", "--degrees", "1,2", "--cap", "1x1=128", "--grid", "3",
            "--repeats", "1", "--held-out", "4", "--out", str(out), "--json", str(js)]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 0
    text = out.read_text()
    assert text.startswith("# Contract-2 cost file calibrated on this machine by:\n"
                           "#   python -m parallel_runtime profile")
    cost = CostModel.from_file(str(out))
    assert cost.base.max_tokens_per_lane == 128 and cost.base.quadratic_ms + cost.base.linear_ms > 0
    assert 2 in dict(cost.base.bandwidth_gbs)
    data = json.loads(js.read_text())
    assert len(data["cases"]) == len(data["times_ms"]) and min(data["times_ms"]) > 0
    assert data["report"]["held_out"]["cases"] == 4  # groups of the recipe's own plans


@pytest.mark.multirank
def test_a_profile_of_a_degree_beyond_the_powers_of_two_creates_its_groups(tmp_path: Path) -> None:
    sets = [*small_run(tmp_path), "world.size=3", "world.cp_engine=ring",
            "policy.extra.pools=[{tp: 1, pp: 1, lanes: 3}]"]
    out = tmp_path / "cost.yaml"
    args = ["--recipe", HETERO, "--shapes", "1x1", "--degrees", "1,3", "--cap", "1x1=128", "--grid", "3",
            "--repeats", "1", "--held-out", "0", "--out", str(out)]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 0
    assert "# no held-out microbatches (" in out.read_text()
    assert 3 in dict(CostModel.from_file(str(out)).base.bandwidth_gbs)
