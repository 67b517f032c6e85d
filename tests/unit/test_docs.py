"""The docs a newcomer reads first hold together: every relative link in README.md and docs/*.md
names a file that exists and, where it names an anchor, a heading there; docs/performance.md
shows the newest record of each benchmark; the three maps stay within their budgets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
DEFINED = re.compile(r"^\[[^\]]+\]:\s+(\S+)", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return INLINE.findall(text) + DEFINED.findall(text)


def broken(page: Path, target: str) -> str | None:
    """Why TARGET, linked from PAGE, does not resolve; None when it does."""
    if re.match(r"[a-z]+:", target):
        return None  # http(s), mailto: not this test's to check
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"every link in {p.relative_to(ROOT)}")
def test_every_relative_link_resolves_to_a_file_and_its_heading(page: Path) -> None:
    problems = [why for target in links(page) if (why := broken(page, target))]
    assert not problems, "\n".join(problems)


def test_performance_md_shows_the_newest_record_of_every_benchmark() -> None:
    from bench import perf_tables

    doc = ROOT / "docs" / "performance.md"
    assert perf_tables.fill(doc.read_text()) == doc.read_text(), (
        "docs/performance.md is stale: run python -m bench.perf_tables --write docs/performance.md"
    )


@pytest.mark.parametrize(
    ("name", "budget"),
    [
        pytest.param("architecture.md", 25_000, id="the architecture map stays under 25 KB"),
        pytest.param("performance.md", 25_000, id="the performance figures stay under 25 KB"),
        pytest.param("operations.md", 45_000, id="the operator's guide stays under 45 KB"),
    ],
)
def test_each_map_stays_within_its_budget(name: str, budget: int) -> None:
    size = len((ROOT / "docs" / name).read_bytes())
    assert size <= budget, f"docs/{name} is {size} bytes, over its {budget}"
