"""The router logits a TSP model returns with ``output_router_logits=True``: each MoE layer's, of
this rank's tokens (:func:`kept_router_logits`), and the whole TSP group's gathered into the
original token order (:func:`gather_router_logits`).

Hugging Face's MoE models return ``router_logits``, a tuple with one tensor per MoE layer of
shape ``[batch * seq, E]`` (``[B, S]`` flattened row by row), as each family's router returns
them (its forward hooks record them): the raw logits for Mixtral, Qwen3-MoE, gpt-oss (with its
router bias), Llama 4 and GLM-4.5 / DeepSeek-V3 (float32; TSP's sigmoid router keeps a float64
model's float64), the float32 softmax of the logits for Gemma 4 (what its router returns
first). A TSP rank routes its
own tokens only, so its ``router_logits`` are those of its ``[B, S/D]`` tokens of
``shard_batch``, flattened the same way: ``[B * S/D, E]`` per layer, the same values as the
unmodified model's rows of those tokens, in the graph as Hugging Face's are (a loss built from
them reaches the router and everything before it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...distributed.chunks import num_chunks
from ...distributed.mesh import TSPMesh
from ...sequence.gather import gather_tokens, token_index
from ...sequence.layout import document_lengths
from .module import TSPMoE
from .router import TSPRouter


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``router_logits`` Hugging Face's output records, one per MoE layer in
    layer order: each :class:`TSPMoE` that routes (its logits), or each :class:`TSPRouter` where
    the layer calls its router apart (Gemma 4: its probabilities, what Hugging Face's router
    returns first)."""
    return [m for m in model.modules() if isinstance(m, TSPRouter)
            or (isinstance(m, TSPMoE) and not m.spec.router_apart)]


def kept_router_logits(layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """What ``layers`` (:func:`router_modules`) kept of the forward that just ran, as Hugging
    Face's ``router_logits``: a tuple, one ``[B * L, E]`` tensor per layer for this rank's
    ``[B, L]`` tokens. Raises if a layer kept none (it did not run forward)."""
    if any(m.router_logits is None for m in layers):
        raise ValueError("an MoE layer has no router logits: it did not run forward")
    return tuple(m.router_logits for m in layers)


def gather_router_logits(router_logits: Sequence[torch.Tensor], batch: Mapping[str, Any],
                         mesh: TSPMesh) -> tuple[torch.Tensor, ...]:
    """Every MoE layer's router logits of the whole TSP group's tokens, in the original token
    order, the same on every rank of the group: one all-gather per layer over the TSP group
    (``tsp_core.comm``, :func:`tsp_core.sequence.gather.gather_tokens`). Every rank of the group
    must call it.

    ``router_logits``: the ``router_logits`` of a TSP model's output (this rank's tokens,
    ``[B * L, E]`` per layer). ``batch``: the full-sequence batch given to ``shard_batch`` (the
    same on every rank of the group): each result is then ``[B * S, E]``, Hugging Face's shape
    and row order for that batch, the tokens ``shard_batch`` padded left out. Or the batch
    ``shard_batch`` returned (it has ``tsp_docs``): ``[B * S', E]`` over the padded rows, each
    document padded at its end. Data-parallel replicas are not gathered: each TSP group gets
    its own batch's.

    Differentiable: a loss built from the gathered logits, the same on every rank, has the
    gradient one process would give it (the backward keeps this rank's rows of the gradient;
    the router's gradient is summed over the group as every replicated weight's is)."""
    docs, original = _documents(batch, mesh)
    index = token_index(docs, mesh.size, mesh.layout, original)
    rows, length = index.shape
    padded = sum(docs[0])  # every row's padded length
    out = []
    for logits in router_logits:
        if logits.dim() != 2 or logits.shape[0] * mesh.size != rows * padded:
            raise ValueError(f"router logits of shape {tuple(logits.shape)} are not this rank's "
                             f"[B * L, E] of a batch of {rows} rows padded to {padded} tokens "
                             f"over tsp_size {mesh.size}: pass the batch the forward was given "
                             f"(or the full batch shard_batch made it from)")
        local = logits.reshape(rows, padded // mesh.size, -1)  # [B, L, E] as the layer routed
        out.append(gather_tokens(local, index.to(logits.device), mesh.group
                                 ).reshape(rows * length, -1))
    return tuple(out)


def _documents(batch: Mapping[str, Any], mesh: TSPMesh
               ) -> tuple[list[list[int]], list[list[int]] | None]:
    """(each row's padded document lengths, each row's original ones): a sharded batch's
    ``tsp_docs`` and None; for a full batch, what ``shard_batch`` pads it to (each document to a
    multiple of the chunk count, rows to one length by a trailing padding document) and its
    documents."""
    if "tsp_docs" in batch:
        return [[n for n in row if n] for row in torch.as_tensor(batch["tsp_docs"]).tolist()], None
    if "input_ids" not in batch:
        raise ValueError("gather_router_logits needs the batch of the forward: the full batch "
                         "(input_ids, ...) given to shard_batch, or the one it returned")
    rows, seq = batch["input_ids"].shape
    docs = document_lengths(dict(batch), seq, rows)
    n = num_chunks(mesh.size, mesh.layout)
    padded = [[-(-d // n) * n for d in row] for row in docs]
    total = max(sum(row) for row in padded)
    return [row + ([total - sum(row)] if sum(row) < total else []) for row in padded], docs
