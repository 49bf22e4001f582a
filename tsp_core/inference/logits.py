"""Full-sequence logits of a TSP model, the same on every rank of its group, for evaluation metrics.

A TSP model's forward returns the loss (with labels) or the logits of this rank's tokens only
(``[B, S/D, V]``, zigzag order, padded). Metrics such as token accuracy need every token's logits in
the original order: :func:`full_logits` runs the forward once, keeps the final hidden states of the
local tokens, and turns them into

- ``logits`` ``[B, S, V]``: the hidden states are all-gathered over the TSP group (``[B, S, h]``;
  h is much smaller than V, so this moves V/h times fewer bytes than gathering logits), put back in
  the original token order with what ``shard_batch`` padded dropped, and every rank multiplies them
  by each vocabulary shard as it comes round the ring. Every rank holds the whole ``[B, S, V]``
  (what one process holds) plus a ``[B, S, V/D]`` product and the ``[B, S, h]`` hidden states.
- ``ids`` ``[B, S]`` (``argmax=True``): each rank takes the argmax of its own tokens against each
  vocabulary shard in turn (at most ``LOSS_CHUNK_ELEMENTS`` logits at once, like the loss) and only
  the ids travel: ``[B, S]`` int64 plus one ``[B*S/D, V/D]`` chunk at most and the ring's weight
  shard buffers (as for the loss), D times less compute and no ``[B, S, V]`` anywhere. Use it when
  a metric needs the predicted token only.

Data parallel is not involved: each TSP group computes its own batch's logits.
:func:`gather_data_parallel` concatenates one copy per data-parallel replica (what a metrics loop
gathers), never one per TSP rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..distributed.fsdp import root_unsharded
from ..distributed.mesh import TSPMesh, get_mesh
from ..distributed.model_state import find_model_state, model_state
from ..distributed.params import schedule_inputs
from ..layers.vocab import LOSS_CHUNK_ELEMENTS, TSPLMHead, vocab_spec
from ..sequence.gather import gather_tokens, token_index
from ..sequence.layout import BATCH_KEYS, document_lengths, shard_batch


@dataclass
class FullLogits:
    """What :func:`full_logits` returns; every tensor is the same on every rank of the group.

    ``loss``: the model's loss (global mean, as ``model(**batch).loss``), when the batch has labels.
    ``logits``: ``[B, S, V]`` (``None`` with ``argmax=True``). ``ids``: ``[B, S]`` argmax over the
    vocabulary (``argmax=True`` only). ``targets``: ``[B, S]`` the next-token target of each
    position (-100 where ignored: last token of each document, padding), when the batch has labels.
    ``S`` is the original length for a full batch; for a batch that was already sharded it is the
    padded length, each document padded at its end (``targets`` are -100 there)."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None
    ids: torch.Tensor | None
    targets: torch.Tensor | None


class _HeadSkipped(Exception):
    """Raised by a pre-hook on the LM head: without labels the forward's local logits are not
    needed once the hidden states are kept."""


@contextlib.contextmanager
def _final_hidden(model: nn.Module, skip_head: bool) -> Iterator[list[torch.Tensor]]:
    """Keep the base model's last hidden state of the forward run inside the block."""
    policy = model_state(model).policy
    kept: list[torch.Tensor] = []

    def keep(_module: nn.Module, _args: Any, out: Any) -> None:
        kept.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    def skip(_module: nn.Module, _args: Any) -> None:
        raise _HeadSkipped

    handles = [getattr(model, policy.modules.base_model).register_forward_hook(keep)]
    if skip_head:
        handles.append(getattr(model, policy.modules.lm_head).register_forward_pre_hook(skip))
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def _logits(head: TSPLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [..., h]`` times every vocabulary shard: ``[..., V]`` (shards come round the
    ring, D-1 hops; each rank computes every row of ``hidden``)."""
    hidden, (shard,), context = schedule_inputs(head, ["weight"], hidden)
    out = hidden.new_empty((*hidden.shape[:-1], head.vocab_size))
    mesh = head.mesh

    def compute(owner: int, w: torch.Tensor) -> None:
        spec = vocab_spec(head.vocab_size, owner, mesh.size)
        if spec.length:
            out[..., spec.start:spec.start + spec.length] = head.cap(
                F.linear(hidden, w[:spec.length]))

    with context:
        comm.ring_over_shards(shard.contiguous(), mesh.group, compute)
    return out


def _argmax(head: TSPLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary of the local tokens ``hidden [B, L, h]``: ``[B, L]``, the
    first maximal index on ties (``torch.argmax``'s rule, whatever order shards arrive in)."""
    hidden, (shard,), context = schedule_inputs(head, ["weight"], hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    best = flat.new_full((flat.shape[0],), float("-inf"))
    ids = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    chunk = max(1, LOSS_CHUNK_ELEMENTS // shard.shape[0])
    mesh = head.mesh

    def compute(owner: int, w: torch.Tensor) -> None:
        spec = vocab_spec(head.vocab_size, owner, mesh.size)
        if not spec.length:
            return
        for c in range(0, flat.shape[0], chunk):
            # soft-capped as the logits are: tanh is monotone, but it can make neighbours equal
            value, col = head.cap(F.linear(flat[c:c + chunk], w[:spec.length])).max(-1)
            col = col + spec.start
            old, old_id = best[c:c + chunk], ids[c:c + chunk]
            better = (value > old) | ((value == old) & (col < old_id))
            best[c:c + chunk] = torch.where(better, value, old)
            ids[c:c + chunk] = torch.where(better, col, old_id)

    with context:
        comm.ring_over_shards(shard.contiguous(), mesh.group, compute)
    return ids.view(hidden.shape[:-1])


def _inside_peft(model: nn.Module) -> nn.Module:
    """The converted Hugging Face model inside a PEFT ``PeftModel`` (``base_model.model``);
    ``model`` itself otherwise. A PeftModel's attribute lookups fall through to that model, so
    ``getattr(peft_model, "model")`` is the causal LM, not its base model: the hooks must go on
    the model inside (told by class name: peft is not imported here)."""
    if any(c.__name__ == "PeftModel" and c.__module__.startswith("peft")
           for c in type(model).__mro__):
        return model.base_model.model
    return model


def full_logits(model: nn.Module, batch: Mapping[str, Any], *, argmax: bool = False,
                **forward_kwargs: Any) -> FullLogits:
    """Run the TSP ``model`` on ``batch`` and return the full-sequence logits (or, with
    ``argmax=True``, the predicted ids) of every token on every rank of the TSP group, with the
    model's loss when the batch has labels. Every rank of the group must call it.

    ``batch``: the full-sequence batch that would go to ``shard_batch`` (``input_ids``, optional
    ``labels``, ``attention_mask``, ``position_ids``/``cu_seqlens`` of packed rows; the same on
    every rank of the group): results are ``[B, S]`` in the original token order. Or a batch
    already sharded by ``shard_batch`` (it has ``tsp_docs``; Lightning's strategy hands these to
    ``validation_step``): results cover the padded sequence, each document padded at its end,
    and ``targets`` mark padding with -100. Other keys and ``forward_kwargs`` (e.g.
    ``num_items_in_batch``) go to the model's forward.

    The forward runs as usual (under autograd if enabled); logits and ids are computed without
    autograd (they are for metrics). Memory and traffic: see the module docstring and
    docs/api.md ("Evaluation")."""
    inner = model
    while find_model_state(inner) is None and isinstance(getattr(inner, "module", None),
                                                         nn.Module):
        inner = inner.module  # a wrapper (Fabric, Accelerate): its forward runs, hooks go inside
    inner = _inside_peft(inner)
    mesh = get_mesh(inner)
    batch = dict(batch)
    if "tsp_docs" in batch:
        sharded, original = batch, None
    else:
        full = {k: batch.pop(k) for k in BATCH_KEYS if k in batch}
        sharded = {**batch, **shard_batch(full, mesh)}
        ids = full["input_ids"]
        original = document_lengths(full, ids.shape[1], ids.shape[0])
    labelled = "shift_labels" in sharded
    with _final_hidden(inner, skip_head=not labelled) as kept:
        try:
            loss = model(**sharded, **forward_kwargs).loss
        except _HeadSkipped:
            loss = None
    head: TSPLMHead = getattr(inner, model_state(inner).policy.modules.lm_head)
    index = token_index(sharded["tsp_docs"], mesh.size, mesh.layout, original)
    with torch.no_grad(), root_unsharded(inner):  # FSDP2: the head's whole TSP shard
        # autocast, if on, casts both again
        hidden = head.scale_input(kept[-1].detach().to(head.weight.dtype))
        logits = ids = targets = None
        if argmax:
            local = _argmax(head, hidden)
            if labelled:  # ids and targets in one gather
                local = torch.stack([local, sharded["shift_labels"]], -1)
            gathered = gather_tokens(local, index, mesh.group)
            ids, targets = (gathered[..., 0], gathered[..., 1]) if labelled else (gathered, None)
        else:
            logits = _logits(head, gather_tokens(hidden, index, mesh.group))
            if labelled:
                targets = gather_tokens(sharded["shift_labels"], index, mesh.group)
    return FullLogits(loss, logits, ids, targets)


def gather_data_parallel(x: torch.Tensor, mesh: TSPMesh) -> torch.Tensor:
    """Concatenation along dim 0 of ``x`` from every data-parallel replica of the TSP group, in
    data-parallel rank order (a 0-d tensor counts as one element). The ranks of a TSP group hold
    the same values (a metric's inputs after :func:`full_logits`), so one copy per replica is
    gathered, never one per TSP rank: what a gather for metrics over the whole world would
    duplicate D times."""
    x = x.reshape(1) if x.dim() == 0 else x
    first = x.shape
    for name in reversed(mesh.other_dims):  # innermost first: the result is in data rank order
        group = mesh.device_mesh.get_group(name)
        d = dist.get_world_size(group)
        if d > 1:
            buf = x.new_empty((d, *x.shape))
            comm.all_gather(buf, x.contiguous(), group)
            x = buf
    return x.reshape(-1, *first[1:])
