"""Folded tensor-and-sequence parallelism (TSP) for PyTorch: every rank of a TSP group holds 1/D
of each weight matrix and 1/D of the tokens."""

__version__ = "0.1.0"

from .distributed import comm, guard, metrics
from .distributed.mesh import TSPMesh, get_mesh, init_mesh
from .distributed.shutdown import run_cleanly, shutdown
from .inference.generation import generate
from .inference.logits import FullLogits, full_logits
from .layers.attention import TSPAttention
from .layers.mlp import TSPGatedMLP
from .layers.norm import TSPRMSNorm
from .layers.vocab import TSPEmbedding, TSPLMHead
from .models.parallelize import parallelize
from .pipeline import TSPPipeline, pipeline
from .sequence import layout
from .sequence.layout import position_ids, shard_batch, shard_sequence, unshard_sequence
from .state.checkpoint import full_state_dict, load_full_state_dict, save_pretrained
from .state.resharding import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["FullLogits", "TSPAttention", "TSPEmbedding", "TSPGatedMLP", "TSPLMHead", "TSPMesh",
           "TSPRMSNorm", "comm", "full_logits", "full_state_dict", "generate", "get_mesh", "guard",
           "init_mesh",
           "latest_checkpoint", "layout", "metrics", "load_checkpoint", "load_full_state_dict",
           "parallelize",
           "pipeline", "TSPPipeline",
           "position_ids", "run_cleanly", "shutdown",
           "save_checkpoint", "save_pretrained", "shard_batch", "shard_sequence",
           "unshard_sequence"]
