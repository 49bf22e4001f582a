"""Launch a multi-process job (torchrun, accelerate launch, a script that starts its own ranks)
and fail the test unless it ended cleanly on every rank.

Jobs end through ``tsp_core.shutdown`` (their own, or tests/support/exit_cleanly.py's), which leaves
with ``os._exit``; a failure while ending must still fail the test, and a launcher's exit code alone
does not always show it (Lightning's own launcher is rank 0: a child that fails after rank 0 has
left does not change its exit code). So a clean ending is: exit code 0, no Python traceback and no
C++ abort on stderr, and the exit line ``tsp_core.shutdown: rank R exits with code 0`` from every
rank (``TSP_EXIT_REPORT=1`` is set).

Every launch gets a rendezvous port of its own (:func:`fresh_port`), and its processes run in a
session of their own: when the launcher has exited, ranks still running after ``GRACE`` seconds
are killed and the run is unclean. (A rank 0 that failed to bind a port another launch had taken
left its peers waiting on that port, and the test then waited its whole timeout for their
output.)"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_CLEANLY = os.path.join(ROOT, "tests", "support", "exit_cleanly.py")
JOBS = os.path.join(ROOT, "tests", "jobs")  # the programs the tests launch
BIN = os.path.dirname(sys.executable)
LEFT_RUNNING = "tests/support/launch.py: still running after the launcher exited, killed:"
UNCLEAN = ("Traceback (most recent call last)", "terminate called", "core dumped",
           "Fatal Python error", LEFT_RUNNING)
GRACE = 60.0  # seconds the other ranks get to end once the launcher has exited

# Ports for rendezvous: a block of PORT_BLOCK per pytest-xdist worker (the controller or a plain
# pytest takes the block after them), all below the kernel's ephemeral range, so that no socket
# the OS numbers (gloo's, a store's) can take one between its choice and its bind.
PORT_BASE, PORT_BLOCK = 20000, 500
_ports_lock = threading.Lock()
_next_port = itertools.count()


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


def fresh_port() -> int:
    """A free port that no other launch of this test session gets: ``launch.run`` passes it as
    MASTER_PORT (Lightning's launcher) or ``--main_process_port`` (``accelerate launch``), which
    otherwise each choose one that a concurrent launch may choose or take too."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = int(worker[2:]) if worker.startswith("gw") else int(os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT", "0"))
    first = PORT_BASE + block * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        with _ports_lock:
            port = first + next(_next_port) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{first + PORT_BLOCK - 1}")


def with_port(cmd: list[str], port: int) -> list[str]:
    """``cmd`` with ``--main_process_port`` when it is ``accelerate launch`` without one."""
    if (os.path.basename(cmd[0]) == "accelerate" and cmd[1:2] == ["launch"]
            and not any(a.startswith("--main_process_port") for a in cmd)):
        return [cmd[0], "launch", "--main_process_port", str(port), *cmd[2:]]
    return cmd


def run(cmd: list[str], ranks: int, *, expect_clean: bool = True, timeout: float = 300,
        cwd: str = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (OMP_NUM_THREADS=1, ``env`` added); unless ``expect_clean`` is False, assert
    that it ended cleanly on ``ranks`` ranks, showing the output tails otherwise."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TSP_EXIT_REPORT="1", **env)
    # jobs run as scripts import the shared helpers as ``tests.support``, from the repository root
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    full_env["MASTER_PORT"] = env.get("MASTER_PORT") or str(fresh_port())
    proc = run_in_session(with_port(cmd, int(full_env["MASTER_PORT"])), timeout, full_env, cwd)
    if expect_clean:
        assert_clean(proc, ranks)
    return proc


def run_in_session(cmd: list[str], timeout: float, env: dict, cwd: str
                   ) -> subprocess.CompletedProcess:
    """``cmd`` in a new session, its output in files (a rank left running cannot hold a pipe
    open); the session's processes still alive ``GRACE`` s after ``cmd`` exits are killed and
    named on stderr; on ``timeout`` all of them are killed and ``TimeoutExpired`` raised."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.wait()
            out.seek(0), err.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, out.read(), err.read()) from None
        deadline = time.monotonic() + GRACE
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_session(proc.pid)
        out.seek(0), err.seek(0)
        stderr = err.read() + (f"\n{LEFT_RUNNING} {left}\n" if left else "")
        return subprocess.CompletedProcess(cmd, code, out.read(), stderr)


def session_members(sid: int) -> list[str]:
    """The live (not zombie) processes of session ``sid``, as ``PID (NAME)``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        state, _ppid, _pgrp, session = fields.split()[:4]
        if int(session) == sid and state not in "ZX":
            found.append(f"{pid} ({name})")
    return found


def kill_session(sid: int) -> list[str]:
    """Kill every live process of session ``sid`` and wait (10 s at most) until they are dead;
    returns those it killed."""
    members = session_members(sid)
    for member in members:
        try:
            os.kill(int(member.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while members and session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return members


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
