"""The regime sweep's cells (diagnostics/sweep.py over build/zoo.py): the loader's batches within the token
budget, one cell per distinct context, and a small cell end to end."""

from __future__ import annotations

import numpy as np
import pytest

from balanced_loader.build import zoo
from balanced_loader.diagnostics import sweep
from balanced_loader.presets import cost_preset


def test_a_cells_batches_are_the_loaders_within_the_budget():
    cost = cost_preset("hydra-gpt7b-a100")
    ln = np.random.default_rng(0).integers(1, 200_000, 300)
    cell = sweep.cells("x", ln, "hydra", cost, [8], [32768])[0]
    batches = sweep.cell_batches(cell, ln, cost, count=3)
    budget = 8 * 8192 * 4
    assert len(batches) == 3 and all(budget - cell.max_seq_len <= b.sum() <= budget for b in batches)
    assert max(b.max() for b in batches) <= cell.max_seq_len


def test_cells_skip_contexts_that_repeat_a_smaller_one():
    cost = cost_preset("hydra-gpt7b-a100")  # 8,192 tokens per lane
    lengths = np.asarray([100, 20_000, 40_000])
    cells = sweep.cells("x", lengths, "hydra", cost, [2, 8], [8192, 32768, 131072])
    got = [(c.world, c.context, c.max_seq_len) for c in cells]
    # world 2 holds 16K: 128K repeats its 32K (16K) cell; world 8 holds 64K (a doc over 32K makes 128K a cell)
    assert got == [(2, 8192, 8192), (2, 32768, 16384), (8, 8192, 8192), (8, 32768, 32768), (8, 131072, 65536)]


def test_licenses_cell_end_to_end():
    lengths = zoo.lengths("licenses")
    if len(lengths) < 5:
        pytest.skip("zoo corpus 'licenses' is not on this machine")
    cost = cost_preset("hydra-gpt7b-a100")
    cell = sweep.cells("licenses", lengths, "hydra-gpt7b-a100", cost, [2], [8192])[0]
    res = sweep.run_cell(cell, lengths, cost, ("hydra", "maxlen", "token-kk"), count=1)
    assert set(res.ms) == {"hydra", "maxlen", "token-kk"} and res.bound_ms <= res.bound_pow2_ms
    assert res.bound_pow2_ms <= min(res.ms.values()) * (1 + 1e-9)
    assert res.ms["hydra"] <= min(res.ms.values()) * 1.005
    again = sweep.CellResult.from_json(res.to_json())
    assert again.to_json() == res.to_json()
    s = sweep.summary([res])
    assert s["cells"] == 1 and s["behind"] == 0
