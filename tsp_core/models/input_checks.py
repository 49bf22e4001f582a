"""Checks of a TSP model's inputs that every rank of the TSP group agrees on before the first
schedule collective, so that bad input raises on every rank instead of hanging some of them.

Each rank checks its own tokens (shapes, label range, position ids against the layout, finite
``inputs_embeds``, the global length a length-dependent rope needs) and the whole mesh
all-gathers one small int64 vector per rank (the TSP group alone when the mesh is not the whole
world), so that bad input in one TSP group stops the other data-parallel replicas too instead of
leaving them waiting: batch rows, local length, a checksum of the document lengths, the
problems found, the number of non-finite values, the length the rope sees (``tsp_rope_len``) and
the fingerprint of the full batch (``shard_batch``'s ``tsp_fingerprint``: tokens, labels, mask,
positions). Ranks of one TSP group given different batches (a data loader that splits over the
world instead of over data parallel) are caught by shape or by content. Cost: one all-gather of 7
integers per rank per forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed import comm
from ..distributed.chunks import rank_chunks, row_segments
from ..distributed.model_state import model_state
from ..layers.attention import TSPAttention
from ..layers.rope import length_dependent_types
from ..sequence.layout import IGNORE_INDEX, batch_fingerprint

LABELS_RANGE, LABELS_SHAPE, POSITIONS_NEGATIVE, POSITIONS_LAYOUT, NONFINITE, SHAPE, ROPE_LEN = (
    1, 2, 4, 8, 16, 32, 64)
PACKED_QUERY_SCALE = 128
FIELDS = ("rows", "local_len", "docs_checksum", "problems", "nonfinite", "rope_len", "fingerprint")
_CAUSES = ("usual causes: a DistributedSampler over the whole world instead of the data-parallel "
           "ranks (use DistributedSampler(dataset, num_replicas=mesh.dp_size, "
           "rank=torch.distributed.get_rank() // mesh.size), as the adapters do; TSP groups are "
           "consecutive ranks); a custom loader that splits data by global rank; random "
           "augmentation, masking or packing without a seed shared by the TSP group")
_FIX = {
    LABELS_RANGE: "shift_labels outside [0, {vocab}) and not -100 (ignored): labels must be "
                  "token ids of this model's vocabulary",
    LABELS_SHAPE: "shift_labels whose shape differs from the input's [batch, local_seq]: build "
                  "labels for the same tokens (tsp_core.shard_batch does)",
    POSITIONS_NEGATIVE: "negative position_ids: positions count from 0",
    POSITIONS_LAYOUT: "position_ids that are not the global positions of this rank's tokens in the "
                      "mesh's layout (or per document, for packed rows): pass the full batch "
                      "through tsp_core.shard_batch instead of building local positions yourself",
    NONFINITE: "NaN or inf in inputs_embeds: check the data and whatever produced the embeddings",
    SHAPE: "inputs of the wrong shape",
    ROPE_LEN: "no tsp_rope_len, which this model's rotary embedding ({rope} rope: frequencies "
              "that depend on the sequence length) needs to rotate every rank like the whole "
              "sequence: pass the full batch through tsp_core.shard_batch, which gives it",
    PACKED_QUERY_SCALE: "packed rows (several documents in a row) on a model whose queries are "
                        "scaled by their position in the row (Llama 4's attn_temperature_tuning "
                        "counts it across the row's documents; shard_batch pads each document, "
                        "so a TSP rank cannot give that position): feed one document per row, or "
                        "set attn_temperature_tuning=False",
}


def _agreement_table(mine: torch.Tensor, mesh: Any) -> tuple[list[list[int]], list[int]]:
    """One all-gather of every rank's row over the whole mesh (over the TSP group alone when the
    mesh is not the whole world): this TSP group's rows in group order, and the global ranks of
    the other TSP groups whose rows do not agree (bad input there raises there; here too, or the
    other replicas would wait for it in their next data-parallel collective)."""
    import torch.distributed as dist

    mine = mine.contiguous()
    n, dm = mine.numel(), mesh.device_mesh
    if dist.get_world_size() != dm.size() or dm.size() == mesh.size:
        everyone = mine.new_empty(mesh.size * n)
        comm.all_gather(everyone, mine, mesh.group)
        return everyone.view(mesh.size, n).tolist(), []
    everyone = mine.new_empty(dist.get_world_size() * n)
    comm.all_gather(everyone, mine, dist.group.WORLD)
    rows = everyone.view(-1, n).tolist()
    groups = dm.mesh.movedim(dm.mesh_dim_names.index(mesh.dim), -1).reshape(-1, mesh.size)
    table, others = [], []
    for ranks in groups.tolist():
        part = [rows[r] for r in ranks]
        if dist.get_rank() in ranks:
            table = part
        elif not _agrees(part):
            others += ranks
    return table, others


def _agrees(table: list[list[int]]) -> bool:
    """No rank of one TSP group found a problem, and their batches agree."""
    return (not any(r[3] for r in table) and len({(r[0], r[1]) for r in table if r[0] >= 0}) <= 1
            and len({(r[2], r[5], r[6]) for r in table}) <= 1)


def _groups(table: list[list[int]], column: int, mesh: Any) -> str:
    """'TSP rank(s) [0, 2] (global [0, 2]): 0x..., TSP rank(s) [1, 3] (global [1, 3]): 0x...':
    the ranks grouped by one column of the agreement table, largest group first."""
    import torch.distributed as dist

    by: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        by.setdefault(row[column], []).append(r)
    glob = dist.get_process_group_ranks(mesh.group)
    def fmt(v: int) -> str:
        return str(v) if column != 6 else f"{v:#x}" if v >= 0 else "none"

    return ", ".join(f"TSP rank(s) {rs} (global {[glob[r] for r in rs]}): {fmt(v)}"
                     for v, rs in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[1])))


def _expected_positions(docs: tuple[int, ...], rank: int, size: int, layout: str,
                        device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a - start, b - start, device=device)
                      for a, b, start in row_segments(docs, rank, size, layout)])


class Findings:
    """What this rank found wrong with its input: the problem bits and their details."""

    def __init__(self) -> None:
        self.problems, self.details = 0, []

    def add(self, bit: int, detail: str) -> None:
        self.problems |= bit
        self.details.append(detail)


def check_model_inputs(model: Any, input_ids: torch.Tensor | None,
                       inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor,
                       shift_labels: torch.Tensor | None,
                       docs: tuple[tuple[int, ...], ...] | None,
                       rope_len: torch.Tensor | int | None = None,
                       fingerprint: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` on every rank of the TSP group if any rank's input is bad or the
    ranks' batches differ. ``docs``: each row's document lengths (from ``tsp_docs``);
    ``rope_len``, ``fingerprint``: ``shard_batch``'s ``tsp_rope_len`` and ``tsp_fingerprint``
    (per row)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(position_ids):  # a memory simulation (tsp simulate): there are no values to check
        return
    mesh = model_state(model).mesh
    found = Findings()
    rows, seq = check_shape(model, input_ids, inputs_embeds, found)
    nonfinite = check_embeds(inputs_embeds, found)
    if shift_labels is not None and rows >= 0:
        check_labels(shift_labels, rows, seq, model.config.vocab_size, found)
    if rows >= 0:
        check_positions(position_ids, rows, seq, docs, mesh, found)
    ropes = check_model_features(model, docs, rope_len, found)
    # Python's hash of a tuple of ints is the same in every process (only str/bytes are salted)
    checksum = hash(docs) & 0x7FFFFFFF if docs is not None else 0
    mine = torch.tensor([rows, seq, checksum, found.problems, nonfinite, -1, -1],
                        dtype=torch.int64, device=position_ids.device)
    if rope_len is not None:
        mine[5] = torch.as_tensor(rope_len).max()
    if fingerprint is not None:
        mine[6] = batch_fingerprint(fingerprint.reshape(-1).to(mine.device))
    table, others = _agreement_table(mine, mesh)
    if others and _agrees(table):  # another group raises with the details: no rank waits for it
        raise ValueError(f"bad input in another TSP group (global ranks {others}), which raises "
                         f"with the details; this rank stops too so that no rank is left waiting "
                         f"in a collective")
    if not _agrees(table):
        raise_bad_input(model, table, found, ropes, mesh)


def check_shape(model: Any, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                found: Findings) -> tuple[int, int]:
    """The input's (rows, local length), (-1, -1) when its shape is wrong."""
    hidden = model.config.hidden_size
    x = input_ids if input_ids is not None else inputs_embeds
    want_dims = 2 if input_ids is not None else 3
    if x is None or x.dim() != want_dims or (inputs_embeds is not None and x.shape[-1] != hidden):
        found.add(SHAPE, f"{'input_ids' if input_ids is not None else 'inputs_embeds'} of shape "
                         f"{None if x is None else tuple(x.shape)}: expected [batch, local_seq]"
                         f"{'' if input_ids is not None else f', hidden_size={hidden}'}")
        return -1, -1
    return x.shape[0], x.shape[1]


def check_embeds(inputs_embeds: torch.Tensor | None, found: Findings) -> int:
    """The number of non-finite values in ``inputs_embeds``."""
    nonfinite = 0
    if inputs_embeds is not None and inputs_embeds.is_floating_point():
        nonfinite = int((~torch.isfinite(inputs_embeds)).sum())
        if nonfinite:
            found.add(NONFINITE, f"{nonfinite} NaN/inf values in inputs_embeds")
    return nonfinite


def check_labels(shift_labels: torch.Tensor, rows: int, seq: int, vocab: int,
                 found: Findings) -> None:
    """Labels of the input's shape, each a token id of the vocabulary or ignored."""
    if tuple(shift_labels.shape) != (rows, seq):
        found.add(LABELS_SHAPE, f"shift_labels of shape {tuple(shift_labels.shape)}, input "
                                f"{(rows, seq)}")
        return
    bad = ((shift_labels < 0) & (shift_labels != IGNORE_INDEX)) | (shift_labels >= vocab)
    if bad.any():
        vals = shift_labels[bad]
        found.add(LABELS_RANGE, f"{int(bad.sum())} shift_labels outside [0, {vocab}) (from "
                                f"{int(vals.min())} to {int(vals.max())})")


def check_positions(position_ids: torch.Tensor, rows: int, seq: int,
                    docs: tuple[tuple[int, ...], ...] | None, mesh: Any,
                    found: Findings) -> None:
    """Position ids of the input's shape: the global positions of this rank's tokens in the
    mesh's layout (per document for packed rows)."""
    size, rank, layout = mesh.size, mesh.rank, mesh.layout
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if pos.shape[-1] != seq or pos.shape[0] not in (1, rows):
        found.add(POSITIONS_LAYOUT, f"position_ids of shape {tuple(position_ids.shape)} for "
                                    f"input {(rows, seq)}")
    elif bool((pos < 0).any()):
        found.add(POSITIONS_NEGATIVE, f"position_ids from {int(pos.min())}")
    elif seq % len(rank_chunks(rank, size, layout)) == 0:
        row_docs = docs or ((seq * size,),) * pos.shape[0]
        cache: dict[tuple[int, ...], torch.Tensor | None] = {}
        for r in range(pos.shape[0]):
            d = row_docs[r] if r < len(row_docs) else row_docs[-1]
            if d not in cache:
                try:
                    cache[d] = _expected_positions(d, rank, size, layout, pos.device)
                except ValueError:  # document lengths that do not split: reported below
                    cache[d] = None
            want = cache[d]
            if want is None:
                found.add(SHAPE, f"tsp_docs row {r} {list(d)} does not split over {size} ranks")
                break
            if want.shape != pos[r].shape or not torch.equal(pos[r], want):
                found.add(POSITIONS_LAYOUT, f"position_ids of row {r} start "
                                            f"{pos[r, :6].tolist()}, expected "
                                            f"{want[:6].tolist()} ({layout} layout, "
                                            f"tsp_size={size})")
                break
    else:
        found.add(SHAPE, f"local sequence length {seq} does not split into this layout's "
                         f"chunks ({layout}, tsp_size={size})")


def check_model_features(model: Any, docs: tuple[tuple[int, ...], ...] | None,
                         rope_len: torch.Tensor | int | None, found: Findings) -> list[str]:
    """What the model's own features need of the batch: one document per row when queries are
    scaled by position, the global length for a length-dependent rope (whose kinds it returns)."""
    packed = [r for r, d in enumerate(docs or ()) if len(d) > 1]
    if packed and any(isinstance(m, TSPAttention) and m.parts.query_scale is not None
                      for m in model.modules()):
        found.add(PACKED_QUERY_SCALE, f"row {packed[0]} holds {len(docs[packed[0]])} documents "
                                      f"{list(docs[packed[0]])} and layers scale queries by "
                                      f"position")
    ropes = [t for m in model_state(model).ropes for t in length_dependent_types(m)]
    if ropes and rope_len is None:
        found.add(ROPE_LEN, "no tsp_rope_len in the batch")
    return ropes


def raise_bad_input(model: Any, table: list[list[int]], found: Findings, ropes: list[str],
                    mesh: Any) -> None:
    """The error every rank of the group raises alike: which ranks found what, and the fix."""
    vocab = model.config.vocab_size
    shapes = {(r[0], r[1]) for r in table if r[0] >= 0}
    agreed = {(r[2], r[5], r[6]) for r in table}
    step = getattr(model, "tsp_step", None)
    where = f"step {step}" if step is not None else \
        f"forward call {model_state(model).forward_calls} (set model.tsp_step for steps)"
    lines = []
    for bit, text in _FIX.items():
        culprits = [r for r, row in enumerate(table) if row[3] & bit]
        if culprits:
            extra = (f" ({sum(table[r][4] for r in culprits)} values)" if bit == NONFINITE else "")
            lines.append(f"TSP rank(s) {culprits}: "
                         f"{text.format(vocab=vocab, rope='/'.join(sorted(set(ropes))))}{extra}")
    if len(shapes) > 1:
        seen = ", ".join(f"rank {r}: {row[0]} rows x {row[1]} local tokens" for r, row in
                         enumerate(table))
        lines.append(f"ranks of one TSP group have different batches ({seen}); every rank of a TSP "
                     f"group must get the same full batch and keeps its own tokens of it; "
                     f"{_CAUSES}")
    elif len({r[6] for r in table}) > 1:
        lines.append(f"ranks of one TSP group were given different batches: "
                     f"{_groups(table, 6, mesh)} (fingerprints of the full batch: tokens, labels, "
                     f"mask, positions; none: not from tsp_core.shard_batch); every rank of a TSP "
                     f"group must get the same full batch and keeps its own tokens of it; "
                     f"{_CAUSES}")
    elif len(agreed) > 1:
        lines.append(f"ranks of one TSP group have different tsp_docs / tsp_rope_len (document "
                     f"lengths {_groups(table, 2, mesh)}; sequence lengths "
                     f"{_groups(table, 5, mesh)}): build every rank's batch with "
                     f"tsp_core.shard_batch from the same full batch")
    details = found.details
    raise ValueError(f"bad input at {where}: " + "; ".join(lines)
                     + (f". This rank (TSP rank {mesh.rank}): " + "; ".join(details)
                        if details else ""))
