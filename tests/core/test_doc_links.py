"""Every relative link of the README and docs/ resolves: the file exists and,
where the link names an anchor, a heading of that file makes it (GitHub's
rule: lowercased, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for
repeats; headings inside fenced code are not headings). Docs move between
pages; this test says which link a move broke. Reads files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: a Markdown inline link or image: ``[text](target)``, the target up to the closing parenthesis
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a console block is no heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (inline code and emphasis marks dropped)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(page.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Relative link targets of ``page``, code spans and fenced blocks left out."""
    found = []
    for line in _prose_lines(page.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        found += [t for t in _LINK.findall(line) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    return found


def test_the_pages_are_found() -> None:
    assert ROOT / "docs" / "README.md" in PAGES and len(PAGES) > 5


def test_slug_follows_github() -> None:
    assert slug("What a checkpoint costs training (`python -m benchmarks.training`)") == \
        "what-a-checkpoint-costs-training-python--m-benchmarkstraining"
    assert slug("Megatron-Core <-> transformers") == "megatron-core---transformers"
    assert slug("5.6 Version 4: index parts and the directory") == "56-version-4-index-parts-and-the-directory"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: {dest.relative_to(ROOT)} has no heading with anchor #{anchor}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)
