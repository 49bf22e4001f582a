"""mkdocs hooks (mkdocs.yml ``hooks:``): one source per page, and links that work in the site.

- A page whose only content is the line ``--8<-- "FILE"`` shows that repository file (index.md
  shows README.md, changelog.md shows CHANGELOG.md), so their text is written once.
- Links are written for GitHub, relative to the file that holds them. In the site, a link to a page
  of docs/ (``docs/design.md#code-map`` in README.md) points at that page, a link to README.md or
  CHANGELOG.md at the page that shows it, and a link to another file of the repository
  (``../examples/train_llama.py``, ``LICENSE``) at a copy of it under ``files/``. Links to files
  that do not exist, and to other .md files outside docs/, are left as written, so
  ``mkdocs build --strict`` fails on them.
- The figures drawn from docs/records (docs/scripts/render_records.py, ``FIGURES``) are drawn
  again into the site at every build, so the site never shows a figure older than its records.
- The code's docstrings cite names the Sphinx way (``:func:`parallelize` ``); the API reference
  shows them as plain code (``parallelize``).
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$')
# a link's start, then its target (groups 1-3); or inline code (no groups), which holds no link
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\]]*\])*\]\()(<?)([^)\s>]+)|`[^`]*`")
FENCE = re.compile(r"^\s*(```|~~~)")
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>~?\.?")
COPIES = "files"  # where copies of repository files outside docs/ live in the site


def _paths(config) -> tuple[Path, Path]:
    docs = Path(os.path.abspath(config["docs_dir"]))
    return docs, docs.parent


def _shown(config) -> dict[str, str]:
    """Repository file (relative path) -> the docs/ page that includes it."""
    docs, _ = _paths(config)
    shown = {}
    for page in docs.glob("*.md"):
        m = INCLUDE.match(page.read_text(encoding="utf-8").strip())
        if m:
            shown[m.group(1)] = page.name
    return shown


def _source(page_src: str, config) -> tuple[str, Path]:
    """The markdown a page renders and the folder its links are relative to."""
    docs, root = _paths(config)
    m = INCLUDE.match(page_src.strip())
    if m:
        included = root / m.group(1)
        return included.read_text(encoding="utf-8"), included.parent
    return page_src, docs


def _target(link: str, base: Path, config) -> str | None:
    """The site path (relative to docs/) a relative link should point at, or None to keep it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", link):
        return None
    docs, root = _paths(config)
    path, hash_, anchor = link.partition("#")
    dest = Path(os.path.normpath(base / path))  # not resolve(): a symlinked file stays in place
    if not dest.exists() or root not in dest.parents:
        return None
    rel = dest.relative_to(root).as_posix()
    if docs in dest.parents:
        site = dest.relative_to(docs).as_posix()
    elif rel in _shown(config):
        site = _shown(config)[rel]
    elif dest.is_file() and dest.suffix != ".md":  # a copied .md would become a page
        site = f"{COPIES}/{rel}"
    else:
        return None
    return site + hash_ + anchor


def _relink(m: re.Match, base: Path, page_uri: str, config) -> str:
    site = m.group(3) and _target(m.group(3), base, config)
    if site is None:
        return m.group(0)
    path, _, anchor = site.partition("#")
    rel = posixpath.relpath(path, posixpath.dirname(page_uri) or ".")
    return m.group(1) + m.group(2) + rel + ("#" + anchor if anchor else "")


def _rewrite(text: str, base: Path, page_uri: str, config) -> str:
    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda m: _relink(m, base, page_uri, config), line)
        out.append(line)
    return "".join(out)


def _render_records(docs: Path):
    spec = importlib.util.spec_from_file_location("render_records",
                                                  docs / "scripts" / "render_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _draw_figures(files, config) -> None:
    """Each figure of docs/records, drawn now from the records, in place of any copy in docs/."""
    docs, _ = _paths(config)
    records = _render_records(docs)
    load = records.loader(docs / "records")
    for name, make in records.FIGURES.items():
        uri = f"{records.FIGURES_DIR}/{name}.png"
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, content=records.draw(make(load))))


def on_files(files, config):
    """Copy into the site every repository file outside docs/ that a page links to, and draw
    the figures of docs/records."""
    _draw_figures(files, config)
    docs, root = _paths(config)
    for page in sorted(docs.glob("*.md")):
        text, base = _source(page.read_text(encoding="utf-8"), config)
        for m in LINK.finditer(text):
            site = m.group(3) and _target(m.group(3), base, config)
            if site and site.startswith(COPIES + "/"):
                uri = site.partition("#")[0]
                if files.get_file_from_path(uri) is None:
                    files.append(File.generated(config, uri, abs_src_path=str(root / uri[6:])))
    return files


def on_page_markdown(markdown, page, config, files):
    text, base = _source(markdown, config)
    return _rewrite(text, base, page.file.src_uri, config)


def on_page_content(html, page, config, files):
    return ROLE.sub("<code>", html)
