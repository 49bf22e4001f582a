"""LoRA adapters cost activation memory only in tensors of their rank: an adapted TSP attention
and gated MLP (the base frozen, r = 16 on every projection) grow, per local token, by at most a
few [tokens, r] tensors more than the same layer fully fine-tuned (docs/long-context.md "With
LoRA").

Measured, not read from the code, as tests/layers/test_attention_floor.py measures: one layer of
the Llama-3.1-8B shape (h 4096, 32/8 heads of 128; MLP 14336) as rank 0 of D = 4, under
FakeTensorMode with the fake process group and MemTracker (as ``tsp simulate``), at S and 4S
tokens, in the session's simulation workers. What the forward and the backward add from their
start to their peak grows from S to 4S; the growth per local token of the adapted layer may
exceed the fully trained one's by the adapters' rank-r tensors only (ALLOWED_PER_TOKEN). The
layer as it was before its memory fix (its adapters' terms added out of place: the output
adapter's ``y + (z B^T) s``, each input adapter's share of the input gradient a tensor of the
input's size added to the schedule's) grows by more than a [tokens, hidden] tensor more in the
MLP, and fails (in the attention they fall outside its peaks, which are in its rounds)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

H, F, HEADS, KV, HEAD_DIM, D = 4096, 14336, 32, 8, 128, 4
SEQ, RANK = 65536, 16
NAMES = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
         "mlp": ("gate_proj", "up_proj", "down_proj")}
# per adapter and local token: u (or z) and its gradient, and one more of each, of rank r in bf16
ALLOWED_PER_TOKEN = {kind: 4 * len(names) * RANK * 2 for kind, names in NAMES.items()}


@contextlib.contextmanager
def old_layer(broken: bool) -> Iterator[None]:
    """With ``broken``, the adapters' terms as autograd wrote them before the fix."""
    from tsp_core.layers import lora

    add, inputs = lora.AddLowRank.apply, lora.LowRankInputs.apply
    if broken:
        lora.AddLowRank.apply = lambda y, z, b, s: y + (z @ b.t()) * s
        lora.LowRankInputs.apply = lambda x, scalings, *a: (
            x, *[(x @ ai.t()) * si for ai, si in zip(a, scalings)])
    try:
        yield
    finally:
        lora.AddLowRank.apply, lora.LowRankInputs.apply = add, inputs


def build(kind: str, mesh, lora: bool):
    """The TSP layer ``kind`` in bf16: fully trainable, or frozen with rank-RANK adapters on
    every projection (their A and B float32, as PEFT leaves them)."""
    import torch

    from tsp_core.layers.attention import AttentionShape, TSPAttention
    from tsp_core.layers.lora import INPUT_SIDE, AdapterSpec, TSPLoRA
    from tsp_core.layers.mlp import TSPGatedMLP

    if kind == "mlp":
        layer = TSPGatedMLP(mesh, H, F, dtype=torch.bfloat16)
        dims = {"gate_proj": (H, F), "up_proj": (H, F), "down_proj": (F, H)}
    else:
        layer = TSPAttention(mesh, AttentionShape(H, HEADS, KV, HEAD_DIM), dtype=torch.bfloat16)
        q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
        dims = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}
    if not lora:
        return layer
    for p in layer.parameters():
        p.requires_grad_(False)
    for name in NAMES[kind]:
        fan_in, fan_out = dims[name]
        adapter = TSPLoRA(mesh, getattr(layer, name), {"default": AdapterSpec(RANK, 2.0)},
                          "default", fan_in, fan_out,
                          side="input" if name in INPUT_SIDE else "output",
                          base_spec=layer.shard_spec(f"{name}.weight", mesh.rank),
                          dtype=torch.float32)
        for n, p in adapter.named_parameters():
            p.requires_grad_(n.startswith("lora_"))
        setattr(layer, name, adapter)
    return layer


def phases(kind: str, seq: int, lora: bool, broken: bool = False) -> tuple[int, int]:
    """(bytes the forward adds from its start to its peak, the backward's), one layer, rank 0
    of a D-rank fake world; runs in a worker process that owns the default process group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _ModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tsp_core
    from tsp_core.plan.lora_sim import tracker_class

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=D)
    try:
        mesh = tsp_core.init_mesh(D)
        with FakeTensorMode(), old_layer(broken):
            layer = build(kind, mesh, lora)
            tracker = tracker_class()()  # hooks the gradients of trainable parameters only
            tracker.track_external(layer)
            with tracker:
                x = torch.empty(1, seq // D, H, dtype=torch.bfloat16, requires_grad=True)
                args = (x,) if kind == "mlp" else (x, tsp_core.position_ids(seq, 0, D)[None])
                layer(*args).backward(torch.empty_like(x))
            snaps = tracker.memory_tracking[layer].snapshots
            out = []
            for start, peak in ((_ModState.PRE_FW, _ModState.PEAK_FW),
                                (_ModState.PRE_BW, _ModState.PEAK_BW)):
                (a,), (b,) = snaps[start][0].values(), snaps[peak][0].values()
                out.append(int(b["Total"]) - int(a["Total"]))
            return tuple(out)
    finally:
        dist.destroy_process_group()


VARIANTS = {"full": (False, False), "lora": (True, False), "lora before the fix": (True, True)}


def test_adapters_add_only_rank_r_tensors_per_token(simulations):
    # the old layer's extra tensors fall outside the attention's own peaks (in its rounds): the
    # MLP's show them
    runs = [(kind, seq, variant) for kind in NAMES for variant in VARIANTS
            for seq in (SEQ, 4 * SEQ) if kind == "mlp" or variant != "lora before the fix"]
    got = dict(zip(runs, simulations.map(phases, *zip(*[(k, s, *VARIANTS[v])
                                                         for k, s, v in runs]))))
    tokens = 3 * SEQ // D  # local tokens from S to 4S

    def per_token(kind: str, variant: str) -> list[float]:
        small, large = got[kind, SEQ, variant], got[kind, 4 * SEQ, variant]
        return [(b - a) / tokens for a, b in zip(small, large)]

    for kind, allowed in ALLOWED_PER_TOKEN.items():
        full = per_token(kind, "full")
        for variant in ("lora", "lora before the fix")[:2 if kind == "mlp" else 1]:
            extra = [b - a for a, b in zip(full, per_token(kind, variant))]
            what = (f"{kind}, {variant}: the forward and backward grow by {extra} bytes per "
                    f"local token more than full fine-tuning's {full}; allowed {allowed}")
            if variant == "lora":
                assert max(extra) <= allowed, what
            else:  # more than one [tokens, hidden] bf16 tensor beyond the allowance
                assert max(extra) > allowed + 2 * H, what
