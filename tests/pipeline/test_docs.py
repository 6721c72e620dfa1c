"""The user-facing docs hold together: every relative link (and its #anchor) resolves, the README
opens with its results table, and BENCHMARKS.md opens with a summary that links every section,
each section in the one shape (what is measured, machine and date, shows / does not show, raw)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "BENCHMARKS.md", "train_plan_v4.md",
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lowercase, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of the markdown headings outside code blocks."""
    return [(len(m.group(1)), m.group(2)) for m in
            re.finditer(r"^(#{1,6}) (.+)$", FENCE.sub("", text), re.M)]


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in headings(text):
        a = github_anchor(title)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def links(doc: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", (ROOT / doc).read_text()))]


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("Stored bytes per token (02b `--dtype`)") == "stored-bytes-per-token-02b---dtype"
    assert github_anchor("Training stage (04), start to exit") == "training-stage-04-start-to-exit"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_and_their_anchors_resolve(doc):
    bad = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, fragment = target.partition("#")
        file = (ROOT / doc).parent / path if path else ROOT / doc
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            bad.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not bad, f"{doc}: " + "; ".join(bad)


def _sections(text: str) -> dict[str, str]:
    """{## title: body} of a markdown text."""
    parts = re.split(r"^## (.+)$", FENCE.sub("", text), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_benchmarks_opens_with_a_summary_linking_every_section_each_in_one_shape():
    text = (ROOT / "BENCHMARKS.md").read_text()
    sections = _sections(text)
    assert next(iter(sections)) == "Summary", "BENCHMARKS.md must open with its summary table"
    linked = {t[1:] for t in LINK.findall(sections["Summary"]) if t.startswith("#")}
    missing = [s for s in sections if s != "Summary" and github_anchor(s) not in linked]
    assert not missing, f"sections the summary table does not link: {missing}"
    for title, body in sections.items():
        if title == "Summary":
            continue
        for part in ("**Measures", "**Machine, date", "**Shows", "**Does not show", "**Raw"):
            assert part in " ".join(body.split()), f"BENCHMARKS.md, {title!r}: no {part}**"


def test_readme_opens_with_the_results_table_linking_benchmarks():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 140, f"README.md has {len(lines)} lines: move detail to docs/"
    start = next(i for i, line in enumerate(lines) if line.startswith("| what | figure |"))
    assert start < 30, "the results table must be on the README's first screen"
    table = []
    for line in lines[start + 2:]:  # the rows under the header and its rule
        if not line.startswith("|"):
            break
        table.append(line)
    assert 1 <= len(table) <= 10
    for row in table:
        assert "(BENCHMARKS.md#" in row, f"a results row without its BENCHMARKS section: {row}"
