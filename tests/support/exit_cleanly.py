"""Run a script (``python tests/support/exit_cleanly.py SCRIPT ARGS...``) inside
``tsp_core.run_cleanly``: the script's exit code (1 with its traceback if it raised) through
``tsp_core.shutdown``, which tears the process groups down and skips interpreter finalisation, where
gloo can abort a finished job (docs/cluster.md "Ending a run").

For job scripts that end without ``tsp_core.shutdown`` of their own. A failure while ending
(barrier or destroy raising, a peer gone) still exits non-zero with a traceback, and with
``TSP_EXIT_REPORT=1`` (tests/support/launch.py sets it) every rank prints its exit line, which the
launching test checks."""

from __future__ import annotations

import os
import runpy
import sys

from tsp_core.distributed.shutdown import run_cleanly, shutdown

finish = shutdown  # the name tests/jobs/lightning_job.py imports

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would
    with run_cleanly():
        runpy.run_path(script, run_name="__main__")
