"""The README is a front page and the guides live in docs/: its first screen has the two commands,
the picture and the Python example, and every relative link of the README, the guides and the
results report resolves to a file (and to a heading, for ``#anchor`` links)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
         *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FIRST_SCREEN = 40  # lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert broken == [], f"{page.name}: broken links {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    """Power: the check above fails on a missing file and on a missing heading."""
    (tmp_path / "a.md").write_text("# Title\n\n[x](b.md) [y](#title) [z](#nowhere) [w](c.md#title)\n")
    (tmp_path / "c.md").write_text("# Other\n")
    assert links(tmp_path / "a.md") == ["b.md", "#title", "#nowhere", "c.md#title"]
    assert "title" in anchors(tmp_path / "a.md") and "nowhere" not in anchors(tmp_path / "a.md")
    assert "title" not in anchors(tmp_path / "c.md")


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    first = "\n".join(lines[:FIRST_SCREEN])
    assert "bash scripts/setup.sh && .venv/bin/lantern demo" in first  # set up and run
    assert '.venv/bin/python -m pytest -n auto -m "not slow"' in first  # the tests, on every CPU as CI runs them
    assert ".venv/bin/python -m pytest -n auto " in (ROOT / ".ci" / "run").read_text()
    assert "![demo grid, photos](docs/demo_photos.png)" in first  # the picture
    assert 'lantern.load("photos")' in first  # the Python example
    assert (ROOT / "docs" / "demo_photos.png").stat().st_size > 0
