"""Results as data: every benchmark writes its figures as a JSON record; ``docs/RESULTS.md`` is made from them.

A record (``docs/results/records/NAME.json``, format ``balanced-loader/record`` version 1) is one
benchmark's latest run: the command, commit, date and machine, and its figures, each with an ``id``
(unique over all records), an ``area`` (``data``, ``planning``, ``runtime``, ``integrations``,
``reliability``, ...), what it measures, the target and the value (text as it should read). A record
replaces the benchmark's previous one: history stays in git, never in table cells.

A figure may carry its own ``command`` (overriding the record's: a record gathering figures of several
commands), ``date``, ``commit`` and ``machine`` (where they differ from the record's: a figure a run did
not measure again keeps its own, see ``update_record``), ``topic`` (the
short subject shown in the table's first column; the record's name otherwise) and ``see`` (the
subject file under ``docs/results/`` with its detailed tables). Every key is checked on reading:
an unknown or missing key, or a value that is not text, is one ``ValueError`` naming the file.

``python -m balanced_loader.outputs.records`` rewrites the generated part of ``docs/RESULTS.md``
(between the ``records:begin`` and ``records:end`` markers) from the records, and the same part of
every subject file of ``docs/results/`` that has the markers (there: the figures whose ``see`` names
that file, under "what holds now"); ``--check`` exits 1 when a page is stale against them (a test
runs it). Every figure appears once.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from balanced_loader.outputs.files import read_json

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
    command: str = ""  # the command that reproduces this figure, where it is not the record's
    date: str = ""  # when this figure was measured, where it is not the record's date
    commit: str = ""  # the checkout it was measured on, where it is not the record's
    machine: str = ""  # the machine it was measured on, where it is not the record's
    topic: str = ""  # the short subject of the table's first column ("" = the record's name)
    see: str = ""  # the subject file with the details, e.g. "docs/results/planners.md"


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


REQUIRED = ("id", "area", "figure", "target", "value")
OPTIONAL = ("command", "date", "commit", "machine", "topic", "see")
RECORD_KEYS = ("format", "version", "name", "command", "commit", "date", "machine", "figures")


def figure_dict(f: Figure) -> dict[str, str]:
    """``f`` as it is stored: the optional keys only where set."""
    return {k: getattr(f, k) for k in REQUIRED} | {k: getattr(f, k) for k in OPTIONAL if getattr(f, k)}


def check_figure(f: Any, where: str) -> None:
    """One ``ValueError`` naming ``where`` unless ``f`` is a figure as a record stores it."""
    if not isinstance(f, dict):
        raise ValueError(f"{where}: a figure must be an object, got {type(f).__name__}")
    name = f.get("id", "?")
    missing = [k for k in REQUIRED if k not in f]
    unknown = sorted(set(f) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown)}"] if unknown else [])
        raise ValueError(f"{where}: figure {name}: " + "; ".join(problems))
    bad = [k for k, v in f.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{where}: figure {name}: {', '.join(bad)} must be text")
    if f["area"] not in AREAS:
        raise ValueError(f"{where}: figure {name}: area must be one of {', '.join(AREAS)}, got {f['area']!r}")
    if not f["id"]:
        raise ValueError(f"{where}: a figure has an empty id")


def make_record(name: str, figures: list[Figure], *, command: str, details: Any = None,
                repo: str | None = None) -> dict[str, Any]:
    """A record of ``figures`` measured now by ``command`` (``details``: the benchmark's own JSON)."""
    for f in figures:
        if f.area not in AREAS:
            raise ValueError(f"figure {f.id}: area must be one of {', '.join(AREAS)}, got {f.area!r}")
        check_figure(figure_dict(f), name)
    return {"format": FORMAT, "version": VERSION, "name": name, "command": command, "commit": commit(repo),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "machine": machine(),
            "figures": [figure_dict(f) for f in figures],
            **({"details": details} if details is not None else {})}


def write_record(path: str, record: dict[str, Any]) -> str:
    """Write ``record`` (complete or absent)."""
    from balanced_loader.outputs.files import write_json

    write_json(path, record, indent=1)
    return path


def tool_command(argv: list[str] | None = None) -> str:
    """The command line that ran this tool, as a user would type it from the repository root."""
    argv = sys.argv if argv is None else argv
    script = argv[0]
    if os.path.isabs(script) and os.path.commonpath([script, os.getcwd()]) == os.getcwd():
        script = os.path.relpath(script)
    return " ".join(["python", shlex.quote(script), *(shlex.quote(a) for a in argv[1:])])


def read_record(path: str) -> dict[str, Any]:
    """The record in ``path``, checked (one ``ValueError`` naming the file)."""
    rec = read_json(path, "record")
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} version {VERSION} record")
    for key in RECORD_KEYS:
        if key not in rec:
            raise ValueError(f"{path}: the record has no {key!r}")
    unknown = sorted(set(rec) - set(RECORD_KEYS) - {"details"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} in the record")
    if not isinstance(rec["figures"], list):
        raise ValueError(f"{path}: 'figures' must be a list")
    for f in rec["figures"]:
        check_figure(f, path)
    return rec


def update_record(path: str, name: str, figures: list[Figure], *, command: str, details: Any = None,
                  repo: str | None = None) -> dict[str, Any]:
    """Write the record of a run that measured ``figures`` into ``path``, keeping the figures of the record
    already there that this run did not measure (a run of some sections of a benchmark): those keep their
    own command, date, commit and machine. Returns the record written."""
    new = make_record(name, figures, command=command, details=details, repo=repo)
    if os.path.exists(path):
        old = read_record(path)
        fresh = {f["id"]: f for f in new["figures"]}
        merged = []
        for f in old["figures"]:
            if f["id"] in fresh:
                merged.append(fresh.pop(f["id"]))
            else:
                merged.append({**f, **{k: f.get(k) or old[k] for k in ("command", "date", "commit", "machine")}})
        new["figures"] = merged + list(fresh.values())
        if details is None and "details" in old:
            new["details"] = old["details"]
    write_record(path, new)
    return new


def read_records(folder: str) -> list[dict[str, Any]]:
    """Every record of ``folder``, by name; a file that is not a record is one ``ValueError`` naming it."""
    out = [read_record(os.path.join(folder, fn))
           for fn in (sorted(os.listdir(folder)) if os.path.isdir(folder) else []) if fn.endswith(".json")]
    seen: dict[str, str] = {}
    for rec in out:
        for f in rec["figures"]:
            if f["id"] in seen:
                raise ValueError(f"figure {f['id']} is in two records: {seen[f['id']]} and {rec['name']}")
            seen[f["id"]] = rec["name"]
    return out


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _link(see: str, page_dir: str) -> str:
    """``see`` (a path from the repository root) as a link relative to the page's folder."""
    rel = os.path.relpath(see, page_dir).replace(os.sep, "/")
    return f"[{os.path.basename(see)}]({rel})"


def render(records: list[dict[str, Any]], *, page_dir: str = "docs", see: str | None = None) -> str:
    """The generated tables: one per area, a row per figure (records by name, figures in their order),
    with its command, date and commit; ``see``: only the figures whose ``see`` is that file."""
    lines = []
    for area in AREAS:
        rows = [(r, f) for r in records for f in r["figures"] if f["area"] == area
                and (see is None or f.get("see") == see)]
        if not rows:
            continue
        details = see is None and any(f.get("see") for _, f in rows)
        head = "| topic | figure | target | measured | command | when |" + (" details |" if details else "")
        lines += [f"### {area}", "", head, "|---|---|---|---|---|---|" + ("---|" if details else "")]
        for r, f in rows:
            cmd = _cell(f.get("command") or r["command"])
            cmd = cmd if "`" in cmd or cmd.startswith("see ") else f"`{cmd}`"
            when = f"{f.get('date') or r['date']}, {_cell(f.get('commit') or r['commit'])}"
            row = (f"| {_cell(f.get('topic') or r['name'])} | {_cell(f['figure'])} | {_cell(f['target'])} | "
                   f"{_cell(f['value'])} | {cmd} | {when} |")
            if details:
                row += f" {_link(f['see'], page_dir) if f.get('see') else ''} |"
            lines.append(row)
        lines.append("")
    if not lines:
        return "(no figures)\n"
    return "\n".join(lines).rstrip() + "\n"


def page_with(page: str, generated: str) -> str:
    """``page`` with its generated part replaced by ``generated``."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"the results page has no generated part (the markers {BEGIN!r} and {END!r})")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def regenerate(root: str = ".", *, records: str | None = None, page: str | None = None) -> dict[str, tuple[str, str]]:
    """Every generated page under ``root``: {path: (text now, text regenerated)}: ``page`` (the results page)
    and each subject file beside ``records`` that has the markers. A ``see`` naming no file is an error."""
    records = records or os.path.join(root, "docs", "results", "records")
    page = page or os.path.join(root, "docs", "RESULTS.md")
    recs = read_records(records)
    for r in recs:
        for f in r["figures"]:
            if f.get("see") and not os.path.isfile(os.path.join(root, f["see"])):
                raise ValueError(f"figure {f['id']} (record {r['name']}): see {f['see']!r} is no file under {root}")
    out = {}
    with open(page) as fh:
        text = fh.read()
    out[page] = (text, page_with(text, render(recs, page_dir=os.path.relpath(os.path.dirname(page), root))))
    subjects = os.path.dirname(os.path.normpath(records))
    for fn in sorted(os.listdir(subjects)):
        path = os.path.join(subjects, fn)
        if not fn.endswith(".md") or not os.path.isfile(path) or os.path.samefile(path, page):
            continue
        with open(path) as fh:
            text = fh.read()
        if BEGIN in text:
            see = os.path.relpath(path, root).replace(os.sep, "/")
            out[path] = (text, page_with(text, render(recs, page_dir=os.path.dirname(see), see=see)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m balanced_loader.outputs.records",
                                 description="Regenerate (or --check) the results pages from the records.")
    ap.add_argument("--root", default=".", help="the repository root (default: the current folder)")
    ap.add_argument("--records", default=None, help="default: ROOT/docs/results/records")
    ap.add_argument("--page", default=None, help="default: ROOT/docs/RESULTS.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is stale against the records")
    a = ap.parse_args(argv)
    try:
        pages = regenerate(a.root, records=a.records, page=a.page)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = [p for p, (old, new) in pages.items() if old != new]
    if a.check:
        if stale:
            print(f"{', '.join(stale)}: stale against the records: run python -m balanced_loader.outputs.records",
                  file=sys.stderr)
            return 1
        return 0
    from balanced_loader.outputs.files import write_text

    for p in stale:
        write_text(p, pages[p][1])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
