"""Results as data: records written by benchmarks, the results page generated from them and checked."""

from __future__ import annotations

import json
import os

import pytest

from balanced_loader.outputs.records import (
    BEGIN,
    END,
    Figure,
    main,
    make_record,
    page_with,
    read_records,
    render,
    tool_command,
    update_record,
    write_record,
)


def fig(i, area="data", value="1"):
    return Figure(id=f"x.{i}", area=area, figure=f"figure {i}", target="> 0", value=value)


def test_a_record_round_trips_and_renders_one_row_per_figure(tmp_path):
    rec = make_record("x", [fig(1), fig(2, "runtime", "a | b")], command="python tools/x.py")
    assert rec["commit"] and rec["date"] and "cores" in rec["machine"]
    write_record(str(tmp_path / "x.json"), rec)
    (got,) = read_records(str(tmp_path))
    assert got == rec
    text = render([got])
    assert text.count("| figure 1 |") == 1 and "### runtime" in text and "a \\| b" in text


def test_bad_records_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="area must be one of"):
        make_record("x", [fig(1, "nowhere")], command="c")
    write_record(str(tmp_path / "a.json"), make_record("a", [fig(1)], command="c"))
    write_record(str(tmp_path / "b.json"), make_record("b", [fig(1)], command="c"))
    with pytest.raises(ValueError, match="figure x.1 is in two records: a and b"):
        read_records(str(tmp_path))
    (tmp_path / "b.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="b.json: not a balanced-loader/record version 1 record"):
        read_records(str(tmp_path))


def test_the_page_is_regenerated_and_a_stale_page_is_caught(tmp_path, capsys):
    recs = tmp_path / "records"
    recs.mkdir()
    write_record(str(recs / "a.json"), make_record("a", [fig(1)], command="c"))
    page = tmp_path / "RESULTS.md"
    page.write_text(f"# Results\n\nhand-written\n\n{BEGIN}\nold\n{END}\n\nmore\n")
    args = ["--records", str(recs), "--page", str(page)]
    assert main([*args, "--check"]) == 1
    assert main(args) == 0 and main([*args, "--check"]) == 0
    text = page.read_text()
    assert text.startswith("# Results\n\nhand-written\n") and text.endswith("\nmore\n") and "| figure 1 |" in text
    write_record(str(recs / "a.json"), make_record("a", [fig(1, value="2")], command="c"))
    assert main([*args, "--check"]) == 1
    with pytest.raises(ValueError, match="no generated part"):
        page_with("# no markers", "x")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_figures_carry_their_own_command_date_topic_and_details_page(tmp_path):
    (tmp_path / "docs" / "results" / "records").mkdir(parents=True)
    sub = tmp_path / "docs" / "results" / "loader.md"
    sub.write_text(f"# Loader\n\n## What holds now\n\n{BEGIN}\n{END}\n\n## Details\n")
    page = tmp_path / "docs" / "RESULTS.md"
    page.write_text(f"# Results\n\n{BEGIN}\n{END}\n")
    own = Figure(id="x.own", area="data", figure="own", target="t", value="v", command="python tools/own.py --fast",
                 date="2026-01-02", topic="loader", see="docs/results/loader.md")
    rec = make_record("x", [fig(1), own], command="python tools/x.py")
    assert rec["figures"][0].keys() == {"id", "area", "figure", "target", "value"}  # optional keys only where set
    write_record(str(tmp_path / "docs" / "results" / "records" / "x.json"), rec)
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert main(["--root", str(tmp_path)]) == 0 and main(["--root", str(tmp_path), "--check"]) == 0
    text = page.read_text()
    assert "| loader | own | t | v | `python tools/own.py --fast` | 2026-01-02, " in text
    assert "| x | figure 1 | > 0 | 1 | `python tools/x.py` | " + rec["date"] in text
    assert "[loader.md](results/loader.md)" in text
    # the subject page lists only the figures whose details it holds
    sub_text = sub.read_text()
    assert "| own |" in sub_text and "figure 1" not in sub_text and sub_text.endswith("## Details\n")


def test_the_reader_is_strict_about_every_key(tmp_path):
    good = make_record("a", [fig(1)], command="c")
    cases = [
        (lambda r: r["figures"][0].update(colour="red"), "figure x.1: unknown colour"),
        (lambda r: r["figures"][0].pop("target"), "figure x.1: missing target"),
        (lambda r: r["figures"][0].update(value=1.5), "figure x.1: value must be text"),
        (lambda r: r["figures"][0].update(area="moon"), "area must be one of"),
        (lambda r: r.update(extra=1), "unknown key"),
        (lambda r: r.pop("machine"), "the record has no 'machine'"),
    ]
    for change, message in cases:
        rec = json.loads(json.dumps(good))
        change(rec)
        (tmp_path / "a.json").write_text(json.dumps(rec))
        with pytest.raises(ValueError, match=message):
            read_records(str(tmp_path))
    (tmp_path / "a.json").write_text(json.dumps(good))
    assert read_records(str(tmp_path))[0]["name"] == "a"


def test_a_details_page_that_does_not_exist_is_an_error(tmp_path, capsys):
    (tmp_path / "docs" / "results" / "records").mkdir(parents=True)
    (tmp_path / "docs" / "RESULTS.md").write_text(f"{BEGIN}\n{END}\n")
    f = Figure(id="x.1", area="data", figure="f", target="t", value="v", see="docs/results/gone.md")
    write_record(str(tmp_path / "docs" / "results" / "records" / "x.json"), make_record("x", [f], command="c"))
    assert main(["--root", str(tmp_path), "--check"]) == 2
    assert "see 'docs/results/gone.md' is no file" in capsys.readouterr().err


def test_the_repository_results_pages_are_current_and_every_figure_has_one_value():
    """docs/RESULTS.md and docs/results/*.md are what the records make (run
    ``python -m balanced_loader.outputs.records`` after changing a record); no figure twice."""
    assert main(["--root", REPO, "--check"]) == 0
    records = read_records(os.path.join(REPO, "docs", "results", "records"))
    seen = {}
    for r in records:
        for f in r["figures"]:
            key = ((f.get("topic") or r["name"]).lower(), f["figure"].lower())
            assert key not in seen, f"figure {f['id']} repeats {seen[key]}"
            seen[key] = f["id"]
    assert len(seen) > 50


def test_a_run_of_some_sections_keeps_the_other_figures_with_their_own_provenance(tmp_path):
    path = str(tmp_path / "bench.json")
    first = update_record(path, "bench", [fig(1), fig(2)], command="python tools/bench.py")
    old = {k: first[k] for k in ("command", "date", "commit", "machine")}
    second = update_record(path, "bench", [fig(2, value="22"), fig(3)], command="python tools/bench.py --only b")
    assert [f["id"] for f in second["figures"]] == ["x.1", "x.2", "x.3"]  # replaced in place, new ones after
    kept, fresh, new = second["figures"]
    assert {k: kept[k] for k in old} == old and fresh["value"] == "22" and "command" not in fresh
    assert read_records(str(tmp_path))[0] == second
    text = render([second])
    assert "`python tools/bench.py` |" in text and "`python tools/bench.py --only b` |" in text
    assert tool_command(["tools/x.py", "--a", "b c"]) == "python tools/x.py --a 'b c'"
