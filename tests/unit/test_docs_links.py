"""README.md is the entry page: every relative link of it and of the docs/ pages leads to a file that
exists (and an ``#anchor`` to a heading of that page); every docs/ page is linked from the README."""

from __future__ import annotations

import re

from support import REPO

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}:
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad


def test_every_docs_page_is_linked_from_the_readme():
    readme = REPO.joinpath("README.md").read_text()
    assert [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in readme] == []


def test_readme_is_an_entry_page():
    """The README's first screen: its first bash block is the two set-up-and-go commands (the main job, the
    tests), within its first 30 lines; the cluster commands come in a section of their own; the whole page
    is under 900 words (measurements live in docs/results.md)."""
    text = REPO.joinpath("README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == ["scripts/k2 train parallel=cpu4", "scripts/k2 test"]
    assert text.index("scripts/k2 test\n```") < len("\n".join(text.splitlines()[:30]))
    assert text.index("## On a cluster") < text.index("## Read these first")
    assert len(text.split()) < 900, len(text.split())
