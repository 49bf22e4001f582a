"""Launch a multi-process job (torchrun, accelerate launch, a script that starts its own ranks)
and fail the test unless it ended cleanly on every rank.

Jobs end through ``tsp_core.shutdown`` (their own, or tests/support/exit_cleanly.py's), which leaves
with ``os._exit``; a failure while ending must still fail the test, and a launcher's exit code alone
does not always show it (Lightning's own launcher is rank 0: a child that fails after rank 0 has
left does not change its exit code). So a clean ending is: exit code 0, no Python traceback and no
C++ abort on stderr, and the exit line ``tsp_core.shutdown: rank R exits with code 0`` from every
rank (``TSP_EXIT_REPORT=1`` is set)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_CLEANLY = os.path.join(ROOT, "tests", "support", "exit_cleanly.py")
JOBS = os.path.join(ROOT, "tests", "jobs")  # the programs the tests launch
BIN = os.path.dirname(sys.executable)
UNCLEAN = ("Traceback (most recent call last)", "terminate called", "core dumped",
           "Fatal Python error")


def load_script(path: str | os.PathLike, name: str):
    """A script of the repository (an example, a docs tool) as a module, without running its
    ``main`` (that runs only when it is a script)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(procs: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node procs ARGS`` (the venv's console script)."""
    return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(procs), *args]


def exit_line(rank: int, code: int = 0) -> str:
    return f"tsp_core.shutdown: rank {rank} exits with code {code}"


def problems(proc: subprocess.CompletedProcess, ranks: int) -> list[str]:
    """Every way ``proc`` did not end cleanly on ``ranks`` ranks (empty when it did)."""
    found = []
    if proc.returncode != 0:
        found.append(f"exit code {proc.returncode}")
    found += [f"{text!r} on stderr" for text in UNCLEAN if text in proc.stderr]
    found += [f"no exit line from rank {r}" for r in range(ranks)
              if exit_line(r) not in proc.stderr]
    return found


def run(cmd: list[str], ranks: int, *, expect_clean: bool = True, timeout: float = 300,
        cwd: str = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (OMP_NUM_THREADS=1, ``env`` added); unless ``expect_clean`` is False, assert
    that it ended cleanly on ``ranks`` ranks, showing the output tails otherwise."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TSP_EXIT_REPORT="1", **env)
    # jobs run as scripts import the shared helpers as ``tests.support``, from the repository root
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd)
    if expect_clean:
        assert_clean(proc, ranks)
    return proc


def assert_clean(proc: subprocess.CompletedProcess, ranks: int) -> None:
    found = problems(proc, ranks)
    assert not found, (f"{' '.join(map(str, proc.args[:6]))}...: {'; '.join(found)}\n"
                       f"--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n"
                       f"{proc.stderr[-5000:]}")


def run_together(*launches: tuple[list[str], int], timeout: float = 300, cwd: str = ROOT,
                 **env: str) -> list[subprocess.CompletedProcess]:
    """Several independent launches ``(cmd, ranks)`` at the same time, each held to what
    :func:`run` asserts; their results in the order given. A 1-process run leaves a core idle
    on its own: beside another launch it costs little of the suite's time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(launches)) as pool:
        procs = list(pool.map(lambda job: run(job[0], job[1], expect_clean=False,
                                              timeout=timeout, cwd=cwd, **env), launches))
    for (_, ranks), proc in zip(launches, procs):
        assert_clean(proc, ranks)
    return procs
