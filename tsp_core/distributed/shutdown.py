"""Ending a distributed run so that a job whose work succeeded exits 0 on every rank.

With gloo (torch 2.13, CPU), a finished multi-process torchrun job aborts during interpreter
finalisation now and then ("terminate called without an active exception", exit -6) even after
``destroy_process_group()``: a peer has already closed its connections while C++ objects are
being torn down. torchrun then reports the successful run as failed (docs/cluster.md has the
measured rates). The ending here does what a normal exit does up to that point and then skips
it: wait for non-daemon threads, wait for the other ranks, destroy the process groups, run the
``atexit`` handlers (loggers, trackers), flush stdout/stderr, and leave with ``os._exit(code)``.

    with tsp_core.run_cleanly():       # or: main(); tsp_core.shutdown()
        main()

Nothing in the adapters calls this: it ends the process, so it is the last line of the script.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import NoReturn

REPORT_ENV = "TSP_EXIT_REPORT"  # "1": each rank prints one line to stderr as it leaves


def _rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def _join_threads() -> None:
    """What the interpreter does first at exit: stop idle thread pools and join non-daemon
    threads (a background save finishes before its process ends)."""
    if threading.current_thread() is threading.main_thread():
        getattr(threading, "_shutdown", lambda: None)()


def shutdown(exit_code: int = 0) -> NoReturn:
    """End this process with ``exit_code``; call it on every rank as the script's last step.

    With ``exit_code == 0`` it first joins non-daemon threads, waits at a barrier for every rank
    and destroys the process groups; if that fails (a rank died, a connection dropped) it prints
    the traceback and exits 1. With a non-zero code it waits neither for threads nor for peers
    (they may be stuck or gone). Then it runs the ``atexit`` handlers, flushes stdout/stderr and
    calls ``os._exit``, skipping only interpreter finalisation, where gloo may abort."""
    import torch.distributed as dist

    code = exit_code
    rank = _rank()
    try:
        if code == 0:
            _join_threads()
            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # no rank closes its connections while a peer still uses them
                dist.destroy_process_group()
        getattr(atexit, "_run_exitfuncs", lambda: None)()  # loggers, trackers
    except BaseException:  # noqa: BLE001 - a failed ending is a failed run: say why, exit non-zero
        traceback.print_exc()
        code = code or 1
    if os.environ.get(REPORT_ENV) == "1":
        print(f"tsp_core.shutdown: rank {rank} exits with code {code}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_code_of(exc: BaseException) -> int:
    """The exit code Python would give for ``exc`` escaping the script (printing what it
    prints): ``SystemExit``'s code or message, otherwise the traceback and 1."""
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    traceback.print_exception(exc)
    return 1


@contextlib.contextmanager
def run_cleanly() -> Iterator[None]:
    """Run the block, then :func:`shutdown`: exit code 0 if it finished, the ``SystemExit`` code
    if it called ``sys.exit``, 1 with the traceback printed if it raised. Also a decorator
    (``@tsp_core.run_cleanly()``)."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends non-zero
        shutdown(exit_code_of(exc))
    shutdown(0)
