"""The TSP side of a comparison: gradients gathered from a TSP model's shards by Hugging Face
name, and the parameter bytes a rank holds. These call tsp_core on purpose (they read the model
under test); the references in ``hf_models``, ``norm_reference`` and ``moe_reference`` do not."""
from __future__ import annotations

import torch


def full_grads(model) -> dict[str, torch.Tensor]:
    """Gradients by Hugging Face name and full shape: a plain model's ``.grad``; of a TSP model
    the gathered shards (every rank of the TSP group must call it; KV-head and vocabulary
    padding dropped and fused tensors such as Phi-3's ``qkv_proj`` assembled, as in
    ``tsp_core.full_state_dict``)."""
    from tsp_core.distributed.params import ShardedModule, local

    out: dict[str, torch.Tensor] = {}
    owned, seen = set(), set()
    for prefix, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, ShardedModule):
            pre = f"{prefix}." if prefix else ""
            # its own parameters (a LoRA adapter inside it gives its own, tsp_core.layers.lora)
            owned |= {pre + n for n, _ in m.own_parameters()}
            # a tied weight under its first name only, as model.named_parameters() gives it
            fresh = {m.hf_name(n) for n, p in m.own_parameters() if id(p) not in seen}
            seen |= {id(p) for _, p in m.own_parameters()}
            if fresh:
                out.update({pre + n: g for n, g in m.full_tensors(grads=True).items()
                            if n in fresh})
    for name, p in model.named_parameters():
        if name not in owned and p.grad is not None:
            out[name] = local(p.grad).detach().clone()
    return out


def storage_bytes(model) -> int:
    """Bytes of parameter storage this rank holds, measured: every distinct storage once (FSDP2's
    shards are views into per-layer buffers)."""
    from tsp_core.distributed.params import local

    seen = {}
    for p in model.parameters():
        s = local(p).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
