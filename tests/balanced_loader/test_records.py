"""Results as data: records written by benchmarks, the results page generated from them and checked."""

from __future__ import annotations

import json

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
