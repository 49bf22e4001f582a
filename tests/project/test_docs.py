"""The docs stand alone: every relative link in README.md, CHANGELOG.md and docs/ resolves to a
file that ships (and an ``#anchor`` to a heading of it, by GitHub's slug rule); every citation
``docs/design.md "Heading"`` in the code and docs names a heading of docs/design.md; nothing
points at files users do not have; no page speaks of the development machine or process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CITATION = re.compile(r'docs/design\.md,? "([^"]+)"')
NOT_SHIPPED = re.compile(r"DESIGN\.md|INTEGRATION_NOTES|\.\./shared|\bDESIGN \d|\bDESIGN §")
# Notes about the development machine or process, which mean nothing to a user: a figure says
# what it was measured on ("on a 2-core x86 CPU"), not "this machine". A space in a phrase matches
# any whitespace, so a phrase broken across lines is found too.
DEV_NOTES = re.compile("|".join(p.replace(" ", r"\s+") for p in [
    r"\bthis (?:2|two)-core\b", r"\bthis machine\b", r"\bon this CPU\b",
    r"\bshared (?:test )?machine\b", r"\b(?:2|two) shared (?:CPU )?cores\b", r"\bload average\b",
    r"\bbeside other (?:work|processes)\b", r"\bthe issue'?s\b", r"\bissue #\d+",
    r"\bother engineers\b", r"\bthe lead\b(?! time)",
    r"\b(?:another|other|this|our|a previous) session\b", r"\bno GPU was available\b",
    r"\bwas at hand\b", r"\bas in CI\b", r"\(in CI\)", r"\bwe ran\b",
]), re.IGNORECASE)


def prose(text: str) -> list[str]:
    """The lines of a markdown text with fenced code blocks blanked (line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def dev_notes(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of each note about the development machine or process in ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split()))
            for m in DEV_NOTES.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, only letters, digits, spaces,
    hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            found.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return found


def headings(page: Path) -> set[str]:
    return {m.group(2) for line in prose(page.read_text(encoding="utf-8"))
            if (m := HEADING.match(line))}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for number, line in enumerate(prose(page.read_text(encoding="utf-8")), 1):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):  # inline code is not a link
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists() or root not in dest.parents:
                broken.append(f"{where}: no such file in the repository")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), "\n".join(broken_links(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_only_what_ships(page):
    hits = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if NOT_SHIPPED.search(line)]
    assert not hits, "citations of files users do not have:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_to_users(page):
    hits = [f"{page.relative_to(ROOT)}:{line}: {phrase!r}"
            for line, phrase in dev_notes(page.read_text(encoding="utf-8"))]
    assert not hits, ("notes about the development machine or process; say what a figure was "
                      "measured on (\"on a 2-core x86 CPU\") instead:\n" + "\n".join(hits))


def test_the_dev_note_check_sees_each_phrase():
    notes = ["on this 2-core machine", "on this\n  machine", "on this CPU",
             "the shared test machine", "on two shared cores", "load average 10-20",
             "2 at a time beside other work",
             "the issue's figure", "issue #30", "other engineers' test runs", "the lead asked",
             "another session was editing", "no GPU was available", "no 3.12 was at hand",
             "(as in CI)", "the CPU run (in CI)", "the restarts we ran"]
    for note in notes:
        assert [phrase for _, phrase in dev_notes(f"Measured {note}, then.")], note
    assert dev_notes("a\nb on this 2-core\nmachine") == [(2, "this 2-core")]
    assert dev_notes("Measured on a 2-core x86 CPU while other processes ran; an issue of the "
                     "lead time, a Slurm session, a machine with network, a CI job.") == []


def test_design_citations_name_real_sections():
    sections = headings(ROOT / "docs" / "design.md")
    sources = [*PAGES, *sorted(ROOT.glob("tsp_core/**/*.py")),
               *sorted(ROOT.glob("integrations/**/*.py")), *sorted(ROOT.glob("examples/*.py")),
               *(p for p in sorted(ROOT.glob("tests/**/*.py")) if p != Path(__file__).resolve())]
    unknown = []
    for path in sources:
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))  # joins lines
        unknown += [f"{path.relative_to(ROOT)}: {name!r}" for name in CITATION.findall(text)
                    if name not in sections]
    assert not unknown, "citations of docs/design.md sections that do not exist:\n" + \
        "\n".join(unknown)


def test_code_cites_only_what_ships():
    hits = [f"{path.relative_to(ROOT)}: {m.group(0)}"
            for path in sorted([*ROOT.glob("tsp_core/**/*.py"), *ROOT.glob("integrations/**/*.py"),
                                *ROOT.glob("examples/*.py")])
            for m in NOT_SHIPPED.finditer(path.read_text(encoding="utf-8"))]
    assert not hits, "\n".join(hits)


def test_the_checks_see_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Top\n## Code map\n## Code map\n```\n# no\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#code-map-1) [x](docs/a.md#no) [y](docs/b.md) "
                    "`[code](nowhere.md)` [z](https://example.org) [up](../outside.md)\n")
    (tmp_path.parent / "outside.md").write_text("")
    assert anchors(tmp_path / "docs" / "a.md") == {"top", "code-map", "code-map-1"}
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "docs/a.md#no: no heading #no in docs/a.md",
        "docs/b.md: no such file in the repository",
        "../outside.md: no such file in the repository"]
