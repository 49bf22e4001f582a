"""Folded tensor-and-sequence parallelism (TSP) for PyTorch: every rank of a TSP group holds 1/D
of each weight matrix and 1/D of the tokens."""

from . import comm, guard, layout, metrics
from .attention import TSPAttention
from .checkpoint import full_state_dict, load_full_state_dict, save_pretrained
from .generation import generate
from .layout import position_ids, shard_batch, shard_sequence, unshard_sequence
from .logits import FullLogits, full_logits
from .mesh import TSPMesh, init_mesh
from .mlp import TSPGatedMLP
from .norm import TSPRMSNorm
from .parallelize import get_mesh, parallelize
from .resharding import latest_checkpoint, load_checkpoint, save_checkpoint
from .shutdown import run_cleanly, shutdown
from .vocab import TSPEmbedding, TSPLMHead

__all__ = ["FullLogits", "TSPAttention", "TSPEmbedding", "TSPGatedMLP", "TSPLMHead", "TSPMesh",
           "TSPRMSNorm", "comm", "full_logits", "full_state_dict", "generate", "get_mesh", "guard",
           "init_mesh",
           "latest_checkpoint", "layout", "metrics", "load_checkpoint", "load_full_state_dict", "parallelize",
           "position_ids", "run_cleanly", "shutdown",
           "save_checkpoint", "save_pretrained", "shard_batch", "shard_sequence", "unshard_sequence"]
