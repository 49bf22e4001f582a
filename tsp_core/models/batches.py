"""Full-sequence batches for loops the user does not write (Fabric, Accelerate, the Trainer):
:func:`shard_full_batches` lets ``model(**batch)`` shard the batch itself, and
:func:`check_padding_free` checks TRL's padding-free keys against the documents they describe."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..distributed.mesh import get_mesh
from ..distributed.model_state import model_state
from ..sequence.layout import document_lengths, shard_batch


def shard_full_batches(model: nn.Module) -> nn.Module:
    """Let ``model(**batch)`` take the full-sequence batch (``input_ids`` and optionally
    ``labels``, ``attention_mask``, ``position_ids``/``cu_seqlens`` of packed rows, as keywords)
    and shard it itself; batches from ``shard_batch`` (they carry ``tsp_docs``) pass unchanged.
    For loops the user does not write (Fabric, Accelerate, the Trainer), where no hook sees the
    batch first. Idempotent."""
    state = model_state(model)
    if state.shards_inputs:
        return model
    mesh = get_mesh(model)

    def hook(_module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if args or "input_ids" not in kwargs or "tsp_docs" in kwargs:
            return None  # not a keyword batch, or already sharded (sharded batches have tsp_docs)
        batch = {k: kwargs.pop(k) for k in ("input_ids", "labels", "attention_mask",
                                            "position_ids", "cu_seqlens") if k in kwargs}
        padding_free = {k: kwargs.pop(k) for k in PADDING_FREE_KEYS if k in kwargs}
        if padding_free:
            check_padding_free(padding_free, batch)
        if kwargs.get("fused_lm_head") and state.fused_full:
            ids = batch["input_ids"]  # the rows' documents, for the full-sequence fused fields
            kwargs["tsp_full_docs"] = document_lengths(batch, ids.shape[1], ids.shape[0])
        return args, {**kwargs, **shard_batch(batch, mesh)}

    model.register_forward_pre_hook(hook, with_kwargs=True)
    state.shards_inputs = True
    return model


# what TRL's padding-free collator adds beside the restarting position_ids (the flash-attention
# varlen form of the same documents); shard_batch takes the documents from position_ids
PADDING_FREE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def check_padding_free(keys: dict[str, Any], batch: dict[str, Any]) -> None:
    """TRL's padding-free keys describe the documents that ``position_ids`` restarting at 0
    describe; shard_batch uses those, so the keys must agree with them (raised on every rank of
    the group alike: they hold the same batch)."""
    if "position_ids" not in batch:
        raise ValueError(f"padding-free keys {sorted(keys)} without position_ids: TSP takes the "
                         f"documents of a packed row from position_ids restarting at 0 (TRL's "
                         f"padding-free collator gives them) or from cu_seqlens")
    ids = batch["position_ids"]
    if ids.shape[0] != 1:
        raise ValueError(f"padding-free keys describe one packed row; position_ids has "
                         f"{ids.shape[0]} rows")
    starts = (ids[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if name in keys and [int(v) for v in keys[name]] != starts:
            raise ValueError(f"{name} {[int(v) for v in keys[name]]} does not match the "
                             f"documents of position_ids (they restart at {starts[:-1]}, row "
                             f"length {starts[-1]}); build both from the same documents")
