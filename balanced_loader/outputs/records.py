"""Results as data: every benchmark writes its figures as a JSON record; ``docs/RESULTS.md`` is made from them.

A record (``docs/results/records/NAME.json``, format ``balanced-loader/record`` version 1) is one
benchmark's latest run: the command, commit, date and machine, and its figures, each with an ``id``
(unique over all records), an ``area`` (``data``, ``planning``, ``runtime``, ``integrations``,
``reliability``, ...), what it measures, the target and the value (text as it should read). A record
replaces the benchmark's previous one: history stays in git, never in table cells.

``python -m balanced_loader.outputs.records`` rewrites the generated part of ``docs/RESULTS.md``
(between the ``records:begin`` and ``records:end`` markers) from the records; ``--check`` exits 1
when the page is stale against them (a test runs it). Every figure appears once.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

FORMAT, VERSION = "balanced-loader/record", 1
BEGIN, END = "<!-- records:begin (generated: python -m balanced_loader.outputs.records) -->", "<!-- records:end -->"
AREAS = ("data", "planning", "runtime", "integrations", "reliability", "gpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    id: str  # unique over all records, e.g. "steps.outside_budget"
    area: str  # one of AREAS
    figure: str  # what is measured
    target: str  # what must hold ("" when there is none)
    value: str  # the measured value as it should read


def machine() -> str:
    """The machine a record was measured on, in a few words."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load {load:.1f}"


def commit(repo: str | None = None) -> str:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), or ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def make_record(name: str, figures: list[Figure], *, command: str, details: Any = None,
                repo: str | None = None) -> dict[str, Any]:
    """A record of ``figures`` measured now by ``command`` (``details``: the benchmark's own JSON)."""
    for f in figures:
        if f.area not in AREAS:
            raise ValueError(f"figure {f.id}: area must be one of {', '.join(AREAS)}, got {f.area!r}")
    return {"format": FORMAT, "version": VERSION, "name": name, "command": command, "commit": commit(repo),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "machine": machine(),
            "figures": [{"id": f.id, "area": f.area, "figure": f.figure, "target": f.target, "value": f.value}
                        for f in figures],
            **({"details": details} if details is not None else {})}


def write_record(path: str, record: dict[str, Any]) -> str:
    """Write ``record`` (complete or absent)."""
    from balanced_loader.outputs.files import write_json

    write_json(path, record, indent=1)
    return path


def read_records(folder: str) -> list[dict[str, Any]]:
    """Every record of ``folder``, by name; a file that is not a record is one ``ValueError`` naming it."""
    out = []
    for fn in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not fn.endswith(".json"):
            continue
        path = os.path.join(folder, fn)
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable record ({e})") from None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} version {VERSION} record")
        for key in ("name", "command", "commit", "date", "machine", "figures"):
            if key not in rec:
                raise ValueError(f"{path}: the record has no {key!r}")
        out.append(rec)
    seen: dict[str, str] = {}
    for rec in out:
        for f in rec["figures"]:
            if f["id"] in seen:
                raise ValueError(f"figure {f['id']} is in two records: {seen[f['id']]} and {rec['name']}")
            seen[f["id"]] = rec["name"]
    return out


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(records: list[dict[str, Any]]) -> str:
    """The generated tables: one per area, a row per figure, with its record's command and date."""
    lines = []
    for area in AREAS:
        rows = [(r, f) for r in records for f in r["figures"] if f["area"] == area]
        if not rows:
            continue
        lines += [f"### {area}", "", "| figure | target | measured | command | when |", "|---|---|---|---|---|"]
        for r, f in sorted(rows, key=lambda x: x[1]["id"]):
            lines.append(f"| {_cell(f['figure'])} | {_cell(f['target'])} | {_cell(f['value'])} | "
                         f"`{_cell(r['command'])}` | {r['date']}, {_cell(r['commit'])} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def page_with(page: str, generated: str) -> str:
    """``page`` with its generated part replaced by ``generated``."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"the results page has no generated part (the markers {BEGIN!r} and {END!r})")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m balanced_loader.outputs.records",
                                 description="Regenerate (or --check) the results page from the records.")
    ap.add_argument("--records", default=os.path.join("docs", "results", "records"))
    ap.add_argument("--page", default=os.path.join("docs", "RESULTS.md"))
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale against the records")
    a = ap.parse_args(argv)
    try:
        with open(a.page) as f:
            page = f.read()
        new = page_with(page, render(read_records(a.records)))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        if new != page:
            print(f"{a.page} is stale against {a.records}: run python -m balanced_loader.outputs.records",
                  file=sys.stderr)
            return 1
        return 0
    if new != page:
        from balanced_loader.outputs.files import write_text

        write_text(a.page, new)
        print(f"wrote {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
