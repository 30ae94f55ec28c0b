"""The regime sweep's corpus zoo and cells (planning/zoo.py, planning/sweep.py): sequences cut as the loader cuts
them, batches within the token budget, one cell per distinct context, and a small cell end to end."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.planning import sweep, zoo
from balanced_loader.presets import cost_preset


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=50), st.integers(1, 700), st.integers(1, 4000))
def test_sequences_tile_every_doc_and_batches_hold_the_budget(lengths, max_seq_len, budget):
    ln = np.asarray(lengths, dtype=np.int64)
    seq = zoo.sequences(ln, max_seq_len)
    assert seq.sum() == ln.sum() and seq.max() <= max_seq_len and seq.min() >= 1
    assert len(seq) == int(np.sum(-(-ln // max_seq_len)))
    batches = zoo.step_batches(ln, max_seq_len, budget, 10**6, seed=3)
    assert sum(b.sum() for b in batches) == ln.sum()  # the corpus, once
    for b in batches[:-1]:
        assert b.sum() <= budget or len(b) == 1  # a sequence longer than the budget is a batch of its own
    assert sorted(np.concatenate(batches).tolist()) == sorted(seq.tolist())


def test_cells_skip_contexts_that_repeat_a_smaller_one():
    cost = cost_preset("hydra-gpt7b-a100")  # 8,192 tokens per lane
    lengths = np.asarray([100, 20_000, 40_000])
    cells = sweep.cells("x", lengths, "hydra", cost, [2, 8], [8192, 32768, 131072])
    got = [(c.world, c.context, c.max_seq_len) for c in cells]
    # world 2 holds 16K: 128K repeats its 32K (16K) cell; world 8 holds 64K (a doc over 32K makes 128K a cell)
    assert got == [(2, 8192, 8192), (2, 32768, 16384), (8, 8192, 8192), (8, 32768, 32768), (8, 131072, 65536)]


def test_licenses_cell_end_to_end():
    try:
        lengths = zoo.corpus_lengths("licenses")
    except ValueError as e:
        pytest.skip(str(e))
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
