"""The documentation site builds with ``mkdocs build --strict`` (what ``./run docs`` runs): every
page of docs/ is in the nav, every link and ``#anchor`` resolves in the site, and every ``:::``
block of docs/api.md names a real object whose docstring renders without a warning. A copy of the
docs with a broken link, anchor or reference fails that build (so strict really catches them);
docs/api.md has a ``:::`` block for every public name of ``tsp_core`` and of each adapter, and names
every option of ``tsp simulate``, ``tsp plan`` and ``tsp bench`` and every model
preset, which the code defines."""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"


def build(root: Path, out: Path) -> tuple[int, str]:
    """``mkdocs build --strict`` of the site whose mkdocs.yml is in ``root``; (exit code, log)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(root / "mkdocs.yml"), "-d", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.match(r"^(WARNING|ERROR)\b", line)]


def copy_of_docs(tmp: Path) -> Path:
    """The site's sources in ``tmp`` (the code linked, not copied), to break without touching
    the repository."""
    site = tmp / "repo"
    site.mkdir()
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md", "LICENSE"):
        shutil.copy(ROOT / name, site / name)
    shutil.copytree(ROOT / "docs", site / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("tsp_core", "integrations", "examples", "tests"):
        (site / name).symlink_to(ROOT / name)
    return site


def test_site_builds_strict(tmp_path):
    code, log = build(ROOT, tmp_path / "site")
    assert code == 0 and not warnings(log), f"mkdocs build --strict failed:\n{log}"
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_strict_build_fails_on_a_broken_link_anchor_or_reference(tmp_path):
    site = copy_of_docs(tmp_path)
    page = site / "docs" / "families.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n[gone](no-such-page.md) "
                    "[deep](design.md#no-such-heading) [code](../examples/no_such_example.py) "
                    "[license](../LICENSE)\n", encoding="utf-8")
    code, log = build(site, tmp_path / "links")
    found = "\n".join(warnings(log))
    assert code != 0, log
    for broken in ("no-such-page.md", "#no-such-heading", "no_such_example.py"):
        assert broken in found, f"strict build did not report {broken}:\n{log}"
    assert "LICENSE" not in found, f"a link to a file of the repository was refused:\n{log}"

    api = site / "docs" / "api.md"
    api.write_text(API.read_text(encoding="utf-8") + "\n::: tsp_core.nope\n", encoding="utf-8")
    page.write_text((ROOT / "docs" / "families.md").read_text(encoding="utf-8"), encoding="utf-8")
    code, log = build(site, tmp_path / "reference")
    assert code != 0 and "tsp_core.nope" in log, log


def command_options() -> dict[str, set[str]]:
    from tsp_core.tools.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings
                   if o.startswith("--") and o != "--help"}
            for name, p in sub.choices.items()}


def api_commands(text: str) -> dict[str, str]:
    """The text of docs/api.md's bullets that show each ``tsp`` command's options."""
    section = text[text.index("## Simulation, planning, baselines, benchmark"):]
    out: dict[str, str] = {}
    for bullet in re.split(r"\n(?=- )", section):
        m = re.match(r"- `tsp (\w+)", bullet)
        if m:
            out[m.group(1)] = out.get(m.group(1), "") + bullet
    return out


def test_api_names_every_command_option_and_preset():
    from tsp_core.plan.simulate import MODELS

    text = API.read_text(encoding="utf-8")
    shown = api_commands(text)
    missing = [f"tsp {name} {opt}" for name, opts in sorted(command_options().items())
               for opt in sorted(opts)
               if not re.search(re.escape(opt) + r"\b", shown.get(name, ""))]
    assert not missing, "docs/api.md does not show these options:\n" + "\n".join(missing)
    presets = text[text.index("--model` of `tsp simulate`"):]
    presets = presets[:presets.index("\n- ")]
    absent = [name for name in MODELS if f"`{name}`" not in presets]
    assert not absent, \
        f"docs/api.md's --model presets lack {absent} (tsp_core.plan.simulate.MODELS)"


PACKAGES = {"tsp_core": ROOT / "tsp_core", **{p.name: p for p in sorted(
    (ROOT / "integrations").glob("tsp_*")) if (p / "__init__.py").exists()}}


def public_names(package: Path) -> list[str]:
    """The package's ``__all__``, read without importing it (the adapters import frameworks)."""
    tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets))


def test_api_has_a_block_for_every_public_name():
    blocks = re.findall(r"^::: ([\w.]+)", API.read_text(encoding="utf-8"), re.MULTILINE)
    missing = [f"{pkg}.{name}" for pkg, folder in PACKAGES.items()
               for name in public_names(folder)
               if not any(b == f"{pkg}.{name}" or b.startswith(f"{pkg}.{name}.") for b in blocks)]
    assert len(PACKAGES) == 6 and not missing, \
        f"docs/api.md has no ::: block for {missing} (packages {sorted(PACKAGES)})"
