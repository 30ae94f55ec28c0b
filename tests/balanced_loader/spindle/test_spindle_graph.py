"""Spindle graph files: strict loading, validation errors, allowed counts, per-layer times, frontiers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from balanced_loader.spindle.graph import graph_from_dict, load_graph

REPO = Path(__file__).resolve().parents[3]
F1 = REPO / "recipes" / "spindle-f1.yaml"


def _op(name: str, **kw) -> dict:
    d = {"name": name, "task": kw.pop("task", "A"), "layers": 2, "batch": 8, "alpha_ms": 1.0, "beta_ms": 1.0,
         "after": []}
    d.update(kw)
    return d


def _graph(*ops: dict, **top) -> dict:
    return {"gpus": 8, "gpus_per_node": 8, "metaops": list(ops), **top}


def test_f1_loads_with_frontiers_counts_and_times():
    g = load_graph(str(F1))
    assert g.names == ("A-vis", "B-aud", "C-txt", "A-bb", "B-bb", "C-bb")
    assert g.tasks == ("A", "B", "C")
    assert g.frontiers() == [[0, 1, 2], [3, 4, 5]]
    a_vis, b_aud = g.metaops[0], g.metaops[1]
    assert a_vis.counts == (1, 2, 4, 8) and b_aud.counts == (1, 2, 4, 8)
    # T(1), T(2), T(4), T(8) from papers/spindle.md §9
    assert [a_vis.ms(n) for n in (1, 2, 4, 8)] == [132, 68, 36, 20]
    assert [b_aud.ms(n) for n in (1, 2, 4, 8)] == [66, 36, 21, 13.5]
    assert [g.metaops[5].ms(n) for n in (1, 2, 4, 8)] == [68, 36, 20, 12]
    assert a_vis.ms(3) == 4 * (1 + 1 * 11)  # ceil(32 / 3) = 11 per device
    assert g.metaops[3].module == "backbone" and a_vis.module == "A-vis"
    assert g.predecessors(3) == [0]


def test_allowed_counts_are_node_aligned_divisors_or_all_aligned():
    g = graph_from_dict(_graph(_op("x", batch=48), gpus=64))
    assert g.metaops[0].counts == (1, 2, 4, 8, 16, 24, 48)  # 3, 6, 12 would cross node boundaries
    g = graph_from_dict(_graph(_op("x", batch=48), gpus=64, counts="aligned"))
    assert g.metaops[0].counts == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    g = graph_from_dict(_graph(_op("x", batch=8, min_gpus=3), gpus=16))
    assert g.metaops[0].counts == (4, 8)
    g = graph_from_dict(_graph(_op("x", batch=6), gpus=6, gpus_per_node=6))
    assert g.metaops[0].counts == (1, 2, 3, 6)


def test_nested_chains_give_in_degree_frontiers():
    g = graph_from_dict(_graph(_op("a"), _op("b", after=["a"]), _op("c"), _op("d", after=["b", "c"]),
                               _op("e", after=["a"])))
    assert [[g.names[i] for i in f] for f in g.frontiers()] == [["a", "c"], ["b", "e"], ["d"]]


@pytest.mark.parametrize("ops, top, words", [
    ([_op("a", after=["b"]), _op("b", after=["c"]), _op("c", after=["a"])], {},
     ["MetaOp 'a' is on a dependency cycle", "a -> c -> b -> a"]),  # c runs after a, b after c
    ([_op("a", after=["a"])], {}, ["MetaOp 'a' is on a dependency cycle"]),
    ([_op("a"), _op("b", after=["zzz"])], {}, ["MetaOp 'b'", "unknown MetaOp 'zzz'"]),
    ([_op("a", layers=0)], {}, ["MetaOp 'a'", "'layers' is 0"]),
    ([_op("a", min_gpus=16)], {}, ["MetaOp 'a'", "needs at least 16 devices"]),
    ([_op("a", min_gpus=3, batch=6)], {}, ["MetaOp 'a'", "no allowed device count"]),
    ([_op("a"), _op("a")], {}, ["MetaOp 'a' is listed twice"]),
    ([_op("a", colour="red")], {}, ["MetaOp 'a'", "unknown key(s) ['colour']"]),
    ([_op("a", alpha_ms=-1)], {}, ["MetaOp 'a'", "'alpha_ms' must be a number in [0, 1e+09] (ms), got -1"]),
    ([_op("a", batch=float("inf"))], {}, ["MetaOp 'a'", "'batch' must be an integer"]),
    ([_op("a", layers=2.5)], {}, ["MetaOp 'a'", "'layers' must be an integer"]),
    ([{"name": "a", "task": "A", "layers": 2, "batch": 8, "alpha_ms": 1}], {}, ["MetaOp 'a'", "beta_ms"]),
    ([_op("a")], {"gpu": 8}, ["unknown key(s) ['gpu']"]),
    ([_op("a")], {"gpus": 12}, ["gpus 12 is not a multiple of gpus_per_node 8"]),
    ([_op("a")], {"counts": "odd"}, ["'counts' must be one of"]),
    ([_op("a")], {"hardware": "tpu"}, ["unknown hardware 'tpu'"]),
    ([{"name": "big", "task": "T", "layers": 80, "model": "llama3-70b", "seq_len": 4096, "batch": 8,
       "hardware": "a100-40g"}], {}, ["MetaOp 'big'", "needs more devices than exist"]),
    ([{"name": "m", "task": "T", "layers": 2, "model": "gpt-9b", "seq_len": 8, "batch": 8}], {"hardware": "a800"},
     ["MetaOp 'm'", "unknown model 'gpt-9b'"]),
    ([{"name": "m", "task": "T", "layers": 2, "model": "gpt-7b", "seq_len": 8, "batch": 8}], {},
     ["MetaOp 'm'", "needs 'hardware'"]),
])
def test_bad_graphs_fail_with_one_line_naming_the_problem(ops, top, words):
    with pytest.raises(ValueError) as e:
        graph_from_dict(_graph(*ops, **top), where="graph file g.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("graph file g.yaml")
    for w in words:
        assert w in msg


def test_load_graph_reports_missing_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read graph file"):
        load_graph(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [8\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_graph(str(bad))


def test_shape_metaop_time_is_monotone_and_uses_tensor_parallel_for_long_docs():
    tokens = [8192] + [256] * 63
    g = graph_from_dict(_graph({"name": "bb", "task": "T", "layers": 32, "model": "llama2-7b", "tokens": tokens},
                               hardware="a800", gpus=64))
    op = g.metaops[0]
    table = [op.layer_ms(n) for n in range(1, 65)]
    assert all(b <= a for a, b in zip(table, table[1:]))  # monotone non-increasing
    assert op.batch == 64
    # With 64 lanes the longest doc dominates: TP shortens it, so the best layout uses tp > 1.
    tp, dp = op.scaling.layout(64)
    assert tp > 1 and tp * dp <= 64
    # A longer doc set is slower on every count.
    g2 = graph_from_dict(_graph({"name": "bb", "task": "T", "layers": 32, "model": "llama2-7b",
                                 "tokens": [8192] + [512] * 63}, hardware="a800", gpus=64))
    assert all(g2.metaops[0].layer_ms(n) >= op.layer_ms(n) for n in (1, 8, 64))


def test_with_workloads_replaces_tokens_and_batches():
    g = graph_from_dict(_graph(
        {"name": "enc", "task": "T", "layers": 2, "batch": 8, "alpha_ms": 1.0, "beta_ms": 1.0},
        {"name": "bb", "task": "T", "layers": 4, "model": "tiny", "seq_len": 64, "batch": 4, "after": ["enc"]},
        {"name": "other", "task": "U", "layers": 2, "batch": 8, "alpha_ms": 1.0, "beta_ms": 1.0},
        hardware="cpu"))
    lengths = np.array([100, 20, 3000, 7, 64, 64])
    w = g.with_workloads({"T": lengths})
    assert w.metaops[0].batch == 6 and w.metaops[1].batch == 6 and w.metaops[2].batch == 8
    assert w.metaops[1].layer_ms(1) > g.metaops[1].layer_ms(1)  # 3,000-token doc vs 4 x 64 tokens
    with pytest.raises(ValueError, match="unknown task"):
        g.with_workloads({"Z": lengths})


def test_with_gpus_rebuilds_counts_and_keeps_node_size():
    g = load_graph(str(F1))
    g4 = g.with_gpus(4)
    assert g4.gpus == 4 and g4.gpus_per_node == 4 and g4.metaops[0].counts == (1, 2, 4)
    g16 = g4.with_gpus(16)
    assert g16.gpus_per_node == 8 and g16.metaops[0].counts == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        g.with_gpus(12)
