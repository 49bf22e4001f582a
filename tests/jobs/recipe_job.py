"""Run recipes of examples/recipes/ in one launch: ``RECIPE[,RECIPE...] ARGS...`` runs, for each
recipe in turn, ``main(ARGS + --steps 2)`` (which saves a checkpoint at step 2), then
``main(ARGS + --steps 4 --resume)``, which builds everything again from the files (model,
optimizer, data, framework objects) and continues from that checkpoint. ARGS' ``--out OUT``
becomes ``OUT/RECIPE``; before each recipe rank 0 prints ``recipe_job: RECIPE``. One launch
instead of two per recipe, and one for several recipes, keeps the suite's time down; the only
channel between a recipe's two runs is the checkpoint on disk (and Accelerate's process group,
kept for the second run). A recipe that follows another finds the processes as it left them."""

from __future__ import annotations

import importlib
import os
import sys

import tsp_core

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "recipes")

if __name__ == "__main__":
    sys.path.insert(0, RECIPES)  # as `python examples/recipes/<name>_finetune.py` would
    names, args = sys.argv[1].split(","), sys.argv[2:]
    out = args.index("--out") + 1
    if "accelerate" in names:
        # end_training finishes the trackers and destroys the process group, which the second
        # run in these processes still needs: keep the first part (run_cleanly destroys it)
        from accelerate import Accelerator

        Accelerator.end_training = lambda self: [t.finish() for t in self.trackers]
    with tsp_core.run_cleanly():
        for name in names:
            if os.environ.get("RANK", "0") == "0":
                print(f"recipe_job: {name}", flush=True)
            recipe = importlib.import_module(f"{name}_finetune")
            own = [*args[:out], os.path.join(args[out], name), *args[out + 1:]]
            recipe.main(own + ["--steps", "2"])
            recipe.main(own + ["--steps", "4", "--resume"])
