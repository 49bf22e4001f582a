"""Hugging Face causal LMs made TSP: :func:`.parallelize.parallelize` (``tsp_core.parallelize``)
reads the model into per-layer specs (:mod:`.reading`), checks them (:mod:`.checks`), builds the
TSP modules (:mod:`.build`) and wraps the model (:mod:`.wrap`, its runtime :mod:`.runtime`),
guided by one small policy per family (:mod:`.policies`); every rank's inputs are checked before
the first collective (:mod:`.input_checks`).

The top of the engine: imports every package below it (docs/design.md "Code map")."""

from ..distributed.model_state import TSPModelState, model_state
from . import input_checks, parallelize, policies
from .batches import check_padding_free, shard_full_batches
from .policies import DecoderPolicy, find_policy, register_policy
from .runtime import TSPCausalLM

__all__ = ["DecoderPolicy", "TSPCausalLM", "TSPModelState", "check_padding_free",
           "find_policy", "input_checks", "model_state", "parallelize", "policies",
           "register_policy", "shard_full_batches"]
