"""Spindle wave packers: the greedy (each step by hand), the fill pass, refinement, column generation."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.spindle.allocator import Slice, allocate
from balanced_loader.spindle.columns import column_waves
from balanced_loader.spindle.graph import graph_from_dict, load_graph
from balanced_loader.spindle.refine import WaveTables, refine, wave_counts
from balanced_loader.spindle.wave_kernels import wave_length, wave_length_reference
from balanced_loader.spindle.waves import Run, order_waves, pack, wave_ms, waves_ms

REPO = Path(__file__).resolve().parents[3]


def _ops(specs, gpus=4, **top):
    ops = [{"name": f"m{k}", "task": f"t{k}", "layers": layers, "batch": batch, "alpha_ms": a, "beta_ms": b}
           for k, (layers, batch, a, b) in enumerate(specs)]
    return graph_from_dict({"gpus": gpus, "gpus_per_node": 8, "metaops": ops, **top}).metaops


def _check(ops, frontier, waves, gpus):
    """Every layer once, one run per MetaOp per wave, devices within the budget, allowed counts."""
    done = dict.fromkeys(frontier, 0)
    for w in waves:
        assert len({r.op for r in w}) == len(w) and sum(r.n for r in w) <= gpus
        for r in w:
            assert r.layers >= 1 and r.n in ops[r.op].counts
            done[r.op] += r.layers
    assert done == {i: ops[i].layers for i in frontier}


def test_greedy_packer_step_by_step():
    # X: t(2) = 2, t(4) = 1;  Y: t(2) = 4.  Slices: X on 4 x 2 layers, X on 2 x 3 layers, Y on 2 x 4 layers.
    ops = _ops([(5, 4, 0.0, 1.0), (4, 4, 0.0, 2.0)])
    slices = [Slice(op=0, n=4, layers=2), Slice(op=0, n=2, layers=3), Slice(op=1, n=2, layers=4)]
    waves = pack(ops, slices, 4, fill=False)
    # Wave 1: largest first, X on 4 alone (2 ms). Wave 2: Y (16 ms) and X (6 ms) on 2 each; the shortest
    # (6 ms) sets k: Y round(6/4) = 2 layers, X 3 layers, tau = 8; Y's other 2 layers requeue, run alone
    # (Y on 2, a subset of wave 2) and merge into wave 2, which becomes 16 ms.
    assert waves == [[Run(op=0, n=4, layers=2)], [Run(op=1, n=2, layers=4), Run(op=0, n=2, layers=3)]]
    assert waves_ms(ops, waves) == 2 + 16


def test_fill_pass_raises_a_slice_into_idle_devices():
    # One MetaOp, two slices: 2 layers on 2 devices (4 ms) and 2 layers on 1 device (8 ms), 4 devices.
    ops = _ops([(4, 4, 0.0, 1.0)])
    slices = [Slice(op=0, n=2, layers=2), Slice(op=0, n=1, layers=2)]
    # Without fill the second slice cannot join the first one's wave: 4 + 8 ms.
    assert pack(ops, slices, 4, fill=False) == [[Run(op=0, n=2, layers=2)], [Run(op=0, n=1, layers=2)]]
    # With fill the first wave moves up to 4 devices and runs all 4 layers in its 4 ms.
    assert pack(ops, slices, 4, fill=True) == [[Run(op=0, n=4, layers=4)]]


def test_fill_pass_adds_a_queued_metaop_to_idle_devices():
    # A: 4 devices, 4 layers of 1 ms; B: two slices on 4 (2 layers of 1 ms) and on 2 (1 layer of 2 ms); 8 devices.
    ops = _ops([(4, 4, 0.0, 1.0), (3, 4, 0.0, 1.0), (2, 8, 0.0, 1.0)], gpus=8)
    slices = [Slice(op=0, n=4, layers=4), Slice(op=1, n=4, layers=2), Slice(op=1, n=2, layers=1),
              Slice(op=2, n=8, layers=2)]
    plain = pack(ops, slices, 8, fill=False)
    filled = pack(ops, slices, 8, fill=True)
    _check(ops, [0, 1, 2], plain, 8)
    _check(ops, [0, 1, 2], filled, 8)
    assert waves_ms(ops, filled) <= waves_ms(ops, plain)


def _frontier_ops(data):
    specs = data.draw(st.lists(st.tuples(st.integers(1, 10), st.sampled_from([1, 2, 4, 8, 12, 16]),
                                         st.floats(0.0, 3.0), st.floats(0.05, 3.0)), min_size=1, max_size=6))
    gpus = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    return _ops(specs, gpus=gpus), gpus


@given(data=st.data())
def test_packers_schedule_every_layer_once_within_the_devices(data):
    ops, gpus = _frontier_ops(data)
    frontier = list(range(len(ops)))
    alloc = allocate(ops, frontier, gpus)
    for fill in (False, True):
        waves = pack(ops, alloc.slices, gpus, fill=fill)
        _check(ops, frontier, waves, gpus)
        assert waves_ms(ops, waves) >= alloc.finish_ms * (1 - 1e-9)
        better = refine(ops, waves, gpus)
        _check(ops, frontier, better, gpus)
        assert alloc.finish_ms * (1 - 1e-9) <= waves_ms(ops, better) <= waves_ms(ops, waves) * (1 + 1e-12)
    cols = column_waves(ops, frontier, gpus, pack(ops, alloc.slices, gpus))
    _check(ops, frontier, cols, gpus)
    assert waves_ms(ops, cols) >= alloc.finish_ms * (1 - 1e-9)


@given(layers=st.lists(st.integers(1, 9), min_size=1, max_size=4), gpus=st.sampled_from([2, 4, 8]))
def test_wave_counts_is_the_exact_min_max(layers, gpus):
    ops = _ops([(9, 8, 0.3 * k, 1.0 / (k + 1)) for k in range(len(layers))], gpus=gpus)
    wave = dict(enumerate(layers))
    length, counts, slow = wave_counts(WaveTables(ops, list(wave)), wave, gpus)
    best = math.inf
    for combo in itertools.product(*(ops[i].counts for i in wave)):
        if sum(combo) <= gpus:
            best = min(best, max(m * ops[i].layer_ms(n) for (i, m), n in zip(wave.items(), combo)))
    assert math.isclose(length, best, rel_tol=1e-12)
    if math.isfinite(best):
        assert sum(counts.values()) <= gpus
        assert math.isclose(max(m * ops[i].layer_ms(counts[i]) for i, m in wave.items()), best, rel_tol=1e-12)
        assert slow and all(math.isclose(wave[i] * ops[i].layer_ms(counts[i]), best, rel_tol=1e-12) for i in slow)


@given(data=st.data())
def test_wave_length_kernel_matches_its_reference(data):
    k = data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, 5))
    layer_ms, counts = [], []
    for _ in range(k):
        size = data.draw(st.integers(1, width))
        cs = sorted(data.draw(st.sets(st.sampled_from([1, 2, 4, 8, 16, 32]), min_size=size, max_size=size)))
        ts = sorted(data.draw(st.lists(st.floats(0.01, 50.0), min_size=size, max_size=size, unique=True)),
                    reverse=True)
        layer_ms.append(ts + [math.inf] * (width - size))
        counts.append(cs + [cs[-1]] * (width - size))
    layers = [float(x) for x in data.draw(st.lists(st.integers(1, 9), min_size=k, max_size=k))]
    gpus = data.draw(st.sampled_from([1, 4, 8, 16, 64]))
    want = wave_length_reference(layers, layer_ms, counts, gpus)
    got = wave_length(np.array(layers), np.array(layer_ms), np.array(counts, dtype=np.int64), gpus)
    assert got[0] == want[0] and list(got[1]) == want[1]


def test_column_packer_beats_the_greedy_on_the_64_gpu_recipe():
    g = load_graph(str(REPO / "recipes" / "spindle-mm5-64gpu.yaml"))
    frontier = g.frontiers()[0]
    alloc = allocate([g.metaops[i] for i in frontier], frontier, g.gpus)
    greedy = pack(g.metaops, alloc.slices, g.gpus)
    cols = column_waves(g.metaops, frontier, g.gpus, greedy)
    _check(g.metaops, frontier, cols, g.gpus)
    assert waves_ms(g.metaops, cols) < 0.9 * waves_ms(g.metaops, greedy)
    assert waves_ms(g.metaops, cols) < 1.05 * alloc.finish_ms


def test_order_waves_chains_equal_pairs():
    a, b, c = Run(op=0, n=4, layers=1), Run(op=1, n=4, layers=1), Run(op=2, n=2, layers=1)
    waves = [[c], [a, c], [b]]
    assert order_waves(waves, previous=[b]) == [[b], [a, c], [c]]
    assert order_waves(waves) == [[a, c], [c], [b]]
    ops = _ops([(1, 4, 1.0, 1.0)] * 3, gpus=8)
    assert wave_ms(ops, [a, c]) == max(ops[0].layer_ms(4), ops[2].layer_ms(2))
