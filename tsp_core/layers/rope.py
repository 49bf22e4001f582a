"""Rotary position embedding at global positions, in the Hugging Face convention
(``rotate_half``, ``emb = cat(freqs, freqs)``), so that HF weights give HF numbers; and the global
sequence length for Hugging Face rotary embeddings whose frequencies depend on it (dynamic NTK,
longrope)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def default_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def keep_frequencies(module: nn.Module, apply: Callable[[], nn.Module]) -> nn.Module:
    """Run ``apply`` (the module's ``Module._apply``: ``.to(dtype)``, ``.bfloat16()``, ``.half()``)
    without lowering the precision of its rotary frequency buffers (``inv_freq``): rounded to
    bfloat16 a frequency is off by up to 0.4%, so the angle at position 131071 is off by
    hundreds of radians. Lightning's ``bf16-true`` and DeepSpeed's ``bf16`` cast the whole module
    that way; device moves and casts to a wider type still apply."""
    kept = [(m, name, b) for m in module.modules() for name, b in m._buffers.items()
            if name.endswith("inv_freq") and b is not None and b.is_floating_point()]
    out = apply()
    for m, name, old in kept:
        new = m._buffers[name]
        if new is not None and torch.finfo(new.dtype).bits < torch.finfo(old.dtype).bits:
            m._buffers[name] = old.to(new.device)
    return out


def cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, L, head_dim] for ``position_ids`` [B, L], computed in float32."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved convention's rotate_half (GLM-4, Ernie 4.5): channel pairs (2i, 2i+1)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _interleave(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``cat(freqs, freqs)`` cos/sin in the interleaved convention: each frequency twice."""
    half = cos.shape[-1] // 2
    return (cos[..., :half].repeat_interleave(2, dim=-1),
            sin[..., :half].repeat_interleave(2, dim=-1))


def _convention(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """cos, sin [B, L, r] broadcast over heads, and the rotation, for either convention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        return (*_interleave(cos, sin), rotate_pairs)
    return cos, sin, rotate_half


def rotation_inputs(position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for :func:`apply` on activations of ``dtype``: in the wider of ``dtype`` and
    their own. The precision of the rotation is the one the family's rotary embedding gives:
    most return cos/sin in the activations' dtype (the rotation runs in it); Ernie 4.5's, OLMo
    2's and OLMo 3's return them in float32 (Llama 4's complex ``freqs_cis`` too) and rotate a
    bf16 q and k in float32, then round (Hugging Face's float32 island), which :func:`apply`
    then does too."""
    return tuple(t.to(torch.promote_types(t.dtype, dtype)) for t in position_embeddings)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, H, L, d] with cos, sin [B, L, r]: the first r <= d channels of each head
    (r < d: partial rotary, ``partial_rotary_factor``; the rest pass unchanged, as in HF).
    ``interleaved``: rotate channel pairs (2i, 2i+1) instead of (i, i + r/2), as GLM-4's and
    Ernie 4.5's ``apply_rotary_pos_emb`` do with the same cos/sin. With cos/sin wider than x
    (:func:`rotation_inputs`) the rotation runs in their dtype and the result is rounded to x's,
    as ``(q.float() * cos + rotate_half(q).float() * sin).to(q.dtype)`` does."""
    cos, sin, turn = _convention(cos, sin, interleaved)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return (_wide(x, cos) * cos + turn(_wide(x, cos)) * sin).to(x.dtype)
    rot, rest = _wide(x[..., :r], cos), x[..., r:]
    return torch.cat([(rot * cos + turn(rot) * sin).to(x.dtype), rest], dim=-1)


def apply_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleaved: bool = False) -> torch.Tensor:
    """Gradient through :func:`apply` (the rotation's transpose). With cos/sin wider than g, as
    autograd differentiates the wide rotation: each product rounded to g's dtype on its own,
    then their sum in g's dtype."""
    cos, sin, turn = _convention(cos, sin, interleaved)
    r = cos.shape[-1]
    if r == g.shape[-1]:
        return (_wide(g, cos) * cos).to(g.dtype) - turn((_wide(g, cos) * sin).to(g.dtype))
    rot, rest = _wide(g[..., :r], cos), g[..., r:]
    return torch.cat([(rot * cos).to(g.dtype) - turn((rot * sin).to(g.dtype)), rest], dim=-1)


def _wide(x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """x in cos's dtype when that is wider (the float32 island), else x itself."""
    return x.to(cos.dtype) if torch.finfo(cos.dtype).bits > torch.finfo(x.dtype).bits else x


# ------------------------------------------------ rope whose frequencies depend on the length

def length_dependent_types(rotary: nn.Module) -> list[str]:
    """The rope types of a Hugging Face rotary embedding whose frequencies depend on the sequence
    length (transformers' ``dynamic_rope_update``: any type containing "dynamic", and
    "longrope"); ``rope_type`` is a dict for models with one rope per layer type."""
    rope_type = getattr(rotary, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return [t for t in types if isinstance(t, str) and ("dynamic" in t or t == "longrope")]


def _hf_update_code() -> Any:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


class GlobalLengthRotary:
    """Mixed in before a Hugging Face rotary embedding class whose frequencies depend on the
    sequence length. Hugging Face recomputes them from ``max(position_ids) + 1`` in the forward;
    under TSP each rank holds other positions (zigzag, documents padded to 2D), so that maximum
    differs between ranks. Here the frequencies come from ``tsp_rope_len``, the length the
    unmodified model sees on the whole batch (identical on every rank, set by the TSP forward and
    by generation through :func:`global_length`): Hugging Face's own update runs on a one-token
    probe at position ``tsp_rope_len - 1`` (the same state changes as the one-process forward,
    dynamic NTK's growth and reset included), then the undecorated forward rotates the local
    positions."""

    tsp_rope_len: int | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        n = self.tsp_rope_len
        if n is None:
            raise ValueError(f"{type(self).__name__} ({', '.join(length_dependent_types(self))} "
                             f"rope) computes its frequencies from the sequence length, which a "
                             f"TSP rank does not see: call it under "
                             f"tsp_core.layers.rope.global_length, or feed the model batches from "
                             f"tsp_core.shard_batch (tsp_rope_len)")
        kw = {} if layer_type is None else {"layer_type": layer_type}
        update_then_forward = super().forward  # type: ignore[misc]
        probe = torch.full((1, 1), n - 1, dtype=position_ids.dtype, device=position_ids.device)
        update_then_forward(x[:1, :1], probe, **kw)
        return update_then_forward.__wrapped__(self, x, position_ids, **kw)


_CLASSES: dict[type, type] = {}


def length_dependent_rotaries(model: nn.Module) -> list[nn.Module]:
    """The rotary embeddings of ``model`` whose frequencies depend on the sequence length. Raises
    if one of them does not update through transformers' ``dynamic_rope_update`` (TSP could not
    give it the global length)."""
    found, hf_code = [], None
    for name, m in model.named_modules():
        types = length_dependent_types(m)
        if not types or isinstance(m, GlobalLengthRotary):
            continue
        hf_code = hf_code or _hf_update_code()
        forward = type(m).forward
        if getattr(forward, "__code__", None) is not hf_code or not hasattr(forward, "__wrapped__"):
            raise NotImplementedError(
                f"{name} ({type(m).__name__}) uses rope_type {types}, whose frequencies depend on "
                f"the sequence length, but its forward is not transformers' dynamic_rope_update; "
                f"TSP cannot give it the global length (each rank would use its own)")
        found.append(m)
    return found


def use_global_length(rotaries: list[nn.Module]) -> None:
    """Swap each rotary's class for one whose forward takes the global length (in place)."""
    for m in rotaries:
        cls = type(m)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"TSP{cls.__name__}", (GlobalLengthRotary, cls), {})
        m.__class__ = _CLASSES[cls]


@contextmanager
def global_length(rotaries: Sequence[nn.Module], seq_len: int | None) -> Iterator[None]:
    """Let length-dependent rotaries (from :func:`use_global_length`) compute their frequencies
    from ``seq_len`` (the unmodified model's ``max(position_ids) + 1`` on the whole batch)."""
    saved = [m.tsp_rope_len for m in rotaries]
    for m in rotaries:
        m.tsp_rope_len = seq_len
    try:
        yield
    finally:
        for m, s in zip(rotaries, saved):
            m.tsp_rope_len = s
