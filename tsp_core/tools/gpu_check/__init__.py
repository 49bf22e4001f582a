"""``./run gpu-check``: one prepared script that proves tsp_core's CUDA path on a GPU and measures
it (docs/gpu.md). ``--device cpu`` runs the same checks at small shapes, so CI proves the script.

(a) :mod:`.flash_part`: flash pieces vs a dense float64 reference; (b) :mod:`.model_part`: a whole
TSP model at tsp 1 vs Hugging Face (training and generation); (c) and (d) :mod:`.layer_part`: one
rank's compute of a 7B layer at D = 8 (fake process group) and a plain HF layer, timed, with
memory against ``tsp simulate``; (e) :mod:`.long_context_part`: host offload on vs off and tiled
vs untiled MLP and loss, timed and measured, their exactness checked; (f) :mod:`.compile_part`:
one Llama-3-8B-shaped TSP layer at tsp 1, eager and compiled, tokens/s, peak memory and the same
loss. Each check function can be called on its own.
"""

from .common import Check

__all__ = ["Check", "main"]


def main(argv: list[str] | None = None) -> int:
    from .runner import main as run

    return run(argv)
