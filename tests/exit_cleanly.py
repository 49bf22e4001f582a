"""Run a script (``python tests/exit_cleanly.py SCRIPT ARGS...``) and leave with its exit code
through ``os._exit``, after tearing the process groups down.

gloo can abort a process at interpreter exit ("terminate called without an active exception",
exit -6) when a peer has already closed its connections, even after destroy_process_group
(INTEGRATION_NOTES); under load this happened about once per full test run. The scripts' work is
complete by then, so the tests skip Python's finalisation instead of reading a teardown race as a
failure."""

from __future__ import annotations

import os
import runpy
import sys


def finish(code: int) -> None:
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        finish(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except BaseException:  # noqa: BLE001 - print it like Python would, then exit non-zero
        import traceback

        traceback.print_exc()
        finish(1)
    finish(0)
