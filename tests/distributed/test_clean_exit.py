"""Ending a run: ``tsp_core.shutdown`` / ``run_cleanly`` turn every failure while a job ends
into a non-zero exit with a traceback, and tests/support/launch.py fails a test on each kind of
unclean ending (exit code, traceback or C++ abort on stderr, a rank without its exit line), also
when the launcher's own exit code is 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.support import launch

JOB = os.path.join(launch.JOBS, "teardown_job.py")
OK = "".join(launch.exit_line(r) + "\n" for r in range(2))


def done(code: int = 0, stderr: str = OK) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["job"], code, "", stderr)


def test_every_kind_of_unclean_ending_is_named():
    assert launch.problems(done(), 2) == []
    assert launch.problems(done(-6), 2) == ["exit code -6"]
    # Lightning's own launcher is rank 0: a child that aborts or raises after rank 0 has left
    # shows only on stderr, or by its missing exit line
    aborted = OK.replace(launch.exit_line(1) + "\n", "terminate called without an active "
                                                     "exception\n")
    assert launch.problems(done(0, aborted), 2) == ["'terminate called' on stderr",
                                                    "no exit line from rank 1"]
    raised = OK + "Traceback (most recent call last):\n  ...\nRuntimeError: x\n"
    assert launch.problems(done(0, raised), 2) == ["'Traceback (most recent call last)' on stderr"]
    assert launch.problems(done(0, OK.replace("code 0", "code 1", 1)), 2) == [
        "no exit line from rank 0"]
    with pytest.raises(AssertionError, match="no exit line from rank 1"):
        launch.assert_clean(done(0, launch.exit_line(0)), 2)


def test_a_rank_raising_at_exit_fails_the_job():
    # rank 1 raises after its work, inside tests/support/exit_cleanly.py (tsp_core.run_cleanly)
    proc = launch.run(launch.torchrun(2, launch.EXIT_CLEANLY, JOB), ranks=2, expect_clean=False,
                      TSP_TEST_TEARDOWN="raise:1")
    assert "rank 0: sum 3" in proc.stdout and "rank 1: sum 3" in proc.stdout, proc.stdout
    assert "RuntimeError: rank 1 fails after its work" in proc.stderr, proc.stderr[-3000:]
    assert launch.exit_line(1, 1) in proc.stderr, proc.stderr[-3000:]
    found = launch.problems(proc, 2)
    assert found[:2] == ["exit code 1", "'Traceback (most recent call last)' on stderr"], found
    assert "no exit line from rank 1" in found
    with pytest.raises(AssertionError, match="exit code 1"):
        launch.assert_clean(proc, 2)


def one_process(mode: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return launch.run([sys.executable, launch.EXIT_CLEANLY, JOB], ranks=1, expect_clean=False,
                      TSP_TEST_TEARDOWN=mode, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


@pytest.mark.parametrize("mode,problems,message", [
    # the barrier in tsp_core.shutdown raises: traceback, exit 1
    ("barrier:0", ["exit code 1", "'Traceback (most recent call last)' on stderr",
                   "no exit line from rank 0"], "RuntimeError: barrier fails on rank 0"),
    # the process aborts after its work, as gloo's finaliser race does
    ("abort:0", ["exit code -6", "no exit line from rank 0"], ""),
    # the process leaves with exit code 0 before tsp_core.shutdown: only the exit line is missing
    ("skip:0", ["no exit line from rank 0"], ""),
])
def test_failures_while_ending_are_caught(mode, problems, message):
    proc = one_process(mode)
    assert "rank 0: sum 1" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert launch.problems(proc, 1) == problems, proc.stderr[-3000:]
    assert message in proc.stderr


def test_sys_exit_inside_run_cleanly_keeps_its_code():
    # what Python does with sys.exit(3) and sys.exit("message")
    code = "import sys, tsp_core\nwith tsp_core.run_cleanly():\n    sys.exit({})\n"
    for arg, want, printed in (("3", 3, ""), ("'no data'", 1, "no data")):
        proc = launch.run([sys.executable, "-c", code.format(arg)], ranks=1, expect_clean=False)
        assert proc.returncode == want and printed in proc.stderr, (arg, proc.stderr[-2000:])
        assert launch.exit_line(0, want) in proc.stderr, proc.stderr[-2000:]


# A launcher (Lightning's is rank 0) that fails while a rank it started waits on: that rank holds
# the job's stdout open and would have held the test for its whole timeout
ORPHAN = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; print('rank 1 waits', flush=True); "
                  "time.sleep(600)"])
time.sleep(1)
raise SystemExit("rank 0 could not bind its port")
"""


def test_a_rank_left_running_is_killed_and_named(monkeypatch):
    monkeypatch.setattr(launch, "GRACE", 1.0)
    proc = launch.run([sys.executable, "-c", ORPHAN], ranks=2, expect_clean=False, timeout=60)
    assert "rank 1 waits" in proc.stdout, proc.stdout
    found = launch.problems(proc, 2)
    assert found[0] == "exit code 1" and f"{launch.LEFT_RUNNING!r} on stderr" in found, found
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith(launch.LEFT_RUNNING)]
    pid = int(line.split("['")[1].split()[0])
    assert not os.path.exists(f"/proc/{pid}/stat") or state(pid) in "ZX", state(pid)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_each_launch_gets_its_own_port():
    ports = [launch.fresh_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(p < 32768 for p in ports), ports
    accelerate = os.path.join(launch.BIN, "accelerate")
    assert launch.with_port([accelerate, "launch", "x.py"], 20001) == [
        accelerate, "launch", "--main_process_port", "20001", "x.py"]
    mine = [accelerate, "launch", "--main_process_port=5", "x.py"]
    assert launch.with_port(mine, 20001) == mine
