"""Run an example script's ``main`` several times in one launch (a launch of 4 processes costs
more than a run): ``example_job.py SCRIPT ARGS1 [--then ARGS2 ...]`` runs ``main`` with
``sys.argv = [SCRIPT, *ARGS1]``, then with ARGS2, and so on, in these processes, inside
``tsp_core.run_cleanly`` as the script's own ``__main__`` block runs it. Before each run rank 0
prints ``example_job: run K`` to stdout (K from 0), so a test can split rank 0's output by run
(the other ranks' lines may land on either side of it)."""

from __future__ import annotations

import os
import sys

import tsp_core
from tests.support.launch import load_script

if __name__ == "__main__":
    script, runs = sys.argv[1], [[]]
    for arg in sys.argv[2:]:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would
    module = load_script(script, os.path.splitext(os.path.basename(script))[0])
    with tsp_core.run_cleanly():
        for k, args in enumerate(runs):
            if os.environ.get("RANK", "0") == "0":
                print(f"example_job: run {k}", flush=True)
            sys.argv = [script, *args]
            module.main()
