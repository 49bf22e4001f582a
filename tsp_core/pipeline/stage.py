"""One pipeline stage: a run of whole decoder layers of a Hugging Face causal LM made TSP on the
stage's own TSP group (torch's ``PipelineStage`` around it, with its sends and receives counted,
is :mod:`.counted_stage`'s).

The stage is a copy of the model that holds only its layers, converted by
:func:`tsp_core.parallelize` on the stage's mesh (every dim but "pp"); the first stage keeps the
embedding, the last the final norm and the vocabulary-parallel head, whose forward returns this
rank's summed cross-entropy (the schedule's loss function makes it the global mean). Activations
between stages are each rank's own token shard ``[b, S/D, h]``, so the next stage's rank of the same
TSP position takes them as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..distributed.data_parallel import install_gradient_sync
from ..distributed.fsdp import apply_fsdp
from ..distributed.mesh import TSPMesh
from ..distributed.model_state import model_state
from ..layers import rope
from ..models.parallelize import parallelize
from ..models.policies import DecoderPolicy


class StageModule(nn.Module):
    """The part of the model one stage runs. ``forward`` takes the first stage's token ids or
    the previous stage's hidden states ``[b, S/D, h]`` and returns the hidden states, or on the
    last stage this rank's sum of the cross-entropy of its tokens (a scalar)."""

    def __init__(self, model: nn.Module, policy: DecoderPolicy, layers: range, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.model = model
        self.layers, self.first, self.last = layers, first, last
        self._policy = policy

    @property
    def base(self) -> nn.Module:
        return getattr(self.model, self._policy.modules.base_model)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                shift_labels: torch.Tensor | None = None, tsp_docs: torch.Tensor | None = None,
                tsp_rope_len: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if tsp_docs is not None:  # one host transfer per micro-batch, as TSPCausalLM's forward
            kwargs["tsp_docs"] = tuple(tuple(n for n in row if n) for row in tsp_docs.tolist())
        ropes = model_state(self.model).ropes
        rope_len = (int(tsp_rope_len.max()) if ropes and tsp_rope_len is not None else None)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with rope.global_length(ropes, rope_len):
            out = self.base(position_ids=position_ids, use_cache=False, **inputs, **kwargs)
        hidden = out.last_hidden_state
        if not self.last:
            return hidden
        head = getattr(self.model, self._policy.modules.lm_head)
        return head.loss_sum(head.scale_input(hidden), shift_labels)

    def global_name(self, name: str) -> str:
        """The unmodified model's name of this stage model's ``name`` (global layer index)."""
        prefix = f"{self._policy.modules.base_model}.{self._policy.modules.layers}."
        if not name.startswith(prefix):
            return name
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{self.layers[int(index)]}.{rest}"


def copy_stage(model: nn.Module, policy: DecoderPolicy, layers: range) -> nn.Module:
    """A deep copy of ``model`` holding only the decoder layers ``layers`` (the rest of the model
    whole); ``model`` is left as it was."""
    base = getattr(model, policy.modules.base_model)
    every = getattr(base, policy.modules.layers)
    setattr(base, policy.modules.layers, nn.ModuleList([every[i] for i in layers]))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(base, policy.modules.layers, every)


def build_stage_module(model: nn.Module, policy: DecoderPolicy, mesh: TSPMesh, layers: range,
                       first: bool, last: bool, **parallelize_options: Any) -> StageModule:
    """Convert a copy of ``model`` holding ``layers`` to TSP on the stage mesh ``mesh``, drop the
    embedding unless ``first`` and the final norm and head unless ``last``, then apply data
    parallelism to the stage (FSDP2 over ``mesh.shard_dim``, else summed gradients)."""
    stage_model = copy_stage(model, policy, layers)
    # parallelize sees a mesh without FSDP2: the stage module is the root FSDP2 wraps below (its
    # forward is the one torch's schedule calls), and parallelize's gradient sync hooks the
    # model's own forward, which the stage never calls
    plain = TSPMesh(mesh.device_mesh, mesh.dim, mesh.layout)
    parallelize(stage_model, plain, **parallelize_options)
    base = getattr(stage_model, policy.modules.base_model)
    if not first:
        setattr(base, policy.modules.embed, None)
    if not last:
        setattr(base, policy.modules.final_norm, nn.Identity())
        setattr(stage_model, policy.modules.lm_head, None)
    module = StageModule(stage_model, policy, layers, first, last)
    if mesh.fsdp_size > 1:
        apply_fsdp(module, mesh, list(getattr(base, policy.modules.layers)))
    else:
        install_gradient_sync(module, mesh)
    return module
