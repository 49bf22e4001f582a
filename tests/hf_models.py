"""Tiny random-init Hugging Face models of each supported family (nothing is downloaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

FAMILIES = ("llama", "llama-tied", "mistral", "qwen2")


def build(family: str, dtype: torch.dtype, seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=96, **COMMON))
    elif family == "llama-tied":   # tied embeddings, a vocabulary that needs padding at D = 2, 4
        model = LlamaForCausalLM(LlamaConfig(vocab_size=101, tie_word_embeddings=True, **COMMON))
    elif family == "mistral":      # sliding window smaller than the test sequences
        model = MistralForCausalLM(MistralConfig(vocab_size=96, sliding_window=7, **COMMON))
    elif family == "qwen2":        # q/k/v biases; layer 1 uses a sliding window
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, use_sliding_window=True,
                                             sliding_window=9, max_window_layers=1, **COMMON))
    else:
        raise ValueError(family)
    return model.to(dtype)


def reference_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unmodified model's loss on the full batch. In float32 it is HF's own loss; in float64
    the cross-entropy is taken from HF's logits in float64, because HF's ForCausalLMLoss casts
    logits to float32 first (that would cap agreement at ~1e-7)."""
    if model.dtype != torch.float64:
        return model(input_ids=ids, labels=labels).loss
    logits = model(input_ids=ids).logits
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
