"""``TSPGRPOConfig`` and ``TSPGRPOTrainer``: TRL's GRPOTrainer under TSP (``tsp_size``).

Rollouts come from the TSP model's own ``generate`` (``tsp_core.generate``, which TRL calls as
``model.generate`` with ``use_vllm=False``): every rank of a TSP group draws the same tokens, the
ones the unmodified model draws from the same random state (rank 0's, broadcast per call), with
TRL's temperature, top-k, top-p and min-p. Each data-parallel replica generates for its own
prompts, seeded ``seed + replica`` as TRL seeds ``seed + process``, so a replica draws what one
process of plain data parallel draws.

Scoring: the completions' log-probabilities and entropies come from the vocabulary-parallel head,
one float per token gathered into the full sequence (``tsp_core.models.runtime.fused_output``;
never the logits), for the policy and for the reference model (a second TSP model on the same
mesh). Every rank of a group then runs TRL's own loss and metrics on its replica's rows, as one
process of plain data parallel does, and backpropagates through its own tokens. TRL's collectives
over "processes" go over the data-parallel replicas instead (:class:`ReplicaView`): one copy per
replica, so the advantages' groups, the dapo normaliser and every metric count each completion
once; ``top_entropy_quantile`` takes its quantile over the replicas' completion tokens, as TRL
over the processes'. Reward functions run on rank 0 of each group only (once per replica);
their rewards are broadcast to the group."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import datasets
import torch
import trl.trainer.grpo_trainer as trl_grpo
from accelerate.utils import recursively_apply, set_seed
from torch import nn
from transformers import PreTrainedTokenizerBase, ProcessorMixin
from trl import GRPOConfig, GRPOTrainer

import tsp_core
from tsp_core.distributed import comm
from tsp_core.distributed.mesh import TSPMesh, get_mesh
from tsp_core.distributed.model_state import model_state
from tsp_core.inference.logits import gather_data_parallel
from tsp_core.models import shard_full_batches
from tsp_transformers import TSPTrainer, TSPTrainingArguments
from tsp_transformers.trainer import requested_tsp_size

from .fused_head import native_fused_head, refuse_aux_loss
from .sft import check_model_object, default_config

# trainer arguments TSPGRPOTrainer does not take under TSP, with why
REFUSED_ARGUMENTS = {
    "tools": "tool calling", "rollout_func": "a custom rollout function",
    "environment_factory": "environments", "peft_config": "PEFT adapters",
    "eval_dataset": "evaluation (generation and scoring of eval prompts)",
}


@dataclass
class TSPGRPOConfig(GRPOConfig, TSPTrainingArguments):
    """``GRPOConfig`` (its own defaults) plus ``tsp_size`` and TSP's other fields. GRPO sizes
    its generation batch by the processes (per_device_train_batch_size x processes x
    steps_per_generation); under TSP the ranks of a group share one batch, so here the
    data-parallel replicas (processes / tsp_size) count instead."""

    def __post_init__(self) -> None:
        self._sizing_batches = True
        try:
            super().__post_init__()
        finally:
            self._sizing_batches = False

    @property
    def world_size(self) -> int:
        """The processes; while ``GRPOConfig`` sizes its batches, the data-parallel replicas."""
        processes = super().world_size
        if not getattr(self, "_sizing_batches", False) or not hasattr(self, "_replicas"):
            return processes  # _replicas: TSPTrainingArguments.__post_init__ has run
        return replicas_for_batches(self, processes)


def replicas_for_batches(args: TSPGRPOConfig, processes: int) -> int:
    """The data-parallel replicas GRPO's generation batch counts, after checking that the
    batch they give holds whole groups of ``num_generations`` (raised here, on every rank,
    before any collective, naming the numbers)."""
    size = requested_tsp_size(args)
    if size == "auto":
        raise ValueError("TSPGRPOConfig needs the TSP degree to size GRPO's generation batch "
                         "(per_device_train_batch_size x replicas x steps_per_generation): give "
                         "tsp_size as a number, not 'auto'")
    if size == 1 or processes % size:
        return processes  # no TSP, or a mesh the trainer refuses with the numbers
    replicas = processes // size
    per_step = args.per_device_train_batch_size * replicas
    given = args.generation_batch_size
    if given is not None and args.steps_per_generation is None and given % per_step:
        # GRPOConfig's own check, its "global batch size" counted in replicas: named here
        raise ValueError(
            f"generation_batch_size ({given}) must be a multiple of the global batch ({per_step} "
            f"= per_device_train_batch_size {args.per_device_train_batch_size} x {replicas} "
            f"data-parallel replica(s) ({processes} processes / tsp_size {size})): the ranks "
            f"of a TSP group share one batch; choose a multiple of {per_step}, or give "
            f"steps_per_generation instead")
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    batch = given or per_step * steps
    if batch % args.num_generations:
        raise ValueError(
            f"num_generations ({args.num_generations}) must divide the generation batch "
            f"({batch} = per_device_train_batch_size {args.per_device_train_batch_size} x "
            f"{replicas} data-parallel replica(s) ({processes} processes / tsp_size {size}) x "
            f"steps_per_generation {steps}): the ranks of a TSP group share one batch; choose "
            f"num_generations dividing {batch}, or a per_device_train_batch_size that is a "
            f"multiple of it")
    return replicas


def as_tsp_config(args: Any) -> Any:
    """A plain ``GRPOConfig`` as ``TSPGRPOConfig`` (TSP's fields at their defaults), its
    generation batch sized again from ``steps_per_generation`` over the replicas (GRPOConfig
    refuses both given). Anything else unchanged (``TSPTrainer`` converts or refuses it)."""
    if isinstance(args, TSPTrainingArguments) or not isinstance(args, GRPOConfig):
        return args
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return TSPGRPOConfig(**{**fields, "generation_batch_size": None})


def check_supported(trainer: str, args: TSPGRPOConfig, model: Any, reward_funcs: Any,
                    kwargs: dict[str, Any]) -> None:
    """What TSPGRPOTrainer does not do under TSP, refused by name with the reason: the same on
    every rank, before any collective."""
    size = requested_tsp_size(args)
    if args.use_vllm:
        raise ValueError(
            f"{trainer}: use_vllm=True is not supported with tsp_size {size}: vLLM would serve "
            f"the whole model from its own engine, while under TSP each rank holds 1/{size} of "
            f"every weight, and syncing it means gathering the full state dict every step "
            f"(docs/trl.md). Set use_vllm=False: rollouts then come from the TSP model's own "
            f"generate, the same tokens on every rank of a group")
    refused = [f"{name} ({why})" for name, why in REFUSED_ARGUMENTS.items()
               if kwargs.get(name) is not None]
    if args.use_transformers_continuous_batching:
        refused.append("use_transformers_continuous_batching=True (generate_batch)")
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if any(isinstance(f, (str, nn.Module)) for f in funcs):
        refused.append("reward models (a reward function that is a model or a model name): "
                       "pass functions of the completions")
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        refused.append("vision-language models (a processor as processing_class)")
    if args.cast_lm_head_to_fp32:
        refused.append("cast_lm_head_to_fp32=True (the TSP head accumulates in float32 already)")
    text = model.config.get_text_config() if hasattr(model, "config") else None
    if args.temperature != 1.0 and getattr(text, "final_logit_softcapping", None) is not None:
        refused.append(f"temperature={args.temperature} with final_logit_softcapping (the TSP "
                       f"head divides its input by the temperature, which equals dividing the "
                       f"logits only when they are not soft-capped)")
    if refused:
        raise ValueError(f"{trainer} with tsp_size {size} does not support: "
                         f"{'; '.join(refused)} (docs/trl.md)")
    check_sequence_length(trainer, args, text, kwargs)


def check_sequence_length(trainer: str, args: TSPGRPOConfig, text: Any,
                          kwargs: dict[str, Any]) -> None:
    """The longest sequence GRPO can build (the longest prompt of ``train_dataset`` as TRL
    tokenizes it, else one token, plus ``max_completion_length``) within the model's rotary
    limit, ``max_position_embeddings``: refused otherwise, naming the numbers and the fix (every
    rank, before any collective; TRL 1.16 does not truncate prompts)."""
    limit = getattr(text, "max_position_embeddings", None)
    completion = args.max_completion_length
    if not limit or completion is None:
        return
    longest = longest_prompt(kwargs.get("train_dataset"), kwargs.get("processing_class"), args)
    prompt = (f"the longest prompt of train_dataset ({longest} tokens)" if longest is not None
              else "a prompt of at least 1 token")
    longest = 1 if longest is None else longest
    if longest + completion > limit:
        fix = (f"set max_completion_length to at most {limit - longest}"
               if limit > longest else "shorten the prompts")
        if longest > 1 and limit > completion:
            fix += f", or drop the prompts longer than {limit - completion} tokens"
        raise ValueError(
            f"{trainer}: {prompt} + max_completion_length ({completion}) = "
            f"{longest + completion} tokens exceeds the model's rotary limit "
            f"(config.max_position_embeddings {limit}): {fix}, or use a model configured for "
            f"longer sequences (docs/trl.md)")


def longest_prompt(dataset: Any, processing_class: Any, args: TSPGRPOConfig) -> int | None:
    """The most tokens of a prompt of ``dataset`` as GRPOTrainer tokenizes it for generation
    (its own ``_tokenize_prompts``, text only and without tools, as TSP runs it), 1,024 prompts
    at a time; None where that is not known before training (an iterable dataset, no "prompt"
    column, no tokenizer given)."""
    if (not isinstance(dataset, datasets.Dataset) or "prompt" not in dataset.column_names
            or not len(dataset) or not isinstance(processing_class, PreTrainedTokenizerBase)):
        return None
    view = SimpleNamespace(processing_class=processing_class, _is_vlm=False,
                           environment_factories=None, tools=None, chat_template=None,
                           chat_template_kwargs=args.chat_template_kwargs or {})
    longest = 0
    for start in range(0, len(dataset), 1024):
        ids, _, _ = GRPOTrainer._tokenize_prompts(view, dataset[start:start + 1024]["prompt"])
        longest = max(longest, *map(len, ids))
    return longest


class TSPGRPOTrainer(TSPTrainer, GRPOTrainer):
    """``GRPOTrainer`` with TSP when ``args.tsp_size`` > 1 (``TSPGRPOConfig``); otherwise exactly
    ``GRPOTrainer``."""

    tsp_args_class = TSPGRPOConfig  # what a plain TrainingArguments becomes

    def __init__(self, model: Any, reward_funcs: Any = None,
                 args: TSPGRPOConfig | None = None, **kwargs: Any) -> None:
        args = default_config(model, TSPGRPOConfig, "GRPO") if args is None else as_tsp_config(args)
        check_model_object(model, args, type(self).__name__)
        if requested_tsp_size(args) != 1:
            check_supported(type(self).__name__, args, model, reward_funcs, kwargs)
        with native_fused_head(trl_grpo, self._to_tsp, full=True), self._temperature_here():
            super().__init__(model, args=args, reward_funcs=reward_funcs, **kwargs)
        if not self._tsp:
            return
        refuse_aux_loss(self)
        self._replica_view = ReplicaView(self.accelerator, get_mesh(self.model),
                                         self.args.process_index // self.tsp_choice.size)
        # TRL seeded seed + process index; the ranks of a group are one replica
        set_seed(self.args.seed + self._replica_view.process_index)

    def _to_tsp(self, model: nn.Module) -> None:
        """The reference model TRL builds, on the policy's mesh (every rank, before any step);
        without TSP (the resolved size is 1) left as it is."""
        if not self._tsp:
            return
        tsp_core.parallelize(model, get_mesh(self.model))
        shard_full_batches(model)
        model.requires_grad_(False)

    @contextlib.contextmanager
    def _temperature_here(self) -> Iterator[None]:
        """While GRPOTrainer's ``__init__`` asks for the fused head at TRL's temperature: a TSP
        model's head is asked at 1.0, since :func:`completion_stats` divides its input by the
        temperature itself."""
        patched = trl_grpo.add_fused_lm_head

        def add_fused_lm_head(model: Any, *args: Any, temperature: float = 1.0,
                              **kwargs: Any) -> None:
            return patched(model, *args, temperature=1.0 if self._tsp else temperature,
                           **kwargs)

        trl_grpo.add_fused_lm_head = add_fused_lm_head
        try:
            yield
        finally:
            trl_grpo.add_fused_lm_head = patched

    @contextlib.contextmanager
    def _replica_collectives(self) -> Iterator[None]:
        """While GRPO generates, scores and computes its loss: its accelerator and its
        ``gather`` / ``gather_object`` count data-parallel replicas, not processes."""
        view, accelerator = self._replica_view, self.accelerator
        gather, gather_object = trl_grpo.gather, trl_grpo.gather_object
        self.accelerator, trl_grpo.gather, trl_grpo.gather_object = (
            view, view.gather, view.gather_object)
        try:
            yield
        finally:
            self.accelerator, trl_grpo.gather, trl_grpo.gather_object = (
                accelerator, gather, gather_object)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self._tsp:
            return super()._generate_and_score_completions(inputs)
        with self._replica_collectives():
            return super()._generate_and_score_completions(inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """The reward functions on rank 0 of the group only (once per replica: a reward that
        calls out or takes time is not repeated per rank); the rewards of every replica and
        what the functions logged (``log_extra``, ``log_metric``) broadcast to the group."""
        if not self._tsp:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mesh, device = get_mesh(self.model), self.args.device
        logs = None
        if mesh.rank == 0:
            rewards = super()._calculate_rewards(inputs, prompts, completions,
                                                 completion_ids_list)
            logs = (dict(self._pending_extra_logs), dict(self._pending_metrics))
        else:
            rewards = torch.empty(len(prompts) * mesh.dp_size, len(self.reward_funcs),
                                  device=device)
        comm.broadcast(rewards, 0, mesh.group)
        extra, metrics = broadcast_object(logs, mesh, device)
        if mesh.rank != 0:
            self._pending_extra_logs.update(extra)
            self._pending_metrics.update(metrics)
        return rewards

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        if not self._tsp:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                lp, ent = completion_stats(model, input_ids[rows], attention_mask[rows],
                                           logits_to_keep, self.temperature)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # GRPO normalises its loss itself (and ignores the Trainer's count): TSPTrainer's check
        # that it came from the TSP forward, without its rescaling of a counted loss
        return super().compute_loss(model, inputs, return_outputs,
                                    None if self._tsp else num_items_in_batch)

    def _compute_loss(self, model, inputs):
        if not self._tsp:
            return super()._compute_loss(model, inputs)
        with self._replica_collectives():
            loss = super()._compute_loss(model, inputs)
        dp = get_mesh(self.model).dp_size
        if dp > 1 and self.model.training:
            # DDP would average the replicas' gradients, tsp_core sums them: the gradient of the
            # mean, the value (what the Trainer logs) unchanged
            loss = loss / dp + (loss - loss / dp).detach()
        return loss


def completion_stats(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     keep: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability and the entropy of each of the last ``keep`` tokens (the completion)
    under ``model`` at ``temperature``, ``[rows, keep]``, as GRPOTrainer's fused head gives them
    (zero on padding), from the TSP model's full-sequence fused fields.

    GRPO's rows are left-padded prompts then right-padded completions; TSP's attention takes
    right padding only. Each row is rotated so that its left padding moves to its end: the
    real tokens then sit at positions 0.. instead of after the padding, which leaves a rotary
    model's attention unchanged (it depends on the distance between positions only), and the
    padding stays masked. The temperature divides the head's input: the logits over it, as
    TRL's head computes them (refused with soft-capping)."""
    seq = input_ids.shape[1]
    lead = (attention_mask.cumsum(1) == 0).sum(1)  # each row's left padding
    source = (torch.arange(seq, device=input_ids.device)[None] + lead[:, None]) % seq
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-keep] = -100
    with head_divided_by(model, temperature):
        out = model(input_ids=input_ids.gather(1, source),
                    attention_mask=attention_mask.gather(1, source),
                    labels=labels.gather(1, source), fused_lm_head=True)
    # TRL's column p - 1 scores the token at p; after the rotation that is column p - 1 - lead
    columns = torch.arange(seq - 1 - keep, seq - 1, device=input_ids.device)[None]
    columns = (columns - lead[:, None]).clamp(min=0)
    return out.log_probs.gather(1, columns), out.entropy.gather(1, columns)


@contextlib.contextmanager
def head_divided_by(model: nn.Module, temperature: float) -> Iterator[None]:
    """The TSP head's input divided by ``temperature`` (its ``logits_divisor`` multiplied)."""
    if temperature == 1.0:
        yield
        return
    head = getattr(model, model_state(model).policy.modules.lm_head)
    own = vars(head).get("logits_divisor")
    head.logits_divisor = head.logits_divisor * temperature
    try:
        yield
    finally:
        if own is None:
            del head.logits_divisor
        else:
            head.logits_divisor = own


class ReplicaView:
    """The trainer's accelerator as GRPO's arithmetic needs it under TSP: one process per
    data-parallel replica (``process_index``, ``num_processes``, ``gather``, ``reduce``), since
    every rank of a TSP group holds its replica's rows whole; all else is the accelerator's."""

    def __init__(self, accelerator: Any, mesh: TSPMesh, replica: int) -> None:
        self._accelerator, self._mesh = accelerator, mesh
        self.process_index, self.num_processes = replica, mesh.dp_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def gather(self, data: Any) -> Any:
        """Each replica's tensors concatenated in replica order (0-d: one element each)."""
        return recursively_apply(lambda t: gather_data_parallel(t, self._mesh), data)

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        def over_replicas(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            for name in self._mesh.other_dims:
                comm.all_reduce(t, self._mesh.device_mesh.get_group(name))
            return t / self.num_processes if reduction == "mean" else t * scale

        return recursively_apply(over_replicas, data)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: Any = 0,
                             pad_first: bool = False) -> Any:
        """Padded along ``dim`` to the replicas' longest (TRL's entropy quantile pads each
        process's tokens to gather them): over replicas, since every rank of a group holds its
        replica's tensor whole and the gather counts each replica once."""
        def pad(t: torch.Tensor) -> torch.Tensor:
            own = t.shape[dim]
            longest = int(self.gather(torch.tensor(own, device=t.device)).max())
            if longest == own:
                return t
            out = t.new_full((*t.shape[:dim], longest, *t.shape[dim + 1:]), pad_index)
            out.narrow(dim, longest - own if pad_first else 0, own).copy_(t)
            return out

        return recursively_apply(pad, data)

    def gather_object(self, items: list) -> list:
        """Every replica's list, concatenated in replica order (pickled, one all-gather of
        the sizes and one of the bytes over data parallel)."""
        if self.num_processes == 1:
            return list(items)
        device = self._accelerator.device
        payload = torch.frombuffer(bytearray(pickle.dumps(list(items))), dtype=torch.uint8)
        sizes = self.gather(torch.tensor(payload.numel(), device=device)).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[:payload.numel()] = payload.to(device)
        every = self.gather(padded).view(len(sizes), -1).cpu()
        return [x for row, n in zip(every, sizes) for x in pickle.loads(row[:n].numpy().tobytes())]


def broadcast_object(obj: Any, mesh: TSPMesh, device: torch.device) -> Any:
    """TSP rank 0's ``obj`` on every rank of its group (pickled: two broadcasts)."""
    if mesh.size == 1:
        return obj
    data = pickle.dumps(obj) if mesh.rank == 0 else b""
    size = torch.tensor([len(data)], device=device)
    comm.broadcast(size, 0, mesh.group)
    if mesh.rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8, device=device)
    comm.broadcast(buf, 0, mesh.group)
    return pickle.loads(buf.cpu().numpy().tobytes())
