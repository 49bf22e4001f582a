"""Run a recipe of examples/recipes/ twice in one launch: ``RECIPE ARGS...`` runs
``main(ARGS + --steps 2)`` (which saves a checkpoint at step 2), then ``main(ARGS + --steps 4
--resume)``, which builds everything again from the files (model, optimizer, data, framework
objects) and continues from that checkpoint. One launch instead of two keeps the suite's time
down; the only channel between the two runs is the checkpoint on disk (and Accelerate's process
group, kept for the second run)."""

from __future__ import annotations

import importlib
import os
import sys

import tsp_core

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "recipes")

if __name__ == "__main__":
    sys.path.insert(0, RECIPES)  # as `python examples/recipes/<name>_finetune.py` would
    recipe, args = importlib.import_module(f"{sys.argv[1]}_finetune"), sys.argv[2:]
    if sys.argv[1] == "accelerate":
        # end_training finishes the trackers and destroys the process group, which the second
        # run in these processes still needs: keep the first part (run_cleanly destroys it)
        from accelerate import Accelerator

        Accelerator.end_training = lambda self: [t.finish() for t in self.trackers]
    with tsp_core.run_cleanly():
        recipe.main(args + ["--steps", "2"])
        recipe.main(args + ["--steps", "4", "--resume"])
