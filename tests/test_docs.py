"""The docs' links between each other: every relative link of README.md, CONTRIBUTING.md and docs/*.md names a
file that exists and, after a #, a heading of that file (as GitHub makes its anchors)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped but for - and _, spaces to hyphens; repeats get -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in _prose(path):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, -1) + 1
        seen[slug] = count
        if count:
            seen[f"{slug}-{count}"] = 0
    return set(seen)


def _docs() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_names_a_file_and_heading_that_exist():
    broken = []
    for doc in _docs():
        for line in _prose(doc):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked here
                file, _, anchor = target.partition("#")
                path = (doc.parent / file).resolve() if file else doc
                if not path.exists():
                    broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
                elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                    broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading in {path.relative_to(REPO)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_shows_the_dashboard_and_links_a_doc_for_each_capability():
    readme = (REPO / "README.md").read_text()
    assert "](docs/img/dashboard-run.png)" in readme
    docs = "training config monitoring dashboard alerting stability planning preflight chaos data testing".split()
    for doc in docs:
        assert f"](docs/{doc}.md" in readme, f"the README links no docs/{doc}.md"
