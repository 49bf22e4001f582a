"""Hugging Face causal LMs made TSP: :func:`.parallelize.parallelize` (``tsp_core.parallelize``)
swaps each decoder layer's attention, MLP or experts, norms, embedding and head for the TSP
layers, guided by one small policy per family (:mod:`.policies`), and checks every rank's inputs
before the first collective (:mod:`.input_checks`).

The top of the engine: imports every package below it (docs/design.md "Code map")."""

from . import input_checks, parallelize, policies
from .parallelize import TSPCausalLM
from .policies import DecoderPolicy, find_policy, register_policy

__all__ = ["DecoderPolicy", "TSPCausalLM", "find_policy", "input_checks", "parallelize",
           "policies", "register_policy"]
