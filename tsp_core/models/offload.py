"""Host offload of checkpointed decoder layers' saved inputs (docs/design.md "Long context")."""

from __future__ import annotations

from torch import nn


def install_activation_offload(model: nn.Module, layers: list[nn.Module]) -> None:
    """Not written yet: refuses, so that nothing silently runs without offload."""
    raise NotImplementedError("activation_offload is not implemented yet")
