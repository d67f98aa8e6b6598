"""The docs are a reference: every relative link and anchor resolves, each page keeps to its length, no heading
carries a date (history lives in git), and the README stays within 12,000 bytes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    fenced, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        to = (page.parent / path).resolve() if path else page
        if not to.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and to.suffix == ".md" and anchor not in anchors(to):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    assert not [b for page in PAGES for b in broken_links(page)]


def test_the_checker_finds_a_broken_anchor_and_a_missing_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading, with commas\n\n[ok](#a-heading-with-commas) [bad](#nowhere) [gone](missing.md)\n")
    assert broken_links(page) == ["page.md: #nowhere (no such heading)", "page.md: missing.md (no such file)"]


def test_pages_keep_to_their_length_and_no_heading_is_dated():
    lines = {page.name: len(page.read_text().splitlines()) for page in PAGES if page.parent.name == "docs"}
    assert lines.pop("DESIGN.md") <= 300
    assert all(n <= 400 for n in lines.values()), lines
    assert len((ROOT / "README.md").read_bytes()) <= 12_000
    dated = [f"{page.name}: {line}" for page in PAGES for line in page.read_text().splitlines()
             if line.startswith("#") and DATE.search(line)]
    assert not dated, dated


def test_the_reference_s_command_block_gives_every_command_and_flag():
    """docs/reference.md's first code block is 'the command line in full': every subcommand and each of its flags
    (--help and --json aside) as build_parser() defines them."""
    from cli.arguments import build_parser, command_parsers

    block = (ROOT / "docs" / "reference.md").read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    said: dict[str, set[str]] = {}
    for line in block.replace("\\\n", " ").splitlines():  # a command continued over lines is one
        words = [w.strip("[]").split("=")[0] for w in line.replace("|", " ").split()]
        said.setdefault(words[1], set()).update(words[2:])
    commands = command_parsers(build_parser())
    missing = [f"{name} {flag}" for name, sub in commands.items() for action in sub._actions
               for flag in action.option_strings
               if flag.startswith("--") and flag not in ("--help", "--json", *said.get(name, ()))]
    assert not missing and set(said) == set(commands), (missing, sorted(set(commands) ^ set(said)))
