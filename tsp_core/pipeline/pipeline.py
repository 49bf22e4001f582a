"""TSP x pipeline parallelism: stages of whole decoder layers, each a TSP model on its own TSP
group, run by torch.distributed.pipelining's schedules (docs/pipeline.md).

``TSPPipeline.step(batch)`` takes the full global batch on every rank, keeps this data-parallel
replica's rows, shards them with :func:`tsp_core.shard_batch` and runs the schedule's forward and
backward over ``microbatches`` micro-batches. Each micro-batch's loss is its summed cross-entropy
over the stage mesh divided by the number of labelled tokens of the whole global batch, and the
schedule does not rescale gradients (``scale_grads=False``), so the micro-batches' losses add up
to the global mean of one process and every gradient is that of the global mean, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import comm
from ..distributed.mesh import TSPMesh
from ..distributed.model_state import TSPModelState, attach_model_state
from ..distributed.params import local
from ..models.policies import find_policy
from ..sequence.layout import IGNORE_INDEX, shard_batch
from .split import report_split, split_layers, stage_ranks
from .stage import StageModule, build_stage_module
from .tied import TiedCopies, pair_group, ties_embedding

# schedule name -> stages per pipeline rank (None means "at least 2, default 2"); each is the
# torch.distributed.pipelining.schedules class of the name Schedule<name>, imported when a
# pipeline builds its schedule (see .counted_stage)
SCHEDULES: dict[str, int | None] = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": None,
                                    "InterleavedZeroBubble": None}
# families whose base model takes the previous stage's hidden states as inputs_embeds unchanged
# (no embedding scale in the base model's forward) and whose layers share nothing across stages
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def check_pipeline_args(model: nn.Module, mesh: TSPMesh, microbatches: int, schedule: str,
                        stages_per_rank: int | None, layer_split: Sequence[int] | None
                        ) -> tuple[int, list[range]]:
    """Raise ``ValueError`` naming the numbers for anything the pipeline cannot honour (on every
    rank alike, before any collective); return the stage count and each stage's layers."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {tuple(SCHEDULES)} (torch's "
                         f"schedules TSP runs and tests; ZBVZeroBubble and DualPipeV place stages "
                         f"in a V and are not supported)")
    fixed = SCHEDULES[schedule]
    if fixed is not None and stages_per_rank not in (None, fixed):
        raise ValueError(f"schedule {schedule!r} runs {fixed} stage per pipeline rank, not "
                         f"stages_per_rank={stages_per_rank}; use Interleaved1F1B for several")
    per_rank = fixed or stages_per_rank or 2
    if per_rank < 2 and fixed is None:
        raise ValueError(f"schedule {schedule!r} interleaves at least 2 stages per pipeline rank, "
                         f"not stages_per_rank={stages_per_rank}; use 1F1B for one")
    num_stages = mesh.pp_size * per_rank
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches ({microbatches!r}) must be a positive whole number")
    if microbatches < num_stages:
        raise ValueError(f"microbatches ({microbatches}) is fewer than the {num_stages} pipeline "
                         f"stages (pp_size {mesh.pp_size} x {per_rank} per rank): stages would "
                         f"idle the whole step; use at least {num_stages}")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % mesh.pp_size:
        raise ValueError(f"{schedule} needs microbatches ({microbatches}) to be a multiple of "
                         f"pp_size ({mesh.pp_size})")
    policy = find_policy(model)
    if policy.name not in FAMILIES:
        raise ValueError(f"tsp_core.pipeline supports the families {FAMILIES}; {policy.name!r} "
                         f"is not tested under pipeline parallelism (train it with "
                         f"tsp_core.parallelize, pp_size 1)")
    base = getattr(model, policy.modules.base_model)
    layers = split_layers(len(getattr(base, policy.modules.layers)), num_stages, layer_split)
    return num_stages, layers


class TSPPipeline(nn.Module):
    """The stages of one pipeline rank and the torch schedule that runs them (build it with
    :func:`pipeline`). ``step(batch)`` returns the global mean loss, the same on every rank;
    ``clip_grad_norm_`` clips by the norm over every stage.

    The object is also an ``nn.Module`` laid out like the Hugging Face model but holding only this
    rank's stages (the embedding on the first stage's ranks, the decoder layers under their global
    indices, the final norm and head on the last's): ``parameters()`` go to the optimizer, and
    :func:`tsp_core.save_checkpoint` writes the whole model (every rank its stages' tensors under
    their Hugging Face names; a tied embedding's optimizer state once, under the embedding's name:
    :mod:`.tied`), which loads at any TSP degree, with or without pipeline stages, or
    into a plain model; :func:`tsp_core.load_checkpoint` into a pipeline reads this rank's stages'
    tensors from any such checkpoint. :func:`tsp_core.full_state_dict` gives the whole model's
    state dict, Hugging Face names and full shapes, on every rank (each stage's tensors broadcast
    over the pipeline group from the rank that holds them; ``rank0_only`` only to global rank 0,
    the other ranks get ``{}``)."""

    def __init__(self, model: nn.Module, mesh: TSPMesh, microbatches: int, schedule: str,
                 stages_per_rank: int | None, layer_split: Sequence[int] | None,
                 **parallelize_options: Any) -> None:
        super().__init__()
        if mesh.pp_dim is None:
            raise ValueError("the mesh has no pipeline dim: build it with "
                             "tsp_core.init_mesh(tsp_size, pp_size=P)")
        self.num_stages, self.layer_split = check_pipeline_args(
            model, mesh, microbatches, schedule, stages_per_rank, layer_split)
        if layer_split is None:  # an uneven default cut is said once, on global rank 0
            report_split(self.layer_split[-1].stop, self.num_stages, dist.get_rank())
        self.mesh, self.microbatches, self.schedule_name = mesh, microbatches, schedule
        self.stage_mesh = mesh.stage_mesh()
        policy = find_policy(model)
        self.config = model.config
        owners = stage_ranks(self.num_stages, mesh.pp_size)
        self.stage_indices = [s for s in range(self.num_stages) if owners[s] == mesh.pp_rank]
        self.last_rank = owners[-1]
        # every pipeline rank's Hugging Face names, shapes and dtypes, from the whole model (so
        # full_state_dict gathers the other ranks' stages without exchanging metadata)
        self._stage_tensors = stage_tensors(model, policy, self.layer_split, owners,
                                            mesh.pp_size)
        # a plain list: the stage modules are not children (the Hugging Face-shaped view is)
        self.stage_modules: list[StageModule] = [
            build_stage_module(model, policy, self.stage_mesh, self.layer_split[s], s == 0,
                               s == self.num_stages - 1, **parallelize_options)
            for s in self.stage_indices]
        self._hf_view(policy)
        self._tied = self._tie(model, policy)
        self.dtype = next(model.parameters()).dtype
        # checkpoints and generation read it: the marker names the model's class, loads take
        # this rank's stages' tensors (partial), full_state_dict gathers every rank's stages
        attach_model_state(self, TSPModelState(
            mesh, policy, type(model), partial=True, gather_stages=self.gather_stages,
            optimizer_names=self._tied.aliases if self._tied is not None else {}))
        self._schedules: dict[tuple, Any] = {}
        self._count: torch.Tensor | None = None

    def _hf_view(self, policy) -> None:
        """Register this rank's stage parts under the unmodified model's module names."""
        base, layers = nn.Module(), nn.ModuleDict()
        names = policy.modules
        for module in self.stage_modules:
            stage_base = module.base
            for index, layer in zip(module.layers, getattr(stage_base, names.layers)):
                layers[str(index)] = layer
            if module.first:
                setattr(base, names.embed, getattr(stage_base, names.embed))
            if module.last:
                setattr(base, names.final_norm, getattr(stage_base, names.final_norm))
                setattr(self, names.lm_head, getattr(module.model, names.lm_head))
        setattr(base, names.layers, layers)
        setattr(self, names.base_model, base)

    def _tie(self, model: nn.Module, policy) -> TiedCopies | None:
        """A tied embedding's copies (the first stage's embedding, the last stage's head) and
        the group that sums their gradients (:mod:`.tied`); None for an untied model."""
        if not ties_embedding(model, policy):
            return None
        group = pair_group(self.mesh)
        copy, duplicate, names = None, False, policy.modules
        for module in self.stage_modules:
            if module.first:
                copy = getattr(module.base, policy.modules.embed).weight
            if module.last:
                head = getattr(module.model, policy.modules.lm_head)
                head.tied = False  # its own copy here: loads lm_head.weight, not the embedding's
                copy, duplicate = head.weight, True
        # its optimizer state is checkpointed under the embedding's name, as one process has it
        aliases = ({f"{names.lm_head}.weight": f"{names.base_model}.{names.embed}.weight"}
                   if duplicate else {})
        return TiedCopies(copy, duplicate, group, aliases)

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of the global ``batch`` (``input_ids`` and ``labels`` of shape
        [batch, seq], optionally ``attention_mask``/``position_ids``; the same on every rank) over
        the micro-batches; gradients accumulate into ``.grad``. Returns the global mean loss over
        every labelled token of the batch, identical on every rank."""
        sharded = self._shard(batch)
        if self.mesh.pp_rank == self.last_rank:  # the global count of labelled tokens
            count = (sharded["shift_labels"] != IGNORE_INDEX).sum().to(self._loss_dtype)
            for group in self.stage_mesh.all_groups:
                comm.all_reduce(count, group)
            self._count = count
        ids = sharded.pop("input_ids")
        labels = sharded["shift_labels"]
        schedule = self._schedule(tuple(ids.shape))
        losses: list[torch.Tensor] = []
        schedule.step(ids, target=labels, losses=losses, return_outputs=False, **sharded)
        if self._tied is not None:  # the first and last stage's copies take the summed gradient
            self._tied.sync_grads()
        total = torch.zeros((), dtype=self._loss_dtype)
        if losses:
            total = torch.stack([loss.detach() for loss in losses]).sum().to(self._loss_dtype)
        comm.broadcast(total, self.last_rank, self.mesh.pp_group)
        self._count = None
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every stage's gradients: this rank's stages'
        norm (DTensor shards reduced over their mesh as torch does), combined over the pipeline
        group, then the same clipping on every rank (a tied embedding counted once, on the first
        stage). Returns the total norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        # a tied weight counts once, on the first stage (its last-stage copy holds the same grad)
        twin = None if self._tied is None else self._tied.duplicate
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p is not twin], norm_type)
        norm = local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        norm = norm.to(torch.float64)
        if norm_type == float("inf"):
            parts = torch.zeros(self.mesh.pp_size, dtype=torch.float64)
            parts[self.mesh.pp_rank] = norm
            comm.all_reduce(parts, self.mesh.pp_group)
            total = parts.max()
        else:
            total = norm ** norm_type
            comm.all_reduce(total, self.mesh.pp_group)
            total = total ** (1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def gather_stages(self, own: dict[str, torch.Tensor], rank0_only: bool
                      ) -> dict[str, torch.Tensor]:
        """:func:`tsp_core.full_state_dict`'s hook (its state's ``gather_stages``: the state
        package sits below the pipeline): ``own``, this rank's stages' full tensors, completed
        with every other pipeline rank's, each tensor broadcast over the pipeline group from its
        owner, in stage order. With ``rank0_only`` only global rank 0's pipeline group gathers and
        every other rank gets ``{}``."""
        mine = self._stage_tensors[self.mesh.pp_rank]
        if set(own) != {name for name, _, _ in mine}:
            raise RuntimeError(f"pipeline rank {self.mesh.pp_rank}'s stages hold "
                               f"{sorted(set(own) ^ {n for n, _, _ in mine})} unlike the "
                               f"model's state dict they were cut from")
        group = self.mesh.pp_group
        if rank0_only and 0 not in dist.get_process_group_ranks(group):
            return {}
        device = local(next(iter(self.parameters()))).device
        out: dict[str, torch.Tensor] = {}
        for owner, tensors in enumerate(self._stage_tensors):
            for name, shape, dtype in tensors:
                t = (own[name].detach().contiguous() if owner == self.mesh.pp_rank
                     else torch.empty(shape, dtype=dtype, device=device))
                comm.broadcast(t, owner, group)
                out[name] = t
        if rank0_only and dist.get_rank() != 0:
            return {}
        return out

    # ------------------------------------------------------------------ internals
    @property
    def _loss_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's rows of the global batch, sharded for this TSP rank; raises naming the
        numbers (the same on every rank, before any collective)."""
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"a pipeline step takes 'input_ids' and 'labels' (the loss is the "
                             f"last stage's); got {sorted(batch)}")
        ids = batch["input_ids"]
        rows = ids.shape[0]
        dp, m = self.stage_mesh.dp_size, self.microbatches
        if rows % (dp * m):
            raise ValueError(f"the batch's {rows} rows do not divide into {dp} data-parallel "
                             f"replicas x {m} micro-batches; pass a multiple of {dp * m} rows")
        vocab = self.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"input_ids hold values from {int(ids.min())} to {int(ids.max())}, "
                             f"outside the vocabulary [0, {vocab})")
        replica = self._replica_index()
        per = rows // dp
        mine = {k: v[replica * per:(replica + 1) * per] for k, v in batch.items()}
        sharded = shard_batch(mine, self.stage_mesh)
        sharded.pop("tsp_fingerprint", None)  # compared by a TSP model's forward, not here
        sharded.pop("attention_mask", None)   # right padding only: the labels already ignore it
        return sharded

    def _replica_index(self) -> int:
        """This rank's data-parallel replica, 0..dp_size-1 (row-major over the data dims)."""
        dm, index = self.stage_mesh.device_mesh, 0
        for name in self.stage_mesh.other_dims:
            index = index * dm.size(dm.mesh_dim_names.index(name)) + dm.get_local_rank(name)
        return index

    def _schedule(self, ids_shape: tuple[int, ...]):
        """The torch schedule for batches of this local shape (stages take static shapes)."""
        if ids_shape in self._schedules:
            return self._schedules[ids_shape]
        rows, seq = ids_shape[0] // self.microbatches, ids_shape[1]
        device = local(next(iter(self.parameters()))).device
        # static shapes (no metadata inference, which would run an uncounted forward and backward);
        # requires_grad: gradients flow back across the cut
        hidden = torch.empty(rows, seq, self.config.hidden_size, dtype=self.dtype, device=device,
                             requires_grad=True)
        from torch.distributed.pipelining import schedules

        from .counted_stage import CountedStage

        stages = []
        for index, module in zip(self.stage_indices, self.stage_modules):
            first, last = index == 0, index == self.num_stages - 1
            inputs = torch.empty(rows, seq, dtype=torch.long, device=device) if first else hidden
            outputs = (torch.empty((), dtype=self._loss_dtype, device=device, requires_grad=True)
                       if last else hidden)
            stages.append(CountedStage(module, index, self.num_stages, device, input_args=inputs,
                                       output_args=outputs, group=self.mesh.pp_group))
        cls = getattr(schedules, f"Schedule{self.schedule_name}")
        stage_arg = stages[0] if SCHEDULES[self.schedule_name] == 1 else stages
        schedule = cls(stage_arg, self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedules[ids_shape] = schedule
        return schedule

    def _loss(self, output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the global mean: its cross-entropy summed over the stage mesh
        over the labelled tokens of the whole global batch."""
        return comm.sum_over(output, self.stage_mesh.all_groups) / self._count


def stage_tensors(model: nn.Module, policy, layer_split: Sequence[range], owners: list[int],
                  pp_size: int) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """(name, shape, dtype) of each entry of ``model``'s state dict, by the pipeline rank whose
    stage holds it: the embedding with stage 0, decoder layer i with its stage, the final norm and
    the head with the last stage. Raises naming any entry that belongs to no stage."""
    names = policy.modules
    base, layers = names.base_model, names.layers
    stage_of = {i: s for s, r in enumerate(layer_split) for i in r}
    out: list[list[tuple[str, torch.Size, torch.dtype]]] = [[] for _ in range(pp_size)]
    unplaced = []
    for name, t in model.state_dict().items():
        if name.startswith(f"{base}.{layers}."):
            stage = stage_of[int(name.split(".")[2])]
        elif name.startswith(f"{base}.{names.embed}."):
            stage = 0
        elif name.startswith((f"{base}.{names.final_norm}.", f"{names.lm_head}.")):
            stage = len(layer_split) - 1
        else:
            unplaced.append(name)
            continue
        out[owners[stage]].append((name, t.shape, t.dtype))
    if unplaced:
        raise ValueError(f"the model's state dict holds {unplaced}, which belong to no pipeline "
                         f"stage (only the embedding, the decoder layers, the final norm and the "
                         f"head are cut into stages)")
    return out


def pipeline(model: nn.Module, mesh: TSPMesh, *, microbatches: int, schedule: str = "1F1B",
             stages_per_rank: int | None = None, layer_split: Sequence[int] | None = None,
             **parallelize_options: Any) -> TSPPipeline:
    """Cut the Hugging Face causal LM ``model`` into pipeline stages of whole decoder layers on
    ``mesh`` (``tsp_core.init_mesh(tsp_size, pp_size=P)``), each made TSP on its stage's TSP group
    (:func:`tsp_core.parallelize`; ``parallelize_options`` are its keywords), and return the
    :class:`TSPPipeline` of this rank. ``model`` itself is left unchanged (each stage converts a
    copy holding its own layers).

    ``schedule``: one of torch.distributed.pipelining's, by name: "1F1B", "GPipe" (one stage per
    rank), "Interleaved1F1B", "InterleavedZeroBubble" (``stages_per_rank`` stages per rank, 2 by
    default, stage s on pipeline rank s mod pp_size). ``layer_split``: decoder layers per stage;
    by default :func:`tsp_core.pipeline.split.balanced_split`'s cut: ``layers + 2`` units (the
    embedding and the head count as one layer each) shared as evenly as whole layers allow, the
    first stages taking one more where they do not divide (global rank 0 then prints the cut,
    one line). Bad arguments raise ``ValueError`` naming the numbers, on every rank, before any
    collective."""
    return TSPPipeline(model, mesh, microbatches, schedule, stages_per_rank, layer_split,
                       **parallelize_options)
