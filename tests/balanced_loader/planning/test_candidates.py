"""Hydraulis candidates: the DP against brute force, candidate files and the CLI command."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.cli import main
from balanced_loader.cost import CostModel, ShapeCost
from balanced_loader.planning.solvers import candidates as cands
from balanced_loader.presets import cost_preset

HYD = cost_preset("hydraulis-llama7b-a800")


def toy_cost() -> CostModel:
    bw = ((2, 100.0),)

    def shape(tp, pp, a, b, c, cap):
        return ShapeCost(tp=tp, pp=pp, quadratic_ms=a, linear_ms=b, microbatch_ms=c, comm_bytes_per_token=0.0,
                         bandwidth_gbs=bw, max_tokens_per_lane=cap)

    return CostModel(quadratic_ms=1e-4, linear_ms=0.2, microbatch_ms=5.0, comm_bytes_per_token=0.0,
                     bandwidth_gbs=bw, max_tokens_per_lane=0,
                     strategies=(shape(1, 2, 2e-4, 0.4, 10.0, 600), shape(2, 1, 6e-5, 0.12, 6.0, 2000)))


def objective(grid: cands.Grid, parts) -> float:
    worst = 0.0
    for k, d, lo, hi in parts:
        c = grid.prefix[k, hi] - grid.prefix[k, lo] + grid.ppm1[k] * grid.tmax[k, hi - 1]
        worst = max(worst, c / d, (grid.ppm1[k] + 1) * grid.tmax[k, hi - 1])
    return worst


def brute_force(grid: cands.Grid, n_units: int) -> float:
    nb, nk = len(grid.upper), len(grid.shapes)
    best = math.inf
    for r in range(nb):
        for cuts in itertools.combinations(range(1, nb), r):
            bounds = (0, *cuts, nb)
            spans = list(zip(bounds[:-1], bounds[1:]))
            options = [[(k, d) for k in range(nk) if grid.fits[k, hi - 1]
                        for d in range(1, n_units // int(grid.units[k]) + 1)] for lo, hi in spans]
            for pick in itertools.product(*options):
                if sum(d * int(grid.units[k]) for k, d in pick) <= n_units:
                    best = min(best, objective(grid, [(k, d, lo, hi) for (k, d), (lo, hi) in zip(pick, spans)]))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_and_reference(seed):
    rng = np.random.default_rng(seed)
    cost = toy_cost()
    shapes = cands.usable_shapes(cost, 8)
    ln = rng.integers(1, 2000, int(rng.integers(3, 12)))
    grid = cands.build_grid(ln, np.ones(len(ln)), shapes, delta_s=500, delta_n=1,
                            fixed_cost=["packed", "doc"][seed % 2])
    n_units = int(rng.integers(2, 7))
    t, trace = cands.dp_table(grid, n_units)
    t_ref, trace_ref = cands.dp_table_reference(grid, n_units)
    assert np.allclose(t, t_ref) and np.array_equal(trace, trace_ref)
    nb = len(grid.upper)
    exact = brute_force(grid, n_units)
    assert t[n_units, nb] == pytest.approx(exact, rel=1e-9) if np.isfinite(exact) else not np.isfinite(t[n_units, nb])
    if np.isfinite(exact):
        parts = cands.extract(grid, trace, n_units, nb)
        assert objective(grid, parts) == pytest.approx(exact, rel=1e-9)
        assert sum(d * int(grid.units[k]) for k, d, _, _ in parts) <= n_units


@given(st.lists(st.integers(1, 46_080), min_size=1, max_size=80), st.sampled_from([8, 16, 32]))
def test_generated_candidates_cover_the_world(lengths, world):
    out = cands.generate(np.asarray(lengths), None, HYD, world, delta_s=1024)
    first = out[0]
    assert len(first.pipelines) == 1 and first.max_tokens(HYD) >= max(lengths)  # homogeneous, holds all
    assert len({c.pipelines for c in out}) == len(out)
    for c in out:
        assert c.gpus == world
        assert all(HYD.shape(tp, pp).usable for tp, pp, _ in c.pipelines)
        sizes = [tp * pp for tp, pp in c.expand()]
        assert sizes == sorted(sizes, reverse=True)


def test_candidate_file_round_trip_and_errors(tmp_path):
    ln = np.random.default_rng(0).integers(1, 30_000, 300)
    out = cands.generate(ln, None, HYD, 32)
    path = tmp_path / "c.yaml"
    path.write_text(cands.dumps(out, world_size=32, max_len=32768, delta_s=128, delta_n=1, fixed_cost="packed"))
    back = cands.load(str(path), 32, HYD)
    assert [c.pipelines for c in back] == [c.pipelines for c in out]
    with pytest.raises(ValueError, match="world size 32, not 16"):
        cands.load(str(path), 16, HYD)
    data = yaml.safe_load(path.read_text())
    data["extra"] = 1
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="unknown key"):
        cands.load(str(path), 32, HYD)
    del data["extra"]
    data["candidates"][0]["pipelines"][0]["count"] = 3
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="not the world size"):
        cands.load(str(path), 32, HYD)


def test_generate_bad_input():
    with pytest.raises(ValueError, match="'strategies'"):
        cands.generate(np.array([10]), None, cost_preset("flexsp-gpt7b-a100"), 8)
    with pytest.raises(ValueError, match="90000-token doc fits no shape"):
        cands.generate(np.array([10, 90_000]), None, HYD, 32)
    with pytest.raises(ValueError, match="empty"):
        cands.generate(np.array([], dtype=np.int64), None, HYD, 32)


def test_histogram_of_accepts_lengths_or_counts():
    ln, w = cands.histogram_of({100: 3, 2000: 1})
    assert ln.tolist() == [100, 2000] and w.tolist() == [3.0, 1.0]
    ln, w = cands.histogram_of([5, 5, 7])
    assert ln.tolist() == [5, 5, 7] and w.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        cands.histogram_of([0, 3])


def test_cli_writes_candidates(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(x) for x in np.random.default_rng(1).integers(1, 60_000, 500)))
    out = tmp_path / "c.yaml"
    rc = main(["candidates", "--lengths", str(lengths), "--world-size", "32", "--cost", "hydraulis-llama7b-a800",
               "--out", str(out), "--max-len", "32768", "--global-batch-tokens", "200000"])
    assert rc == 0
    assert "candidates for 32 GPUs" in capsys.readouterr().out
    back = cands.load(str(out), 32, HYD)
    assert back[0].pipelines[0][2] * back[0].pipelines[0][0] * back[0].pipelines[0][1] == 32
    rc = main(["candidates", "--lengths", str(lengths), "--world-size", "8", "--cost", "flexsp-gpt7b-a100",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "'strategies'" in err
