"""Every Python snippet of README.md and docs/ runs as written, or says why it cannot.

The line right before each ```python fence is one of

    <!-- snippet: 1 process -->       run in a fresh Python process
    <!-- snippet: 2 processes -->     run on the 2 ranks of a torchrun launch (gloo, CPU)
    <!-- fragment: REASON -->         not runnable as written (GPUs, a download, a cluster): REASON

A block without a marker, with another marker or with a fragment without its reason fails
``test_every_python_block_is_marked``, naming its file and line. Runnable blocks run exactly as
written (tests/jobs/snippet_job.py: no code is added, each block is its own ``__main__`` in a fresh
working directory, tracebacks name the doc's lines), with OMP_NUM_THREADS=1 and no network
(HF_HUB_OFFLINE=1). The 1-process blocks get a process each; the 2-process blocks share one
launch that starts every block over as a fresh launch would (process groups destroyed, a fresh
rendezvous port). A failure names the block's file:line and shows its traceback.

The harness is itself tested: a block that raises, in a doc written here, is reported as failing
under both markers (the 2-process one runs last in the shared launch); in that launch a block that
leaves a process group, Accelerate's state, an environment variable and a file behind is followed
by one that must find none of them; and the marker check reports each kind of bad marker."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass

from tests.support import launch

JOB = os.path.join(launch.JOBS, "snippet_job.py")
FENCE = re.compile(r"^( *)(```|~~~)\s*\{?\.?(python3?|py|pycon)\b")  # ```python title="x" too
MARKERS = {"<!-- snippet: 1 process -->": 1, "<!-- snippet: 2 processes -->": 2}
FRAGMENT = re.compile(r"^<!-- fragment:(.*)-->$")
ENV = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
BROKEN = 'import os\n\nraise RuntimeError(f"broken on purpose, rank {os.environ.get(\'RANK\')}")\n'
# a block that leaves everything behind, then one that checks it starts over as a fresh launch
DIRTY = """import os

import tsp_core
from accelerate.state import PartialState

tsp_core.init_mesh(tsp_size=2)
PartialState()
os.environ["TSP_SNIPPET_LEFTOVER"] = "1"
open("left_behind", "w").close()
"""
FRESH = """import os

import torch.distributed as dist
from accelerate.state import PartialState

assert not dist.is_initialized(), "an earlier block's process group is still there"
assert not PartialState._shared_state, "an earlier block's Accelerate state is still there"
assert "TSP_SNIPPET_LEFTOVER" not in os.environ, "an earlier block's environment is still there"
assert os.listdir() == [], f"not a fresh working directory: {os.listdir()}"
"""


@dataclass
class Block:
    path: str       # as given: relative to the repository root for the docs
    line: int       # the fence's line (1-based); the code starts on the next one
    code: str       # without the list indentation of an indented fence
    marker: str     # the line before the fence, stripped

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def processes(self) -> int | None:
        """1 or 2 for a runnable block, None otherwise."""
        return MARKERS.get(self.marker)


def doc_files() -> list[str]:
    docs = sorted(glob.glob("docs/**/*.md", root_dir=launch.ROOT, recursive=True))
    return ["README.md", *docs]


def python_blocks(path: str, root: str = launch.ROOT) -> list[Block]:
    """The ```python blocks of ``path`` (relative to ``root``), in order."""
    with open(os.path.join(root, path)) as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start, close = fence.group(1), i, fence.group(1) + fence.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == close), None)
        assert end is not None, f"{path}:{start + 1}: the ```python fence is never closed"
        code = "".join(line[len(indent):] + "\n" if line.startswith(indent) else line.strip() + "\n"
                       for line in lines[start + 1:end])
        marker = lines[start - 1].strip() if start else ""
        blocks.append(Block(path, start + 1, code, marker))
        i = end + 1
    return blocks


def marker_problems(blocks: list[Block]) -> list[str]:
    problems = []
    for b in blocks:
        fragment = FRAGMENT.match(b.marker)
        if b.processes is not None:
            continue
        if fragment and fragment.group(1).strip():
            continue
        if fragment:
            problems.append(f"{b.where}: a fragment without its reason: {b.marker!r}")
        else:
            found = (f"an unknown marker {b.marker!r}" if b.marker.startswith("<!--") else
                     f"no marker on the line before the fence (found {b.marker!r})")
            problems.append(f"{b.where}: {found}; use one of {', '.join(MARKERS)} or "
                            f"<!-- fragment: REASON -->")
    return problems


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in python_blocks(path)]


def run_job(blocks: list[Block], processes: int, workdir,
            timeout: float) -> subprocess.CompletedProcess:
    """Run ``blocks`` in one process (a plain ``python``) or under a 2-process torchrun, in
    ``workdir`` (a new folder)."""
    workdir.mkdir()
    spec = workdir / "blocks.json"
    spec.write_text(json.dumps([asdict(b) for b in blocks]))
    cmd = [sys.executable] if processes == 1 else launch.torchrun(2)
    try:
        return launch.run([*cmd, JOB, str(spec), str(workdir)], processes, expect_clean=False,
                          timeout=timeout, **ENV)
    except subprocess.TimeoutExpired:
        done = results(workdir, processes)
        stuck = next((b.where for b in blocks if not all(("ok", b.where) in d for d in done)),
                     "after the last block")
        raise AssertionError(f"the snippets did not finish within {timeout}s: {stuck} hung "
                             f"(or was still running)") from None


def results(workdir, ranks: int) -> list[set[tuple[str, str]]]:
    """Per rank, the (``ok`` or ``failed``, PATH:LINE) pairs the job wrote."""
    found = []
    for r in range(ranks):
        f = workdir / f"rank{r}.txt"
        lines = f.read_text().splitlines() if f.exists() else []
        found.append({tuple(line.split(" ", 1)) for line in lines})
    return found


def failures(proc: subprocess.CompletedProcess, blocks: list[Block], workdir,
             ranks: int) -> list[str]:
    """What went wrong: each block that did not run to its end on every rank, then the job's
    output; empty when every block did. A 1-process block may end its process itself
    (``tsp_core.run_cleanly``): a clean ending (exit code 0, no traceback, the exit line of
    ``tsp_core.shutdown``) then stands for its success."""
    done = results(workdir, ranks)
    missing = [b.where for b in blocks if not all(("ok", b.where) in d for d in done)]
    if not missing or (ranks == len(blocks) == 1 and not launch.problems(proc, 1)):
        return []
    failed = sorted({where for d in done for status, where in d if status == "failed"})
    return [f"{where}: " + ("failed" if where in failed else "did not run to its end") +
            " on some rank" for where in missing] + [
        f"exit code {proc.returncode}; failed: {', '.join(failed) or 'none reported'}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"]


def reported_failures(workdir, ranks: int) -> set[str]:
    return {where for d in results(workdir, ranks) for status, where in d if status == "failed"}


def test_every_python_block_is_marked():
    blocks = all_blocks()
    assert blocks, "no ```python block found in README.md and docs/"
    problems = marker_problems(blocks)
    assert not problems, "\n".join(problems)


def test_marker_check_reports_each_bad_marker(tmp_path):
    """The check itself: an unmarked block, an unknown marker, a fragment without a reason, an
    indented fence under a good marker, and an unmarked ~~~py fence with an attribute."""
    doc = ("# t\n\n```python\nx = 1\n```\n<!-- snippet: 3 processes -->\n```python\nx = 1\n```\n"
           "<!-- fragment:  -->\n```python\nx = 1\n```\n- item\n\n  <!-- snippet: 1 process -->\n"
           "  ```python\n  x = 1\n  if x:\n      y = 2\n  ```\n~~~py title=\"t\"\nx = 1\n~~~\n")
    (tmp_path / "t.md").write_text(doc)
    blocks = python_blocks("t.md", root=str(tmp_path))
    assert [b.line for b in blocks] == [3, 7, 11, 17, 22]
    assert blocks[3].code == "x = 1\nif x:\n    y = 2\n" and blocks[3].processes == 1
    problems = marker_problems(blocks)
    assert [p.split(":")[1] for p in problems] == ["3", "7", "11", "22"], problems
    assert "fragment without its reason" in problems[2]


def test_one_process_snippets_run(tmp_path):
    """Each 1-process block in a fresh Python process; then a raising block must fail."""
    blocks = [b for b in all_blocks() if b.processes == 1]
    found = []
    for i, b in enumerate(blocks):
        proc = run_job([b], 1, tmp_path / f"one{i}", timeout=120)
        found += failures(proc, [b], tmp_path / f"one{i}", 1)
    assert not found, "\n".join(found)

    broken = Block(str(tmp_path / "broken.md"), 7, BROKEN, "<!-- snippet: 1 process -->")
    proc = run_job([broken], 1, tmp_path / "broken", timeout=60)
    assert failures(proc, [broken], tmp_path / "broken", 1), proc.stderr[-3000:]
    assert reported_failures(tmp_path / "broken", 1) == {broken.where}, proc.stderr[-3000:]
    assert f'File "{broken.path}", line 10' in proc.stderr, proc.stderr[-3000:]


def test_two_process_snippets_run(tmp_path):
    """The 2-process blocks in one torchrun launch, one after another. Then the harness's own
    checks: a block that leaves a process group, Accelerate's state, an environment variable, a
    file behind, one that finds none of them, and last a raising block,
    which must be reported as failing (and only it), with its traceback."""
    blocks = [b for b in all_blocks() if b.processes == 2]
    probes = [Block(str(tmp_path / "harness.md"), line, code, "<!-- snippet: 2 processes -->")
              for line, code in ((3, DIRTY), (20, FRESH))]
    broken = Block(str(tmp_path / "broken.md"), 7, BROKEN, "<!-- snippet: 2 processes -->")
    proc = run_job([*blocks, *probes, broken], 2, tmp_path / "two", timeout=300)
    found = failures(proc, [*blocks, *probes], tmp_path / "two", 2)
    assert not found, "\n".join(found)
    assert reported_failures(tmp_path / "two", 2) == {broken.where}, proc.stderr[-5000:]
    assert f'File "{broken.path}", line 10' in proc.stderr, proc.stderr[-3000:]
