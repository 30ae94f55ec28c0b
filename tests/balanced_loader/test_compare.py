"""compare: the same batches for every policy, validated plans, the table, compare.json and the charts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pngcheck import assert_png

from balanced_loader import cli, planning
from balanced_loader.batches.stream import global_batches
from balanced_loader.cli.comparison import check_policies, compare_policies, format_table
from balanced_loader.planning.config import PlanConfig
from balanced_loader.presets import cost_preset
from balanced_loader.simulate import step_ms


def test_global_batches_are_cut_between_sequences():
    ln = np.array([5, 0, 7, 3, 20])
    batches, stats = global_batches(ln, max_seq_len=8, long_docs="split", global_batch_tokens=10)
    assert [b.doc_ids.tolist() for b in batches] == [[0], [2, 3], [4], [4], [4]]
    assert [b.starts.tolist() for b in batches[2:]] == [[0], [8], [16]] and batches[4].lengths.tolist() == [4]
    assert stats.empty == 1 and stats.split == 1
    one, _ = global_batches(ln, max_seq_len=None)  # no budget: the whole file is one batch
    assert len(one) == 1 and one[0].doc_ids.tolist() == [0, 2, 3, 4]
    assert len(global_batches(ln, max_seq_len=8, global_batch_tokens=10, max_steps=2)[0]) == 2


def test_shuffled_batches_cover_every_doc_once():
    ln = np.random.default_rng(1).integers(1, 500, 300)
    a, _ = global_batches(ln, max_seq_len=None, global_batch_tokens=2000, shuffle=True, seed=3)
    b, _ = global_batches(ln, max_seq_len=None, global_batch_tokens=2000, shuffle=True, seed=3)
    ids = np.concatenate([x.doc_ids for x in a])
    assert sorted(ids.tolist()) == list(range(300)) and ids.tolist() != list(range(300))
    assert all(np.array_equal(x.doc_ids, y.doc_ids) for x, y in zip(a, b))
    assert all(x.tokens <= 2000 for x in a)


def test_compare_policies_equals_the_cost_model():
    cost = cost_preset("hydra-gpt7b-a100")
    ln = np.random.default_rng(2).lognormal(7, 1.4, 600).astype(np.int64) + 1
    batches, _ = global_batches(ln, max_seq_len=65536, global_batch_tokens=200_000, max_steps=3)
    runs, plans = compare_policies(batches, cost, [PlanConfig(policy="greedy", world_size=16)],
                                   keep_plans=True)
    (run,) = runs
    assert run.speedup == 1.0 and len(run.metrics) == 3
    for m, p in zip(run.metrics, plans["greedy"]):
        assert math.isclose(m.step_ms, step_ms(p, cost), rel_tol=1e-9)
        assert m.tokens == p.tokens == batches[m.step].tokens
    assert "greedy" in format_table(runs) and "1.00x" in format_table(runs)


def test_check_policies(monkeypatch):
    assert check_policies(["greedy", " "]) == ["greedy"]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        check_policies(["greedy", "nope"])
    with pytest.raises(ValueError, match="listed twice"):
        check_policies(["greedy", "greedy"])
    monkeypatch.setitem(planning.POLICIES, "ghost", "no_such_policy_module")
    with pytest.raises(ValueError, match="policy 'ghost' is not available in this build"):
        check_policies(["ghost"])


def test_compare_command_writes_json_and_charts(tmp_path, capsys):
    ln = np.random.default_rng(3).lognormal(7, 1.5, 3000).astype(np.int64) + 1
    f = tmp_path / "l.txt"
    f.write_text("\n".join(map(str, ln)) + "\n")
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--lengths", str(f), "--policies", "greedy", "--world-size", "32",
                     "--cost", "flexsp-gpt7b-a100", "--global-batch-tokens", "400000", "--steps", "4",
                     "--model", "gpt-7b", "--hardware", "a100-40g", "--chart-step", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speedup" in text and "greedy" in text and "MFU" in text
    rep = json.loads((out / "compare.json").read_text())
    assert rep["format"] == "balanced-loader/compare" and rep["settings"]["steps"] == 4
    (pol,) = rep["policies"]
    assert pol["policy"] == "greedy" and len(pol["steps"]) == 4 and pol["speedup"] == 1.0
    assert len(pol["rank_busy_ms"]["ms"]) == 32 and pol["rank_busy_ms"]["step"] == 1
    assert {"step_ms", "pp_bubble", "dp_bubble", "skew", "mfu"} <= set(pol["steps"][0])
    assert_png(out / "rank_load.png")
    assert_png(out / "step_times.png")


def test_compare_on_wikipedia(wiki_lengths, tmp_path):
    cost = cost_preset("flexsp-gpt7b-a100")
    batches, stats = global_batches(wiki_lengths, max_seq_len=5950 * 64, global_batch_tokens=1_000_000,
                                    max_steps=2)
    runs, _ = compare_policies(batches, cost, [PlanConfig(policy="greedy", world_size=64)])
    m = runs[0].metrics[0]
    assert m.tokens == int(batches[0].lengths.sum()) and m.step_ms > 0 and m.skew >= 1.0


def test_compare_and_analyze_read_a_shard_folder(tmp_path, capsys):
    rng = np.random.default_rng(4)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": "x" * int(n)}) + "\n" for n in rng.integers(1, 3000, 200)))
    shards = tmp_path / "shards"
    assert cli.main(["build-shards", str(src), "--out", str(shards), "--no-progress"]) == 0
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--source", str(shards), "--policies", "greedy", "--world-size", "8",
                     "--cost", "hydra-gpt7b-a100", "--global-batch-tokens", "50000", "--shuffle",
                     "--out", str(out)]) == 0
    rep = json.loads((out / "compare.json").read_text())
    total = sum(s["tokens"] for s in rep["policies"][0]["steps"])
    assert 2 <= rep["settings"]["steps"] == len(rep["policies"][0]["steps"]) < 10  # every batch compared
    assert cli.main(["analyze", str(shards), "--json", "--out", str(tmp_path / "an")]) == 0
    capsys.readouterr()
    stats = json.loads((tmp_path / "an" / "analyze.json").read_text())["stats"]
    assert stats["docs"] == 200 and total == stats["tokens"]


def _reproduce():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "reproduce.py"
    spec = importlib.util.spec_from_file_location("reproduce", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_reproduce_tool_writes_tables_and_json(wiki_lengths, tmp_path, monkeypatch, capsys):
    rep = _reproduce()
    ln = tmp_path / "wiki_head.npy"
    np.save(ln, wiki_lengths[:3000])
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"# Results\nbefore\n{rep.BEGIN}\nold\n{rep.END}\nafter\n")
    args = ["--settings", "hydraulis", "--batches", "1", "--lengths", str(ln), "--json", str(tmp_path / "r.json")]
    assert rep.main([*args, "--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Results\nbefore\n") and text.endswith(f"{rep.END}\nafter\n") and "old" not in text
    assert "| hydraulis vs the best homogeneous plan (maxlen tp" in text and "1.32-2.66x" in text
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["hydraulis"]["hydraulis"]["step_ms"]) == 1
    # a policy missing from the build leaves its rows "not produced", naming it
    monkeypatch.setitem(planning.POLICIES, "hydraulis", "no_such_policy_module")
    assert rep.main([*args, "--out", str(tmp_path / "r.md")]) == 0
    assert "not produced: hydraulis unavailable" in (tmp_path / "r.md").read_text()
    assert rep.main(["--settings", "nope"]) == 2
    capsys.readouterr()
