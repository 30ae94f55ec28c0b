"""analyze: length statistics, memory-fit degrees, advice, and the command's PNG and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pngcheck import assert_png

from balanced_loader import cli
from balanced_loader.cli.analysis import advise, degree_table, length_stats, memory_fit_degrees
from balanced_loader.cost import CostModel
from balanced_loader.presets import cost_preset


def cost(q=0.0, lin=1.0, cap=10, gpn=8, strategies=()):
    return CostModel.from_dict({"quadratic_ms": q, "linear_ms": lin, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e3, "bandwidth_gbs": {2: 100.0, 16: 10.0},
                                "max_tokens_per_lane": cap, "gpus_per_node": gpn, "strategies": list(strategies)})


def test_length_stats_by_hand():
    s = length_stats(np.array([0, 1, 2, 3, 10, 100]), thresholds=(2, 10), top=2)
    assert (s["docs"], s["empty_docs"], s["tokens"], s["min"], s["max"]) == (5, 1, 116, 1, 100)
    assert s["percentiles"]["p50"] == 3 and s["percentiles"]["p99.9"] == 10  # 'lower': an actual length
    assert s["above"][0] == {"threshold": 2, "docs": 3, "docs_share": 0.6, "tokens_share": 113 / 116}
    assert s["above"][1]["docs"] == 1 and s["above"][1]["tokens_share"] == pytest.approx(100 / 116)
    assert s["longest"] == [{"doc_id": 5, "length": 100}, {"doc_id": 4, "length": 10}]
    assert length_stats(np.array([0, 0]))["docs"] == 0


def test_memory_fit_degrees_and_table():
    np.testing.assert_array_equal(memory_fit_degrees(np.array([1, 10, 11, 20, 21, 41, 80]), 10),
                                  [1, 1, 2, 2, 4, 8, 8])
    rows = degree_table(np.array([5, 10, 15, 40]), cost(q=1e-3, cap=10).base)
    assert [r["degree"] for r in rows] == [1, 2, 4] and [r["docs"] for r in rows] == [2, 1, 1]
    for key in ("docs_share", "tokens_share", "compute_share"):
        assert sum(r[key] for r in rows) == pytest.approx(1.0)
    assert rows[2]["tokens_share"] == pytest.approx(40 / 70)


def test_advice_follows_the_data():
    short = np.full(100, 8)
    a = advise(short, cost(q=0.0, cap=10))
    assert a.policy == "token-kk" and a.max_degree == 1 and a.attention_share == 0.0
    # expensive long docs that still fit one lane: cost is not linear in tokens
    a = advise(np.r_[np.full(2000, 10), np.full(5, 1000)], cost(q=1.0, cap=1000))
    assert a.policy == "hydra" and a.max_degree == 1 and a.cost_spread > 1.3
    # docs that need CP beyond a node, on too few ranks; several shapes listed
    a = advise(np.r_[np.full(100, 5), [200]], cost(cap=10, strategies=[{"tp": 2, "pp": 1}]), world_size=8)
    assert a.policy == "hydra" and a.max_degree == 32
    assert "flexsp" in a.alternatives and "hydraulis" in a.alternatives
    assert any("context limit of at most 80 tokens" in line for line in a.lines)
    # an unusable base shape falls back to the smallest usable one
    h = advise(np.full(10, 100), cost_preset("hydraulis-llama7b-a800"))
    assert h.shape == (1, 2) and h.lane_cap == 11264


def test_wikipedia_figures(wiki_lengths):
    s = length_stats(wiki_lengths)
    assert s["percentiles"] == {"p50": 347, "p90": 2112, "p95": 3720, "p99": 10919, "p99.9": 37353}
    assert s["tokens"] == 1_013_648_780 and s["max"] == 1_823_777
    by = {r["threshold"]: r for r in s["above"]}
    assert by[32768]["docs"] == 1304
    assert by[8192]["tokens_share"] == pytest.approx(0.275, abs=0.001)  # papers/flexsp.md: 27.5 %
    a = advise(wiki_lengths, cost_preset("hydra-gpt7b-a100"), world_size=512)
    assert a.policy == "hydra" and a.max_degree == 256


def test_analyze_command_writes_png_and_json(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ln = np.maximum(rng.lognormal(6.0, 1.5, 5000).astype(np.int64), 1)
    f = tmp_path / "lengths.npy"
    np.save(f, ln)
    out = tmp_path / "an"
    assert cli.main(["analyze", str(f), "--cost", "flexsp-gpt7b-a100", "--world-size", "64",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "percentiles" in text and "advice:" in text and "policy:" in text
    nxt = text.strip().splitlines()[-1].split()
    assert nxt[:4] == ["balanced-loader", "compare", "--lengths", str(f)]
    assert nxt[nxt.index("--world-size") + 1] == "64" and nxt[nxt.index("--cost") + 1] == "flexsp-gpt7b-a100"
    rep = json.loads((out / "analyze.json").read_text())
    assert rep["stats"]["docs"] == 5000 and rep["advice"]["lane_cap"] == 5950
    assert_png(out / "histogram.png")
    # --json prints the same report; --max-len analyzes split segments
    assert cli.main(["analyze", str(f), "--json", "--max-len", "1000", "--out", str(out)]) == 0
    rep2 = json.loads(capsys.readouterr().out)
    assert rep2["stats"]["max"] <= 1000 and rep2["stats"]["tokens"] == int(ln.sum())
    assert rep2["cost"] == "hydra-gpt7b-a100"  # the default cost preset


def test_advice_suggests_a_context_limit_for_a_thin_tail():
    ln = np.r_[np.full(10_000, 10), [2000]]  # one doc of 2,000 tokens holds 1.96 % of the tokens
    a = advise(ln, cost(cap=10))
    assert a.max_degree == 256
    assert not any("context limit of" in line for line in a.lines)  # the tail is over 1 % of the tokens
    ln = np.r_[np.full(100_000, 10), [2000]]  # now 0.2 %
    a = advise(ln, cost(cap=10))
    assert any("context limit of 10 tokens (--max-seq-len) caps the degree at 1 and splits only 1 doc " in line
               for line in a.lines)


def test_analyze_reports_the_steps_sizes_and_the_largest_share_of_one_doc(tmp_path, capsys):
    """analyze cuts the first --steps global batches as the loader would: tokens per step (min / median /
    max, all inside [B - max_seq_len, B]), the largest share of one doc in a step, and a chart."""
    ln = np.r_[[400_000], np.full(3000, 700)]  # one doc 100x max_seq_len before many short ones
    f = tmp_path / "lengths.npy"
    np.save(f, ln)
    reports = {}
    for shuffle in ([], ["--shuffle"]):
        out = tmp_path / f"an{len(shuffle)}"
        assert cli.main(["analyze", str(f), "--max-seq-len", "4096", "--global-batch-tokens", "65536", "--steps", "30",
                         "--json", "--out", str(out), *shuffle]) == 0
        rep = json.loads(capsys.readouterr().out)
        st = reports[bool(shuffle)] = rep["steps"]
        assert st["steps"] == 30 and st["outside_budget"] == 0
        assert 65536 - 4096 <= st["tokens"]["min"] <= st["tokens"]["median"] <= st["tokens"]["max"] <= 65536
        assert_png(out / "steps.png")
    assert reports[False]["largest_doc_share"]["share"] == 1.0  # in file order the long doc fills whole steps
    assert reports[False]["largest_doc_share"]["doc"] == 0
    assert reports[True]["largest_doc_share"]["share"] < 0.6  # shuffled, its pieces spread (it is 16% of tokens)
    # a budget below max_seq_len: the loader refuses it; analyze says so and cuts at the budget
    assert cli.main(["analyze", str(f), "--max-seq-len", "8192", "--global-batch-tokens", "4096", "--steps", "3",
                     "--out", str(tmp_path / "small")]) == 0
    text = capsys.readouterr().out
    assert "note: global_batch_tokens 4,096 is smaller than max_seq_len 8,192: the loader refuses this" in text


def test_analyze_mix_reports_step_sizes_per_source(tmp_path, capsys):
    rng = np.random.default_rng(1)
    for name, hi in (("a", 9000), ("b", 300)):
        np.save(tmp_path / f"{name}.npy", rng.integers(1, hi, 2000))
    assert cli.main(["analyze", "--mix", f"a={tmp_path / 'a.npy'}:0.7", f"b={tmp_path / 'b.npy'}:0.3",
                     "--max-seq-len", "2048", "--global-batch-tokens", "32768", "--steps", "20", "--shuffle",
                     "--json", "--out", str(tmp_path / "m")]) == 0
    rep = json.loads(capsys.readouterr().out)["step_sizes"]
    assert rep["steps"] == 20 and rep["outside_budget"] == 0
    assert set(rep["per_source_share"]) == {"a", "b"}
    assert abs(rep["per_source_share"]["a"]["median"] - 0.7) < 2048 / 32768
    assert_png(tmp_path / "m" / "steps.png")
