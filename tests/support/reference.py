"""Single-process references written from the math, independent of tsp_core's kernels: explicit
score matrices and masks, plain autograd."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def rope(t: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """t [B, H, S, d] rotated at positions pos [S] (HF rotate_half convention, float32 angles)."""
    freqs = pos[:, None].float() * inv_freq(t.shape[-1], theta)[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
    half = t.shape[-1] // 2
    rot = torch.cat([-t[..., half:], t[..., :half]], -1)
    return t * cos + rot * sin


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
              head_dim: int, *, causal: bool = True, window: int | None = None,
              chunk: int | None = None, qk_norm: str | None = None,
              values: Callable[[torch.Tensor], torch.Tensor] | None = None,
              eps: float = 1e-6, output_gate: bool = False) -> torch.Tensor:
    """``qk_norm``: RMSNorms of q and k scaled by ``1 + w[q_norm.weight]`` (Gemma's numerics, in
    the input's dtype), over each head ("head") or over all heads of a token ("all", OLMo 2).
    ``chunk``: Llama 4's chunked mask (query i sees only keys j with j // chunk == i // chunk).
    With ``w["sinks"]`` [num_heads], gpt-oss's sinks in Hugging Face's eager order: a column of
    each head's sink logit beside the scores, the softmax, the column dropped. ``values``: a
    function of each value head's vectors [..., head_dim] applied after the projection (Gemma
    4's RMS norm without a scale); without ``w["v_proj.weight"]`` the
    values are the key projection's output before its norm and RoPE (Gemma 4's k_eq_v).
    ``output_gate`` (Qwen3.5): ``q_proj`` gives per head [query | gate], 2 * head_dim rows, and
    the attention output is multiplied by sigmoid(gate) before ``o_proj``."""
    B, S, _ = x.shape
    pos = torch.arange(S)

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)

    def proj(name: str, n: int) -> torch.Tensor:
        if name == "v" and "v_proj.weight" not in w:
            name = "kv"  # the key projection, without the key norm
        p = "k" if name == "kv" else name
        y = F.linear(x, w[f"{p}_proj.weight"], w.get(f"{p}_proj.bias"))
        if output_gate and name == "q":  # each head's rows: [query | gate]
            y = y.view(B, S, n, 2, head_dim)[:, :, :, 0].reshape(B, S, n * head_dim)
        if qk_norm == "all" and name in ("q", "k"):
            y = rms(y, w[f"{name}_norm.weight"])
        y = y.view(B, S, n, head_dim)
        if qk_norm == "head" and name in ("q", "k"):
            y = rms(y, w[f"{name}_norm.weight"])
        return y.transpose(1, 2)

    q = rope(proj("q", num_heads), pos)
    k = rope(proj("k", num_kv_heads), pos)
    v = proj("v", num_kv_heads)
    if values is not None:
        v = values(v)
    g = num_heads // num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) * head_dim ** -0.5
    i, j = pos[:, None], pos[None, :]
    visible = torch.ones(S, S, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= j > i - window
    if chunk is not None:
        visible &= j // chunk == i // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if "sinks" in w:
        sink = w["sinks"].reshape(1, -1, 1, 1).expand(B, -1, S, 1)
        scores = torch.cat([scores, sink], -1)
    a = (torch.softmax(scores, -1)[..., :S] @ v).transpose(1, 2).reshape(B, S, -1)
    if output_gate:
        q_rows = F.linear(x, w["q_proj.weight"], w.get("q_proj.bias"))
        a = a * torch.sigmoid(q_rows.view(B, S, num_heads, 2, head_dim)[:, :, :, 1].flatten(2))
    return F.linear(a, w["o_proj.weight"], w.get("o_proj.bias"))


def gated_mlp(x: torch.Tensor, w: dict[str, torch.Tensor],
              activation: str = "silu") -> torch.Tensor:
    g = F.linear(x, w["gate_proj.weight"], w.get("gate_proj.bias"))
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    up = F.linear(x, w["up_proj.weight"], w.get("up_proj.bias"))
    return F.linear(act * up, w["down_proj.weight"], w.get("down_proj.bias"))


def assert_same_state(got: dict, want: dict, what: str, skip: frozenset = frozenset()) -> None:
    """Bit for bit: ``got`` has ``want``'s names (all but ``skip``), dtypes and values."""
    names = sorted(set(want) - skip)
    assert sorted(got) == names, f"{what}: {sorted(set(got) ^ set(names))}"
    for name in names:
        t = want[name]
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{what}: {name}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Fail loudly unless max|actual - expected| <= tol * max(1, max|expected|)."""
    assert actual.shape == expected.shape, \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected| (the absolute error where ``expected`` is all zero),
    so a small tensor such as a norm's weight gradient is held to the same digits as a large
    one."""
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                       tol: float, what: str) -> None:
    """Every parameter's gradient by name within relative error ``tol`` (:func:`relative_error`)
    of the reference's: the weights after AdamW steps hide a gradient of the wrong scale (AdamW
    divides it out), the gradients themselves do not. Names every parameter off, worst first."""
    assert sorted(actual) == sorted(expected), \
        f"{what}: gradient names differ: {sorted(set(actual) ^ set(expected))}"
    off = []
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, \
            f"{what}: gradient of {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        rel = relative_error(got, want)
        if not rel <= tol:  # NaN fails too
            off.append((rel, name))
    off.sort(key=lambda e: -e[0] if e[0] == e[0] else float("-inf"))
    assert not off, f"{what}: " + "; ".join(
        f"gradient of {name}: relative error {rel:.3e} > {tol:.0e}" for rel, name in off)
