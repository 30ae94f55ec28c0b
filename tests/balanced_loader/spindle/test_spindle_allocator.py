"""Spindle allocator: concave envelope, bisection (C*), discretisation, exact integer allocation."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.spindle.allocator import (
    Slice,
    allocate,
    discretise,
    finish_time,
    integer_allocation,
    rate_hull,
)
from balanced_loader.spindle.graph import graph_from_dict, load_graph

F1 = Path(__file__).resolve().parents[3] / "recipes" / "spindle-f1.yaml"


def _ops(specs, gpus=8, **top):
    ops = [{"name": f"m{k}", "task": f"t{k}", "layers": layers, "batch": batch, "alpha_ms": a, "beta_ms": b}
           for k, (layers, batch, a, b) in enumerate(specs)]
    return graph_from_dict({"gpus": gpus, "gpus_per_node": 8, "metaops": ops, **top}).metaops


def test_hull_of_alpha_beta_keeps_every_divisor_and_is_concave():
    op = load_graph(str(F1)).metaops[0]  # A-vis: T = 132, 68, 36, 20
    h = rate_hull(op)
    assert h.counts == (0, 1, 2, 4, 8)
    assert h.rates == (0.0, 1 / 132, 1 / 68, 1 / 36, 1 / 20)
    slopes = [(h.rates[k + 1] - h.rates[k]) / (h.counts[k + 1] - h.counts[k]) for k in range(4)]
    assert all(a > b for a, b in zip(slopes, slopes[1:]))


def test_hull_drops_counts_under_the_envelope_and_no_faster_counts():
    # alpha 0: linear speedup; every interior point is on the chord, so only the ends remain.
    (op,) = _ops([(10, 8, 0.0, 1.0)])
    assert rate_hull(op).counts == (0, 8)
    # beta 0: more devices never help; only the smallest count remains.
    (op,) = _ops([(10, 8, 1.0, 0.0)])
    assert rate_hull(op).counts == (0, 1)
    # Every allowed point lies on or under the envelope.
    (op,) = _ops([(7, 48, 0.7, 0.3)], gpus=64, counts="aligned")
    h = rate_hull(op)
    for n in op.counts:
        assert 1 / op.ms(n) <= _interp(h, n) * (1 + 1e-12)


def _interp(h, n):
    for k in range(len(h.counts) - 1):
        if h.counts[k] <= n <= h.counts[k + 1]:
            return h.rates[k] + (n - h.counts[k]) * (h.rates[k + 1] - h.rates[k]) / (h.counts[k + 1] - h.counts[k])
    return h.rates[-1]


def test_f1_frontiers_finish_together_at_the_published_times():
    g = load_graph(str(F1))
    for frontier, c_star, devices in (([0, 1, 2], 36.0, (4, 2, 2)), ([3, 4, 5], 20.0, (2, 2, 4))):
        alloc = allocate([g.metaops[i] for i in frontier], frontier, 8)
        assert math.isclose(alloc.finish_ms, c_star, rel_tol=1e-12)
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(alloc.devices, devices))
        assert [(s.op, s.n, s.layers) for s in alloc.slices] == [
            (i, n, g.metaops[i].layers) for i, n in zip(frontier, devices)]


def test_discretisation_time_shares_between_the_bracketing_counts():
    # t(n) = 1 + ceil(8 / n): T = 90, 50, 30, 20 on 1, 2, 4, 8 devices (L = 10).
    (op,) = _ops([(10, 8, 1.0, 1.0)])
    h = rate_hull(op)
    assert math.isclose(h.devices(40.0), 2.75)  # 1/40 between 1/50 (n=2) and 1/30 (n=4)
    # t1 = 40 * (4 - 2.75) / 2 = 25 ms on 2 devices = 5 layers of 5 ms; the other 5 layers on 4.
    assert discretise(0, op, h, 2.75, 40.0) == [Slice(op=0, n=2, layers=5), Slice(op=0, n=4, layers=5)]
    # Below the smallest count: all layers on it (time-sharing with 0 devices).
    assert discretise(0, op, h, 0.5, 180.0) == [Slice(op=0, n=1, layers=10)]
    # At a vertex (up to rounding): one slice.
    assert discretise(0, op, h, 4 - 1e-12, 30.0) == [Slice(op=0, n=4, layers=10)]


def test_finish_time_with_devices_left_over_is_the_slowest_best_time():
    ops = _ops([(4, 4, 1.0, 1.0), (2, 2, 1.0, 1.0)], gpus=16)  # best counts 4 and 2 use 6 of 16
    c, needs = finish_time([rate_hull(o) for o in ops], 16)
    assert c == max(o.ms(o.counts[-1]) for o in ops)
    assert sum(needs) <= 16


specs = st.lists(st.tuples(st.integers(1, 12), st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32]),
                           st.floats(0.0, 4.0), st.floats(0.01, 4.0)), min_size=1, max_size=6)


@given(specs=specs, gpus=st.sampled_from([1, 2, 4, 8, 16]))
def test_bisection_finds_the_least_time_whose_needs_fit(specs, gpus):
    ops = _ops(specs, gpus=gpus)
    hulls = [rate_hull(o) for o in ops]
    c, needs = finish_time(hulls, gpus)
    assert sum(needs) <= gpus * (1 + 1e-9)
    slower = c * (1 - 1e-6)
    assert any(math.isinf(h.devices(slower)) for h in hulls) or sum(h.devices(slower) for h in hulls) > gpus
    # C* is a lower bound of the exact one-count-per-MetaOp allocation.
    single = integer_allocation(ops, gpus)
    if single is not None:
        assert c <= single[0] * (1 + 1e-9)


@given(specs=st.lists(st.tuples(st.integers(1, 8), st.sampled_from([2, 4, 6, 8]), st.floats(0.0, 2.0),
                                st.floats(0.01, 2.0)), min_size=1, max_size=4),
       gpus=st.sampled_from([2, 4, 8]))
def test_integer_allocation_is_exact(specs, gpus):
    ops = _ops(specs, gpus=gpus)
    best = math.inf
    for combo in itertools.product(*(o.counts for o in ops)):
        if sum(combo) <= gpus:
            best = min(best, max(o.ms(n) for o, n in zip(ops, combo)))
    got = integer_allocation(ops, gpus)
    if math.isinf(best):
        assert got is None
    else:
        assert got is not None and sum(got[1]) <= gpus
        assert math.isclose(got[0], best, rel_tol=1e-12)
        assert math.isclose(max(o.ms(n) for o, n in zip(ops, got[1])), best, rel_tol=1e-12)
