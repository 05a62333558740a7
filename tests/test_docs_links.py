"""Every relative link in the README and the documentation resolves: to a file of the
checkout, and where it names an anchor, to a heading of that page (as GitHub and the
site's table of contents spell it). The site's pages are the ones ``mkdocs.yml`` names,
and each of them exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str, blank_code: bool = True) -> Iterator[str]:
    """The lines outside fenced code blocks, inline code spans blanked out (kept for
    headings, whose anchors spell them)."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "``", line) if blank_code else line


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: markup dropped, lower case, everything
    but letters, digits, spaces, hyphens and underscores removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text(encoding="utf-8"), blank_code=False):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> Iterator[str]:
    for line in prose(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(line):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
                yield target


def broken(page: Path) -> list[str]:
    """The relative links of a page that name no file, or no heading of their page."""
    out = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_file():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: no such heading in {dest.name}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## The `run` command: what it does\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-run-command-what-it-does) [file](c.md) "
                    "[anchor](b.md#nowhere) `[code](x.md)` [web](https://x.org/y.md)\n"
                    "```\n[fenced](y.md)\n```\n![img](b.md)\n")
    assert broken(page) == ["c.md: no such file", "b.md#nowhere: no such heading in b.md"]


def test_the_readme_links_into_the_site() -> None:
    targets = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    for page in ("docs/quickstart.md", "docs/reference/scenario.md",
                 "docs/reference/cli.md", "docs/validation.md"):
        assert page in targets


def _nav_pages(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names a Python function (the anchors' slugify): read it as nothing."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)


def test_every_page_of_the_site_exists_and_every_guide_is_in_it() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)
    nav = list(_nav_pages(config["nav"]))
    assert [p for p in nav if not (DOCS / p).is_file()] == []
    top = {p.name for p in DOCS.glob("*.md")}
    missing = sorted(top - set(nav))
    assert missing == [], f"add these pages to the nav of mkdocs.yml: {missing}"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """What CI runs (.ci/run): broken links, anchors or a failing hook stop the build."""
    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "site" / "reference" / "scenario" / "index.html").is_file()
