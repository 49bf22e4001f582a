"""A policy's ``modules`` group: :class:`ModuleNames`, where a family keeps each module that TSP
replaces or reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleNames:
    """The attribute names of a family's modules (defaults: the Llama layout shared by Mistral
    and Qwen2). Names, not modules: a policy describes a family before any model exists, and the
    same names find the modules again in a pipeline stage, a tensor-parallel baseline or a
    checkpoint's keys.

    On the causal LM: ``base_model`` and ``lm_head``. On the base model: ``embed``, ``layers``,
    ``final_norm``. In each decoder layer: ``attention``, ``mlp`` and the ``layer_norms`` TSP
    replaces (the layer's own forward applies them wherever the family puts them). A family adds
    what only it has: a layer's Gated DeltaNet (``linear_attention``), further embeddings and
    small replicated per-token modules (``extra_embeds``, ``base_replicated``,
    ``layer_replicated``: Gemma 4's per-layer inputs) and projections the Hugging Face model fuses
    into one Linear (``fused``: Phi-3)."""

    base_model: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str = "norm"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    mlp: str = "mlp"
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # the decoder layer's Gated DeltaNet module (Qwen3.5's linear attention): a layer that has it
    # has no softmax attention and runs TSPGatedDeltaNet (tsp_core.layers.linear_attention)
    linear_attention: str | None = None
    # further embeddings over a vocabulary on the base model, vocabulary-sharded like the main
    # one (Gemma 4's per-layer inputs, embed_tokens_per_layer), where the model has them
    extra_embeds: tuple[str, ...] = ()
    # small per-token Linears and RMSNorms on the base model and in each layer, replicated over
    # the TSP group (their gradients summed over it), where the model has them (Gemma 4's
    # per-layer input projections and norms); any parameter left unconverted is refused
    base_replicated: tuple[str, ...] = ()
    layer_replicated: tuple[str, ...] = ()
    # projections the Hugging Face model fuses into one Linear (Phi-3): (role, fused module,
    # parts in row order), role "attention" or "mlp"; the TSP module keeps the parts and names
    # them by the fused tensor in every full state dict and checkpoint (ShardedModule.fuse)
    fused: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    # the decoder layer's own nn.Dropout modules (Phi-3's resid_attn_dropout / resid_mlp_dropout):
    # each becomes a tsp_core.layers.dropout.RankDropoutModule of the same p, each rank's own masks
    layer_dropouts: tuple[str, ...] = ()

    def fused_in(self, role: str) -> dict[str, tuple[str, ...]]:
        """The fused projections of ``role`` ("attention" or "mlp"): fused name -> parts."""
        return {name: parts for r, name, parts in self.fused if r == role}
