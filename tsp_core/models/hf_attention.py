"""The TSP attention module with the call signature of a Hugging Face attention module, so the
model's own decoder layer calls it unchanged (training, prefill, decode, KV sharing)."""

from __future__ import annotations

from typing import Any

import torch

from ..layers.attention import TSPAttention
from ..layers.attention.module import real_rotary


class HFTSPAttention(TSPAttention):
    """:class:`TSPAttention` with the call signature of a Hugging Face attention module."""

    rotary: bool = True  # False: a NoPE layer (DecoderPolicy.rotary)
    # KV sharing (DecoderPolicy.kv_sharing): "store" or "reuse" under kv_key; kv_source: the index
    # of the layer whose K/V a "reuse" layer attends with (its decode cache)
    kv_role: str | None = None
    kv_key: Any = None
    kv_source: int | None = None
    rope_half_width: bool = False  # the model's cos/sin hold each frequency once (gpt-oss)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs: Any):
        position_embeddings = real_rotary(position_embeddings)  # Llama 4's complex freqs_cis
        if cache is not None:
            raise NotImplementedError("TSP attention's forward takes no KV cache; generate with "
                                      "model.generate(...) or tsp_core.generate "
                                      "(tsp_core.inference.decode keeps its own "
                                      "sequence-sharded cache)")
        if self.rope_half_width and position_embeddings is not None:
            # Hugging Face's usual cos/sin repeat the frequencies (cat(freqs, freqs)); gpt-oss's
            # rotate halves with one copy: the same rotation once widened
            position_embeddings = tuple(torch.cat((t, t), dim=-1) for t in position_embeddings)
        if not self.rotary and position_embeddings is not None:
            # rope.apply rotates the first cos.shape[-1] channels: none, exactly the identity
            position_embeddings = tuple(t[..., :0] for t in position_embeddings)
        state = self.tsp_decode  # tsp_core.inference.decode: a decode step, or prefill's K/V sink
        if state is not None and state.decoding:
            return state.attention(self, hidden_states, position_embeddings), None
        shared = self._shared_kv(kwargs.get("shared_kv_states"))
        out = super().forward(hidden_states, position_embeddings=position_embeddings,
                              docs=kwargs.get("tsp_docs"),
                              kv_sink=None if state is None else state.sink, shared_kv=shared)
        if self.kv_role == "store":
            out, kv_all = out
            kwargs["shared_kv_states"][self.kv_key] = (kv_all,)
        return out, None

    def _shared_kv(self, states: Any) -> torch.Tensor | None:
        """The K/V this "reuse" layer attends with: what the layer that stores them put in the
        model's ``shared_kv_states`` in this forward (None for other layers)."""
        if self.kv_role is None:
            return None
        if states is None:
            raise ValueError(f"a KV-shared layer ({self.kv_role!r}) needs the model's "
                             f"shared_kv_states, which its forward passes every attention")
        if self.kv_role != "reuse":
            return None
        (kv_all,) = states[self.kv_key]
        if (torch.is_grad_enabled() and not kv_all.requires_grad
                and any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("a KV-shared layer got K/V without their gradient path: reentrant "
                               "activation checkpointing recomputes the storing layer after this "
                               "one; use gradient_checkpointing_enable(gradient_checkpointing_"
                               "kwargs={'use_reentrant': False})")
        return kv_all

