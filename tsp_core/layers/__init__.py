"""The TSP layers, each an ``nn.Module`` over a custom autograd schedule: attention, the gated
MLP, mixture of experts (with the bytes formula that picks its schedule), RMSNorm, rotary
embeddings, the vocabulary-parallel embedding and LM head with its loss, and the flash kernels
they call.

Imports only :mod:`tsp_core.distributed` and :mod:`tsp_core.sequence` (docs/design.md "Code
map")."""

from . import flash, mlp, moe, norm, rope, vocab
from .attention import TSPAttention
from .mlp import TSPGatedMLP
from .moe import TSPMoE
from .norm import TSPRMSNorm
from .vocab import TSPEmbedding, TSPLMHead

__all__ = ["TSPAttention", "TSPEmbedding", "TSPGatedMLP", "TSPLMHead", "TSPMoE", "TSPRMSNorm",
           "flash", "mlp", "moe", "norm", "rope", "vocab"]
