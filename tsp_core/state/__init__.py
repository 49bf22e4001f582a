"""Model and optimizer state: Hugging Face state dicts and safetensors checkpoints in full shapes,
and distributed checkpoints that reshard to any TSP degree, FSDP2 shape or one process.

Imports only the layers below it (docs/design.md "Code map"); the TSP model class offers
``save_pretrained`` from here."""

from . import checkpoint, resharding
from .checkpoint import full_state_dict, load_full_state_dict, save_pretrained
from .resharding import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["checkpoint", "full_state_dict", "latest_checkpoint", "load_checkpoint",
           "load_full_state_dict", "resharding", "save_checkpoint", "save_pretrained"]
