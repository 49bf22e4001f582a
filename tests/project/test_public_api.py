"""The public face: ``tsp_core.__all__`` is the set of names users import, whatever package each
now lives in; every name imports and is what its home package offers."""

from __future__ import annotations

import importlib

import tsp_core

PUBLIC = {"FullLogits", "TSPAttention", "TSPEmbedding", "TSPGatedMLP", "TSPLMHead", "TSPMesh",
          "TSPRMSNorm", "comm", "full_logits", "full_state_dict", "generate", "get_mesh", "guard",
          "init_mesh", "latest_checkpoint", "layout", "load_checkpoint", "load_full_state_dict",
          "metrics", "parallelize", "pipeline", "TSPPipeline", "position_ids", "run_cleanly",
          "save_checkpoint",
          "save_pretrained", "shard_batch", "shard_sequence", "shutdown", "unshard_sequence"}

HOMES = {"comm": "tsp_core.distributed.comm", "guard": "tsp_core.distributed.guard",
         "metrics": "tsp_core.distributed.metrics", "layout": "tsp_core.sequence.layout"}


def test_all_is_the_public_set():
    assert len(tsp_core.__all__) == len(set(tsp_core.__all__))
    assert set(tsp_core.__all__) == PUBLIC


def test_every_public_name_imports():
    namespace: dict = {}
    exec("from tsp_core import *", namespace)  # noqa: S102 - what a user's star import sees
    missing = PUBLIC - set(namespace)
    assert not missing, f"not importable from tsp_core: {sorted(missing)}"
    for name in PUBLIC:
        assert getattr(tsp_core, name) is namespace[name]


def test_public_modules_are_their_packages_modules():
    for name, home in HOMES.items():
        assert getattr(tsp_core, name) is importlib.import_module(home)


def test_public_functions_come_from_their_layer():
    # the face re-exports; it defines nothing of its own
    for name in PUBLIC - set(HOMES):
        module = getattr(tsp_core, name).__module__
        assert module.startswith("tsp_core.") and module.count(".") >= 2, (name, module)
