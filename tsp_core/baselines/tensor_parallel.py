"""Megatron tensor parallelism on a Hugging Face decoder, built from PyTorch's own
``torch.distributed.tensor.parallel`` styles (as torchtitan does).

- ``tp``: q/k/v, gate/up column-parallel, o/down row-parallel (one all-reduce after each);
  norms and the residual stream replicated; vocabulary-parallel embedding and LM head.
- ``tp-sp`` (sequence parallel): the residual stream and norms are split over the sequence; the
  all-reduces become an all-gather before and a reduce-scatter after each block.

Sparse mixture-of-experts blocks (Mixtral) get Megatron's tensor-parallel experts
(:mod:`tsp_core.baselines.moe`): replicated router, every expert's channels split 1/T, the same
collectives as the dense MLP.

Both end in a vocabulary-parallel cross-entropy (``loss_parallel``), so no rank holds logits of
the whole vocabulary.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models.policies import DecoderPolicy
from .moe import apply_moe, check_moe


def check_tensor_parallel(config, tp: int) -> None:
    """Raise, naming the numbers, when the heads or channels cannot be split over ``tp`` ranks."""
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    for what, n in (("num_attention_heads", nq), ("num_key_value_heads", nkv),
                    ("intermediate_size", config.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor-parallel size ({tp}) must divide {what} ({n}) for the tp "
                             f"baselines (Megatron would replicate key/value heads; not built)")


def layer_plan(policy: DecoderPolicy, sequence_parallel: bool,
               moe: bool = False) -> dict[str, object]:
    """Parallel styles of one decoder layer, by module name (``moe``: its MLP is a sparse experts
    block, laid out by :func:`tsp_core.baselines.moe.apply_moe` instead)."""
    a, m = policy.modules.attention, policy.modules.mlp
    plan: dict[str, object] = {f"{a}.{p}": ColwiseParallel()
                               for p in ("q_proj", "k_proj", "v_proj")}
    # Each block's input becomes a DTensor once, at the block (as torchtitan does): its gradient
    # is then reduced once per block, not once per projection (q, k, v / gate, up).
    seq = Shard(1) if sequence_parallel else Replicate()
    plan |= {f"{a}.o_proj": RowwiseParallel(output_layouts=seq),
             a: PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})}
    if not moe:
        plan |= {f"{m}.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}
        plan |= {f"{m}.down_proj": RowwiseParallel(output_layouts=seq),
                 m: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))}
    if sequence_parallel:
        plan |= {norm: SequenceParallel() for norm in policy.modules.layer_norms}
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, policy: DecoderPolicy,
                          sequence_parallel: bool) -> None:
    """Shard ``model`` in place over the 1-D ``mesh``; the LM head's output stays a vocabulary-
    sharded DTensor for ``loss_parallel``."""
    check_tensor_parallel(model.config, mesh.size())
    check_moe(model.config, policy, mesh.size())
    base = getattr(model, policy.modules.base_model)
    embed, head = getattr(base, policy.modules.embed), getattr(model, policy.modules.lm_head)
    tied = head.weight is embed.weight
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq))
    for layer in getattr(base, policy.modules.layers):
        moe = policy.ffn.sparse_mlp(getattr(layer, policy.modules.mlp))
        parallelize_module(layer, mesh, layer_plan(policy, sequence_parallel, moe))
        if moe:
            apply_moe(layer, policy, model.config, mesh, sequence_parallel)
    if sequence_parallel:
        parallelize_module(getattr(base, policy.modules.final_norm), mesh, SequenceParallel())
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                                   use_local_output=False))
    if tied:  # both are Shard(0) over the vocabulary: keep one parameter
        head.weight = embed.weight
