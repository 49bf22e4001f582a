"""The TSP attention module with the call signature of a Hugging Face attention module, so the
model's own decoder layer calls it unchanged (training, prefill, decode, KV sharing)."""

from __future__ import annotations

from typing import Any

import torch

from ..layers.attention import TSPAttention
from ..layers.attention.module import rotary_inputs


class HFTSPAttention(TSPAttention):
    """:class:`TSPAttention` with the call signature of a Hugging Face attention module. Its
    rotary, NoPE layers and KV sharing are its parts (``self.parts``); ``kv_source``: on a layer
    that reuses K/V, the index of the layer that stores them (its decode cache)."""

    kv_source: int | None = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs: Any):
        if cache is not None:
            raise NotImplementedError("TSP attention's forward takes no KV cache; generate with "
                                      "model.generate(...) or tsp_core.generate "
                                      "(tsp_core.inference.decode keeps its own "
                                      "sequence-sharded cache)")
        state = self.tsp_decode  # tsp_core.inference.decode: a decode step, or prefill's K/V sink
        if state is not None and state.decoding:
            rotation = rotary_inputs(position_embeddings, self.parts.rotary)
            return state.attention(self, hidden_states, rotation), None
        shared = self._shared_kv(kwargs.get("shared_kv_states"))
        out = super().forward(hidden_states, position_embeddings=position_embeddings,
                              docs=kwargs.get("tsp_docs"),
                              kv_sink=None if state is None else state.sink, shared_kv=shared)
        if self.parts.gives_kv:
            out, kv_all = out
            kwargs["shared_kv_states"][self.parts.kv_sharing.key] = (kv_all,)
        return out, None

    def _shared_kv(self, states: Any) -> torch.Tensor | None:
        """The K/V this "reuse" layer attends with: what the layer that stores them put in the
        model's ``shared_kv_states`` in this forward (None for other layers)."""
        sharing = self.parts.kv_sharing
        if sharing is None:
            return None
        if states is None:
            raise ValueError(f"a KV-shared layer ({sharing.role!r}) needs the model's "
                             f"shared_kv_states, which its forward passes every attention")
        if not sharing.reuses:
            return None
        (kv_all,) = states[sharing.key]
        if (torch.is_grad_enabled() and not kv_all.requires_grad
                and any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("a KV-shared layer got K/V without their gradient path: reentrant "
                               "activation checkpointing recomputes the storing layer after this "
                               "one; use activation_checkpointing_enable(activation_"
                               "checkpointing_kwargs={'use_reentrant': False})")
        return kv_all

