"""The documentation reads the same raw (GitHub, a checkout) as built: what docs/_hooks/build.py generates from the
code and the results is committed in the pages and current, and every link to a section of a page (README and
docs) names a heading that page has, under both GitHub's and the site's anchor rules."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md"))


def _build_module():
    path = REPO / "docs" / "_hooks" / "build.py"
    spec = importlib.util.spec_from_file_location("switchhead_docs_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build():
    return _build_module()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_generated_text_in_the_page_is_current(page, build):
    text = page.read_text(encoding="utf-8")
    assert build.fill(text, page.name) == text, \
        f"docs/{page.name}: its generated text is out of date; run `python docs/_hooks/build.py`"


def test_every_marker_has_its_text_committed(build):
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        openers = list(build._OPENER.finditer(text))
        assert text.count(build.END) == len(openers), f"docs/{page.name}: a marker without its generated text"


def test_the_cli_page_lists_every_option_raw(build):
    """The README says 'Every option: docs/cli.md': the raw page has them, not only the built site."""
    from switchhead.cli import build_parser

    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    subcommands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in subcommands.items():
        assert f"## switchhead {name}\n" in text, name
        for action in parser._actions:
            for option in action.option_strings:
                assert option in text, (name, option)


def test_fill_replaces_an_old_copy_and_inserts_a_missing_one(build, monkeypatch):
    monkeypatch.setitem(build.GENERATORS, "cli", lambda: "NEW TEXT")
    fresh = "intro\n<!-- generated: cli -->\nafter\n"
    filled = build.fill(fresh, "cli.md")
    assert filled == f"intro\n<!-- generated: cli -->\nNEW TEXT\n{build.END}\nafter\n"
    stale = f"intro\n<!-- generated: cli -->\nOLD\nTEXT\n{build.END}\nafter\n"
    assert build.fill(stale, "cli.md") == filled
    assert build.fill(filled, "cli.md") == filled


# ------------------------------------------------------------------------------------------------- anchors
def _headings(text: str) -> list[str]:
    """The Markdown headings of a page, outside fenced code blocks."""
    headings, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6} (.*?)\s*#*\s*$", line)
        if match:
            headings.append(match.group(1))
    return headings


def _plain(heading: str) -> str:
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    return heading.replace("`", "").replace("*", "")


def github_anchors(text: str) -> set[str]:
    anchors, seen = set(), {}
    for heading in _headings(text):
        slug = re.sub(r"[^\w\- ]", "", _plain(heading).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def site_anchors(text: str) -> set[str]:
    """Python-Markdown's toc slugify (what mkdocs uses): punctuation dropped, runs of spaces and '-' made one '-'."""
    anchors, seen = set(), {}
    for heading in _headings(text):
        slug = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", _plain(heading)).strip().lower())
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}_{count}")
    return anchors


def section_links() -> list[tuple[str, Path, str]]:
    """(where, target page, anchor) for every link with a #fragment to a Markdown page of the repository."""
    links = []
    for page in [REPO / "README.md", *PAGES]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for match in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", text):
            target, anchor = match.groups()
            if re.match(r"\w+://", target) or (target and not target.endswith(".md")):
                continue
            path = (page.parent / target).resolve() if target else page
            links.append((f"{page.relative_to(REPO)} -> {target}#{anchor}", path, anchor))
    return links


def test_the_pages_link_sections():
    assert len(section_links()) > 20


@pytest.mark.parametrize("where,path,anchor", section_links(), ids=[w for w, _, _ in section_links()])
def test_section_link_names_a_heading_of_its_page(where, path, anchor):
    assert path.is_file(), where
    text = path.read_text(encoding="utf-8")
    assert anchor in github_anchors(text), f"{where}: no such heading on GitHub"
    assert anchor in site_anchors(text), f"{where}: no such heading on the site"


def test_anchor_rules():
    text = "# Against the memory floor (H100, bf16)\n```\n# not a heading\n```\n## `switchhead train`\n## A - B\n"
    assert github_anchors(text) == {"against-the-memory-floor-h100-bf16", "switchhead-train", "a---b"}
    assert site_anchors(text) == {"against-the-memory-floor-h100-bf16", "switchhead-train", "a-b"}
