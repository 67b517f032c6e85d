"""docs/performance.md's tables, generated from bench/results/.

Every benchmark that is run with `--write docs/performance.md` records its table as
`bench/results/perf-SECTION-DATE.json` (bench/common.write_section: the command that made it,
the newest date it states, its text and tables as data) and then has this module fill the doc:
between each pair of markers `<!-- SECTION:begin -->` / `<!-- SECTION:end -->` it writes the
newest record of that section, headed by its date and the command that made it. A
record never changes and is never removed: a newer run supersedes it in the doc, and the older
one stays in bench/results/ as data.

    .venv/bin/python -m bench.perf_tables --write docs/performance.md    # fill every section
    .venv/bin/python -m bench.perf_tables --check docs/performance.md    # exit 1 if stale

A new figure: give its benchmark a section name, add the marker pair under a heading of
docs/performance.md, and run the benchmark with `--write docs/performance.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MARKERS = re.compile(r"<!-- (\S+):begin -->\n.*?<!-- \1:end -->", re.S)
SEPARATOR = re.compile(r"\|[-:| ]+\|")
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
WRITE = " --write docs/performance.md"  # what a command adds to rewrite its section


def parse(body: str) -> list[dict[str, Any]]:
    """A section's markdown as data: tables as columns and rows, the rest as text blocks."""
    blocks: list[dict[str, Any]] = []
    text: list[str] = []
    table: list[list[str]] = []

    def flush() -> None:
        if text:
            blocks.append({"text": "\n".join(text).strip("\n")})
            text.clear()
        if table:
            blocks.append({"columns": table[0], "rows": table[1:]})
            table.clear()

    for line in body.splitlines():
        if line.startswith("|") and line.endswith("|"):
            if text:
                flush()
            if not SEPARATOR.fullmatch(line):
                table.append([c.strip() for c in line[1:-1].split(" | ")])
        elif not line.strip():
            flush()
        else:
            if table:
                flush()
            text.append(line)
    flush()
    return [b for b in blocks if b.get("text") != ""]


def markdown(blocks: list[dict[str, Any]]) -> str:
    parts = []
    for b in blocks:
        if "text" in b:
            parts.append(b["text"])
        else:
            rows = [
                "|" + "".join(f" {c} |" if c else " |" for c in r)
                for r in (b["columns"], *b["rows"])
            ]
            rows.insert(1, "|" + "---|" * len(b["columns"]))
            parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def record(name: str, body: str, *, command: str, date: str | None = None) -> Path:
    """Keep one run's section as bench/results/perf-NAME-DATE[-N].json; returns its path."""
    found = DATE.findall(body)
    when = date or (max(found) if found else datetime.date.today().isoformat())
    path, n = RESULTS / f"perf-{name}-{when}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / f"perf-{name}-{when}-{n}.json"
    data = {"section": name, "date": when, "command": command, "blocks": parse(body)}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def _order(path: Path) -> tuple[str, int]:
    m = re.search(r"-(20\d\d-\d\d-\d\d)(?:-(\d+))?\.json$", path.name)
    return (m.group(1), int(m.group(2) or 1)) if m else ("", 0)


def records(name: str) -> list[Path]:
    """Every record of section NAME, oldest first."""
    found = [
        p
        for p in RESULTS.glob(f"perf-{name}-20*.json")
        if re.fullmatch(rf"perf-{re.escape(name)}-20\d\d-\d\d-\d\d(-\d+)?\.json", p.name)
    ]
    return sorted(found, key=_order)


def section(name: str) -> str:
    """The text between NAME's markers: its newest record, headed by its date (unless its text
    says it) and the command that made it (shown without WRITE, which every such run adds).
    A record's `notes` (what a run said beside its figures) stay in the record, unshown."""
    found = records(name)
    if not found:
        return f"No record yet: run the benchmark with `{WRITE.strip()}`.\n"
    data = json.loads(found[-1].read_text())
    said = " ".join(b.get("text", "") for b in data["blocks"])
    head = "" if data["date"] in said else f"*{data['date']}*:\n\n"
    head += "".join(f"    {line.replace(WRITE, '')}\n" for line in data["command"].splitlines())
    return head + "\n" + markdown(data["blocks"])


def fill(text: str) -> str:
    """TEXT with every marked section replaced by its newest record."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        return f"<!-- {name}:begin -->\n{section(name)}<!-- {name}:end -->"

    return MARKERS.sub(one, text)


def write(doc: Path) -> bool:
    """Fill DOC's sections; True if it changed."""
    text = doc.read_text()
    new = fill(text)
    if new != text:
        doc.write_text(new)
    return new != text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", type=Path, help="fill DOC's sections from bench/results/")
    g.add_argument("--check", type=Path, help="exit 1 if DOC's sections are not the newest")
    args = p.parse_args()
    if args.write:
        write(args.write)
    elif fill(args.check.read_text()) != args.check.read_text():
        sys.exit(f"{args.check}: stale; run python -m bench.perf_tables --write {args.check}")


if __name__ == "__main__":
    main()
