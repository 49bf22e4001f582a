"""``TSPTrainingArguments`` and ``TSPTrainer``: the transformers Trainer with TSP, switched on by
using ``TSPTrainer`` in place of ``Trainer`` (its ``args`` may stay a plain ``TrainingArguments``).
The degree is ``tsp_size`` (also ``--tsp_size`` through ``HfArgumentParser``); unset, it is
``TSP_SIZE`` from the environment, else every process of a node, as for the other adapters.

The Trainer's model is converted before the Trainer sees it; its Accelerator is a
:class:`tsp_accelerate.TSPAccelerator` (so every rank of a TSP group gets the same batches and no
DDP wraps the model); batches are sharded by the model itself. With ``fsdp=...`` and
``fsdp_config={"fsdp_version": 2}`` the model is converted on the accelerator's mesh instead and
FSDP2 shards every rank's TSP shards over the world_size / tsp_size data-parallel ranks
(``TSPAccelerator``'s FSDP2 path; options TSP cannot honour are refused before any collective).
Saving writes an ordinary Hugging Face checkpoint plus the optimizer as a
``tsp_core.save_checkpoint`` directory (Hugging Face names and shapes), so a run resumes at any
TSP degree and data-parallel size; resuming and ``load_best_model_at_end`` read the weights
shard-on-read from ``model.safetensors``. Of a PeftModel the checkpoint holds PEFT's adapter
files instead (the Trainer's own), which resuming reads back into its adapters at any degree.
``torch_compile`` compiles each decoder layer (``tsp_core.parallelize(..., compile=backend)``),
never the whole model: the Trainer's dynamo plugin goes to ``TSPAccelerator``, which keeps
Accelerate from compiling (``tsp_accelerate.compiling``); ``torch_compile_mode`` is refused.

What the Trainer reports counts model replicas, not processes: the ranks of a TSP group hold one
replica and take one batch, so ``total_flos`` counts each replica's model once (embeddings left
out, as Hugging Face's ``floating_point_ops`` leaves them out), and the evaluation steps behind
``*_steps_per_second`` and the model card's ``num_devices`` and total batch sizes use the
world_size / tsp_size data-parallel replicas. The training arithmetic (``max_steps``, steps per
epoch, the progress bar, ``train_samples_per_second``) already does: the Trainer divides by
``get_tp_size()``, which is the TSP degree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers.trainer as hf_trainer
from packaging.version import Version
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import SAFE_WEIGHTS_NAME

import tsp_core
from tsp_accelerate import TSPAccelerator
from tsp_accelerate.accelerator import (
    check_fp16_device,
    check_fsdp_plugin,
    check_fsdp_version,
    fsdp_sizes,
)
from tsp_accelerate.accelerator import choose_accelerate_tsp_size as accelerate_tsp_size
from tsp_accelerate.compiling import compile_converted, layer_compile
from tsp_core.distributed.mesh import get_mesh
from tsp_core.distributed.metrics import StepMetrics
from tsp_core.distributed.model_state import model_state
from tsp_core.distributed.params import ShardedModule
from tsp_core.layers.tiles import check_tile_tokens
from tsp_core.layers.vocab import TSPEmbedding
from tsp_core.models import TSPCausalLM, shard_full_batches
from tsp_core.models.lora import inner_model, is_peft_model
from tsp_core.models.offload import check_converted
from tsp_core.plan.auto import TSPChoice, is_auto, log_choice
from tsp_core.state.checkpoint import check_full_state_dict
from tsp_core.state.resharding import MARKER as RESHARDABLE_MARKER
from tsp_core.state.resharding import check_checkpoint
from tsp_transformers.forward_guard import bypass_message, refuse_bypassed_forward
from tsp_transformers.peft_resume import adapter_loader

OPTIMIZER_DIR = "optimizer_dcp"
# The oldest transformers whose Trainer sizes batches by the data-parallel replicas (it divides
# the processes by get_tp_size()); with an older one TSPTrainer's batch sizes, step counts and
# evaluation losses would be wrong, so it refuses instead (docs/transformers.md)
MIN_TRANSFORMERS = "5.24.0"
SCHEDULER_NAME = "scheduler.pt"


def _keep_other_defaults(cls: type) -> None:
    """Let ``cls``, a composition of ``TSPTrainingArguments`` with another ``TrainingArguments``
    subclass (TRL's ``SFTConfig``, ...), keep that class's fields in either base order.

    ``dataclass`` collects a class's fields from its bases' ``__dataclass_fields__``, from the
    last base of the MRO to the first, and each dataclass there holds every field it inherits:
    ``TSPTrainingArguments``'s copies of the Trainer's fields (the Trainer's defaults) would
    override ``SFTConfig``'s own (learning_rate 2e-5, bf16, gradient_checkpointing,
    logging_steps) whenever it comes first. So ``cls`` redeclares each field whose winner would
    differ if ``TSPTrainingArguments`` contributed only the fields it declares itself; the
    ``@dataclass`` applied to ``cls`` then takes those (a field keeps its place in the order)."""
    own = set(vars(TSPTrainingArguments).get("__annotations__", {}))
    plain: dict[str, Any] = {}
    wanted: dict[str, Any] = {}
    for base in cls.__mro__[-1:0:-1]:
        for name, f in getattr(base, "__dataclass_fields__", {}).items():
            plain[name] = f
            if base is not TSPTrainingArguments or name in own:
                wanted[name] = f
    annotations = cls.__dict__.get("__annotations__")
    if annotations is None:
        annotations = {}
        cls.__annotations__ = annotations
    for name, f in wanted.items():
        if plain[name] is f or name in annotations:
            continue
        annotations[name] = f.type
        setattr(cls, name, dataclasses.field(
            default=f.default, default_factory=f.default_factory, init=f.init, repr=f.repr,
            hash=f.hash, compare=f.compare, metadata=f.metadata, kw_only=f.kw_only))


@dataclass
class TSPTrainingArguments(TrainingArguments):
    tsp_size: str | None = field(default=None, metadata={
        "help": "TSP degree: how many processes share each weight matrix and each sequence "
                "(1 = off). Must divide the number of processes; data parallel takes the rest. "
                "Unset: TSP_SIZE from the environment, else every process of a node "
                "(LOCAL_WORLD_SIZE), as TSPAccelerator and TSPStrategy. 'auto': the smallest "
                "degree inside a node that fits in memory (the planner)."})
    tsp_seq_len: int | None = field(default=None, metadata={
        "help": "sequence length tsp_size='auto' plans for (default: TSP_SEQ_LEN, else the "
                "model's max_position_embeddings)"})
    tsp_memory_gb: float | None = field(default=None, metadata={
        "help": "memory per GPU (GB) tsp_size='auto' plans for (default: TSP_MEMORY_GB, else "
                "detected)"})
    tsp_metrics: bool = field(default=True, metadata={
        "help": "add TSP's per-step figures (tsp/comm_mib, tsp/wait_frac, tsp/tokens_per_s, "
                "peak memory: docs/monitoring.md) to the training logs every logging_steps"})
    tsp_tile_tokens: int | None = field(default=None, metadata={
        "help": "tokens per tile of the MLP and the loss (docs/long-context.md); unset: chosen "
                "from the model's sizes"})
    tsp_activation_offload: bool = field(default=False, metadata={
        "help": "keep each checkpointed decoder layer's input in host memory between its "
                "forward and its backward (docs/long-context.md); needs gradient_checkpointing"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _keep_other_defaults(cls)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tsp_size is not None and not is_auto(self.tsp_size):
            self.tsp_size = int(self.tsp_size)  # "2" from the command line, 2 from code
        check_tile_tokens(self.tsp_tile_tokens)  # before any collective
        self._replicas: int | None = None

    def count_replicas(self, replicas: int | None) -> None:
        """Make :attr:`world_size` ``replicas`` (the number of model replicas), or the number of
        processes again (None): ``TSPTrainer`` does while it computes a figure it reports."""
        self._replicas = replicas

    @property
    def world_size(self) -> int:
        """The number of processes; while ``TSPTrainer`` computes a figure it reports
        (``TSPTrainer._count_replicas``), the number of model replicas. Only there: the
        Trainer's own arithmetic (gathering token counts, checkpoint file names, barriers) needs
        the processes."""
        replicas = getattr(self, "_replicas", None)
        return super().world_size if replicas is None else replicas


def non_embedding_parameters(model: nn.Module) -> int:
    """What Hugging Face's ``num_parameters(exclude_embeddings=True)`` gives for the unmodified
    model (the count its ``floating_point_ops`` uses), from a model TSP may have converted:
    full Hugging Face shapes, not shards or vocabulary padding; a parameter shared by two modules
    (tied embeddings) counted once, at its first module, and left out if that is an embedding."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        embedding = isinstance(module, (nn.Embedding, TSPEmbedding))
        if isinstance(module, ShardedModule):  # its parameters may sit on plain child modules
            # (or, a projection with a LoRA adapter, under the adapter's base_layer)
            owned = [(p, math.prod(module.full_shapes[n])) for n, p in module.own_parameters()]
        else:
            owned = [(p, p.numel()) for p in module.parameters(recurse=False)]
        for param, count in owned:
            if id(param) not in seen:
                seen.add(id(param))
                total += 0 if embedding else count
    return total


def require_transformers(found: str | None = None) -> None:
    """Raise unless this transformers is at least :data:`MIN_TRANSFORMERS` (before any
    collective: the same on every rank)."""
    if found is None:
        import transformers  # the module imported now (a test may stand in another version)

        found = transformers.__version__
    if Version(found) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(f"TSPTrainer with tsp_size > 1 needs transformers >= "
                           f"{MIN_TRANSFORMERS}; this is transformers {found}, whose Trainer "
                           f"counts every process as a model replica (batch sizes, step counts "
                           f"and evaluation losses would be wrong under TSP): pip install "
                           f"'transformers>={MIN_TRANSFORMERS}'")


def resolve_tsp_size(args: TSPTrainingArguments, model: Any) -> TSPChoice:
    """The degree ``TSPTrainer`` builds its mesh with, by ``TSPAccelerator``'s rule (the Trainer's
    accelerator is one): ``args.tsp_size``; unset, ``TSP_SIZE`` from the environment, else every
    process of the node (``LOCAL_WORLD_SIZE``); for "auto" the planner's choice for ``model``'s
    config, ``args.tsp_seq_len`` (or ``TSP_SEQ_LEN`` / the config's max_position_embeddings) and
    ``per_device_train_batch_size`` sequences per step, inside the node's processes. The same on
    every rank, before any collective. A model ``parallelize`` already converted (e.g. by
    ``load_pretrained``) keeps its degree, which a given size must equal."""
    if isinstance(inner_model(model), TSPCausalLM):
        size = get_mesh(model).size
        given = args.tsp_size if args.tsp_size is not None else os.environ.get("TSP_SIZE") or None
        if given is not None and not is_auto(given) and int(given) != size:
            raise ValueError(f"tsp_size ({given}) differs from the TSP degree ({size}) the model "
                             f"was converted with; leave tsp_size unset or convert with {given}")
        return TSPChoice(size, f"the model was converted with tsp_size {size}")
    return accelerate_tsp_size(args.tsp_size, None, getattr(model, "config", None),
                               args.tsp_seq_len, args.tsp_memory_gb,
                               args.per_device_train_batch_size)


def long_context_options(args: Any) -> dict[str, Any]:
    """``tsp_core.parallelize``'s ``tile_tokens`` and ``activation_offload`` from ``args``
    (their defaults for arguments without TSP's fields)."""
    return {"tile_tokens": getattr(args, "tsp_tile_tokens", None),
            "activation_offload": bool(getattr(args, "tsp_activation_offload", False))}


def layer_compile_option(args: TrainingArguments, who: str) -> bool | str:
    """``tsp_core.parallelize``'s ``compile`` for ``torch_compile`` / ``torch_compile_backend``
    / ``torch_compile_mode``: read from the ``TorchDynamoPlugin`` the Trainer builds for its
    Accelerator, which ``TSPAccelerator`` then keeps from compiling the whole model. Raises,
    before any collective, for a mode (``parallelize`` compiles with torch.compile's default)."""
    from accelerate.utils import TorchDynamoPlugin

    backend = args.torch_compile_backend
    plugin = TorchDynamoPlugin(backend=backend, mode=args.torch_compile_mode,
                               dynamic=False if backend == "neuron" else None)  # as the Trainer
    return layer_compile(plugin, who)


def requested_tsp_size(args: Any) -> int | str:
    """The TSP degree ``args`` ask for before the model is known: the resolved size, or "auto"
    (which needs the model's config); 1 without arguments (the trainer's own then: no TSP)."""
    if args is None:
        return 1
    size = getattr(args, "tsp_size", None)
    if size is None and is_auto(os.environ.get("TSP_SIZE")):
        return "auto"
    return "auto" if is_auto(size) else accelerate_tsp_size(size, None).size


def with_tsp_fields(args: TrainingArguments, cls: type) -> TSPTrainingArguments:
    """``args`` as ``cls`` (``TSPTrainingArguments`` or a composition of it with ``args``'s
    class, such as ``tsp_trl.TSPSFTConfig``): every field ``args`` has, TSP's at their defaults,
    so a plain ``TrainingArguments`` given to ``TSPTrainer`` means TSP with its defaults (as TRL's
    SFTTrainer turns a ``TrainingArguments`` into an ``SFTConfig``). Another subclass is refused
    with the class to compose."""
    if isinstance(args, TSPTrainingArguments):
        return args
    if not isinstance(args, TrainingArguments) or not issubclass(cls, type(args)):
        raise TypeError(f"TSP trainers take {cls.__name__} or a class it extends, got "
                        f"{type(args).__name__}; for your own arguments class compose it with "
                        f"TSP's fields: @dataclass class MyArgs({type(args).__name__}, "
                        f"TSPTrainingArguments)")
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})


def weights_loader(model: nn.Module, checkpoint: str) -> Callable[[], None]:
    """Check the weights of a TSPTrainer checkpoint against the converted ``model`` (before
    anything changes, every rank alike) and return what loads them: ``model.safetensors``, each
    rank reading its own slices; of a PeftModel whose checkpoint holds PEFT's adapter files and
    no ``model.safetensors`` (what ``save_model`` writes for it), those files into its adapters,
    as the Trainer loads them into the active adapter (:mod:`tsp_transformers.peft_resume`)."""
    if is_peft_model(model) and not os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_NAME)):
        return adapter_loader(model, checkpoint)
    check_full_state_dict(model, checkpoint)
    return lambda: tsp_core.load_full_state_dict(model, checkpoint)


class _OpenMetricsWindow(TrainerCallback):
    """Starts the trainer's metrics window when training starts (or resumes)."""

    def __init__(self, meter: StepMetrics) -> None:
        self.meter = meter

    def on_train_begin(self, args, state, control, **kwargs):
        self.meter.start(state.global_step)


class TSPTrainer(Trainer):
    """``Trainer`` with TSP when the resolved ``args.tsp_size`` exceeds 1 (``tsp_choice``);
    otherwise exactly ``Trainer``. ``args`` may be a plain ``TrainingArguments`` (or none, as
    for ``Trainer``): TSP's fields then take their defaults, so every process of a node forms
    one TSP group. With ``args.tsp_metrics`` every training log (each ``logging_steps``) also
    carries TSP's per-step figures since the previous one (``tsp_core.metrics``; evaluation and
    checkpoint saving left out), so every ``report_to`` integration receives them.
    ``args.tsp_tile_tokens`` and ``args.tsp_activation_offload`` are ``tsp_core.parallelize``'s
    ``tile_tokens`` and ``activation_offload`` (docs/long-context.md; offload needs
    ``gradient_checkpointing=True``); a model converted already must have been converted with
    them."""

    # what plain arguments become (a trainer mixed in sets its config's TSP composition)
    tsp_args_class: type = TSPTrainingArguments

    def __init__(self, model=None, args: TrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        if args is None and self.tsp_args_class is TSPTrainingArguments:
            args = TSPTrainingArguments(output_dir="tmp_trainer")  # Trainer's own default
        elif args is not None:
            args = with_tsp_fields(args, self.tsp_args_class)
        self.tsp_choice = None
        if args is not None:
            self.tsp_choice = resolve_tsp_size(args, model)  # before any collective, every rank
            log_choice(self.tsp_choice)
        self._tsp = self.tsp_choice is not None and self.tsp_choice.size > 1
        if self._tsp:
            require_transformers()
            self._refuse_per_replica_token_counts(args)
            check_fp16_device("fp16" if args.fp16 and not args.deepspeed else None,
                              args.use_cpu or not torch.cuda.is_available(), type(self).__name__)
        # a checkpoint's weights, checked, and what loads them (see _load_from_checkpoint)
        self._pending_weights: tuple[str, Callable[[], None]] | None = None
        self._flops_parameters: int | None = None
        self._choice_to_log = self.tsp_choice if self._tsp and self.tsp_choice.auto else None
        self._fsdp2 = self._tsp and getattr(args, "fsdp_plugin_args", None) is not None
        if self._fsdp2:
            self._check_fsdp(args, model)  # before any collective, every rank
        self._long_context = long_context_options(args)
        # torch_compile: each decoder layer compiled, never the whole model (docs/transformers.md)
        compile = layer_compile_option(args, type(self).__name__) if self._tsp else False
        converted = isinstance(inner_model(model), TSPCausalLM)  # a PeftModel's model inside
        if self._tsp and converted:  # converted already, e.g. loaded
            check_converted(model, **self._long_context)
        if self._tsp and not self._fsdp2:
            _ = args.world_size  # initialises the process group from the launcher's environment
            if not converted:  # else its own mesh: no second set of groups
                mesh = tsp_core.init_mesh(self.tsp_choice.size, timeout=args.ddp_timeout)
                tsp_core.parallelize(model, mesh, **self._long_context, compile=compile)
            compile_converted(model, compile)
            shard_full_batches(model)
        # with FSDP2 the model is converted on the accelerator's mesh as soon as the Trainer has
        # created it (create_accelerator_and_postprocess), before it looks at the model. args by
        # keyword when it can be: a trainer mixed in may take another second argument (TRL's
        # DPOTrainer: ref_model)
        if rest:
            super().__init__(model, args, *rest, **kwargs)
        else:
            super().__init__(model, args=args, **kwargs)
        if self._tsp:
            refuse_bypassed_forward(self, inner_model(self.model))  # every rank, before a step
        self._step_metrics = None
        if self._tsp and getattr(self.args, "tsp_metrics", False):
            self._step_metrics = StepMetrics(get_mesh(self.model))
            self.add_callback(_OpenMetricsWindow(self._step_metrics))
        if self._tsp and self.args.label_names is None:
            # the TSP forward also names shift_labels; batches carry "labels" (shifted on the
            # full sequence when the model shards them)
            self.label_names = ["labels"]

    def _check_fsdp(self, args: TSPTrainingArguments, model: Any) -> None:
        """FSDP2 (``fsdp=...``, ``fsdp_config={"fsdp_version": 2}``) over the data-parallel
        ranks: refuse what TSP cannot honour, with the numbers and the fix."""
        from accelerate.utils import FullyShardedDataParallelPlugin

        if model is None or not hasattr(model, "config"):
            raise ValueError("TSPTrainer with FSDP2 converts the model it is given: pass model=, "
                             "not model_init=")
        if args.parallelism_config is not None:
            raise ValueError("TSPTrainer builds its own parallelism (data parallel x tsp_size); "
                             "with FSDP2 it shards over all world_size / tsp_size data-parallel "
                             "ranks: leave parallelism_config unset")
        check_fsdp_version(args.fsdp_plugin_args.get("fsdp_version", 1))
        check_fsdp_plugin(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
        fsdp_sizes(int(os.environ.get("WORLD_SIZE", "1")), self.tsp_choice.size, None)

    def create_accelerator_and_postprocess(self) -> None:
        if not self._tsp:
            return super().create_accelerator_and_postprocess()
        tsp_size, long_context = self.tsp_choice.size, self._long_context

        class _Accelerator(TSPAccelerator):
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("parallelism_config", None)
                super().__init__(*a, tsp_size=tsp_size, **long_context, **kw)


        original = hf_trainer.Accelerator  # the Trainer builds its accelerator from this name
        hf_trainer.Accelerator = _Accelerator
        try:
            out = super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = original
        if self._fsdp2:
            # TSP, then FSDP2 over "dp_shard" per decoder layer and the root, with the fsdp
            # config's reshard_after_forward and the mixed precision (bf16=/fp16=) the Trainer
            # gave the plugin; Accelerate's own FSDP2 preparation then leaves the model alone
            self.accelerator.tsp_parallelize(self.model)
            shard_full_batches(self.model)
            self.model._tp_size = tsp_size  # what the Trainer's get_tp_size reads
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._tsp:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        refuse_bypassed_forward(self, inner_model(self.model))
        if self._pending_weights is not None:
            raise RuntimeError(f"the weights of {self._pending_weights[0]} were checked but never "
                               f"loaded: the Trainer did not load that checkpoint's optimizer "
                               f"state (_load_optimizer_and_scheduler)")
        losses_before = model_state(self.model).loss_calls
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training and model_state(self.model).loss_calls == losses_before:
            raise ValueError(bypass_message(self, "its loss did not come from the TSP model's "
                                                  "forward with labels (the vocabulary-parallel "
                                                  "loss): it was built some other way, e.g. from "
                                                  "the output embedding's weight or from logits"))
        loss = out[0] if return_outputs else out
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func)):
            # the Trainer scaled the loss by the data-parallel size for DDP's averaging; the TSP
            # loss is already the global mean and tsp_core sums data-parallel gradients
            loss = loss / (self.accelerator.num_processes // self.get_tp_size())
        return (loss, out[1]) if return_outputs else loss

    # a subclass whose loss handles the Trainer's per-replica token counts sets this
    # (tsp_trl.TSPSFTTrainer)
    _per_replica_token_counts = False

    def _refuse_per_replica_token_counts(self, args: TSPTrainingArguments) -> None:
        """``average_tokens_across_devices=False`` (each replica's loss over its own tokens, as
        under DDP) is refused before any collective: the TSP loss divides the whole mesh's sum
        by the count the Trainer passes, which is then this replica's over the TSP degree, so
        the loss and gradients would be tsp_size x dp_size too large."""
        if not args.average_tokens_across_devices and not self._per_replica_token_counts:
            raise ValueError(f"{type(self).__name__}: average_tokens_across_devices=False is not "
                             f"supported with tsp_size {self.tsp_choice.size} (the loss would be "
                             f"{self.tsp_choice.size} x the data-parallel size too large); leave "
                             f"it True, the default: the loss is then the mean over the global "
                             f"batch's tokens")

    # ------------------------------------------------------------------ what the Trainer reports
    @property
    def data_parallel_size(self) -> int:
        """Model replicas: the processes over the TSP degree (the processes without TSP)."""
        world = self.accelerator.num_processes
        return world // self.tsp_choice.size if self._tsp else world

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """The Trainer's sampler; ``train_sampling_strategy="batch_rebalance"`` splits each global
        batch over the replicas, by replica (the Trainer's splits it over all processes, so the
        ranks of a TSP group would get different rows)."""
        sampler = super()._get_train_sampler(train_dataset)
        if not self._tsp or not isinstance(sampler, BatchRebalanceSampler):
            return sampler
        dp = self.data_parallel_size
        return BatchRebalanceSampler(
            sampler.lengths, self.args.train_batch_size * sampler.grad_accum * dp, dp,
            sampler.grad_accum, shuffle=sampler.shuffle, seed=sampler.seed,
            rank=self.args.process_index // self.tsp_choice.size, drop_last=sampler.drop_last)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Hugging Face's 6 x tokens x non-embedding parameters of the unmodified model, counted
        by one rank of each TSP group (every rank of the group sees the replica's whole batch),
        so the Trainer's sum over all processes counts each replica once."""
        if not self._tsp:
            return super().floating_point_ops(inputs)
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or get_mesh(self.model).rank != 0:
            return 0
        if self._flops_parameters is None:
            self._flops_parameters = non_embedding_parameters(self.model)
        return 6 * inputs[main].numel() * self._flops_parameters

    def _count_replicas(self, on: bool) -> None:
        """Make ``args.world_size`` the number of replicas (``on``) or of processes again."""
        if self._tsp:
            self.args.count_replicas(self.data_parallel_size if on else None)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The Trainer's loop; once it is done, and until the next log row, ``args.world_size``
        counts replicas: ``evaluate`` and ``predict`` then count the steps behind
        ``*_steps_per_second`` as eval_batch_size x world_size per step."""
        out = super().evaluation_loop(*args, **kwargs)
        self._count_replicas(True)
        return out

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's model card, its ``num_devices`` and total batch sizes counting
        replicas (the global batch is per-device batch x accumulation x replicas)."""
        self._count_replicas(True)
        try:
            return super().create_model_card(*args, **kwargs)
        finally:
            self._count_replicas(False)

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log; a training row (it has ``loss``) also gets TSP's figures, and
        the first row the degree ``tsp_size="auto"`` chose (``tsp_size``)."""
        self._count_replicas(False)  # evaluation_loop's figures are computed
        if self._step_metrics is not None and "loss" in logs:
            logs = {**logs, **self._step_metrics.read(self.state.global_step)}
        if self._choice_to_log is not None:
            logs = {"tsp_size": self._choice_to_log.size, **logs}
            self._choice_to_log = None
        return super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with tsp_core.metrics.paused():  # not a training step's work
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self._count_replicas(False)

    def predict(self, *args: Any, **kwargs: Any):
        try:
            return super().predict(*args, **kwargs)
        finally:
            self._count_replicas(False)

    def _save_checkpoint(self, *args: Any, **kwargs: Any):
        with tsp_core.metrics.paused():
            return super()._save_checkpoint(*args, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's step with TSP: the loss alone goes the Trainer's own way (no logits are
        computed or gathered); with metrics, ``tsp_core.full_logits`` gives every rank the
        logits of the whole sequence in the original order (what the model returns on one
        process), which the Trainer then gathers over data parallel only."""
        if not self._tsp:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._ignore_repeated_rows(inputs)
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        names = self.label_names
        has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
        extra = {}
        if has_labels and self.model_accepts_loss_kwargs:
            extra["num_items_in_batch"] = self._get_num_items_in_batch([inputs], self.args.device)
        with torch.no_grad(), self.compute_loss_context_manager():
            out = tsp_core.full_logits(model, inputs, **extra)
        if not has_labels:
            return None, out.logits, None
        labels = tuple(inputs[k] for k in names)
        return out.loss.detach(), out.logits, labels[0] if len(labels) == 1 else labels

    def _ignore_repeated_rows(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """With data parallel, Accelerate fills the final uneven eval batch with rows repeated
        from the start (every replica steps together) and ``gather_for_metrics`` drops them
        from what it gathers. The TSP loss is one mean over the whole mesh, so their labels are
        ignored here too: ``eval_loss`` counts each row once, as on one process."""
        state = self.accelerator.gradient_state
        labels = inputs.get("labels")
        if labels is None or not state.end_of_dataloader or state.remainder <= 0:
            return inputs
        data_rank = self.accelerator.process_index // self.tsp_choice.size
        real = min(labels.shape[0], max(0, state.remainder - data_rank * labels.shape[0]))
        if real == labels.shape[0]:
            return inputs
        labels = labels.clone()
        labels[real:] = -100
        return {**inputs, "labels": labels}

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._tsp:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if is_peft_model(self.model):  # PEFT's adapter files, the adapters gathered
            self.model.save_pretrained(output_dir)  # every rank gathers, rank 0 writes
        else:
            tsp_core.save_pretrained(self.model, output_dir)  # every rank gathers, rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._tsp:
            return super()._save_optimizer_and_scheduler(output_dir)
        # the weights are in model.safetensors (a PeftModel's adapters in PEFT's files)
        # already: the optimizer alone, reshardable
        tsp_core.save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), self.model,
                                 self.optimizer, model_state=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A TSP checkpoint's optimizer state at any TSP degree and data-parallel size, into
        TSPTrainer or (tsp_size 1) the plain Trainer's optimizer; the plain Trainer's own files
        as the Trainer reads them."""
        tsp_state = checkpoint is not None and os.path.isfile(
            os.path.join(checkpoint, OPTIMIZER_DIR, RESHARDABLE_MARKER))
        if not tsp_state and (not self._tsp or checkpoint is None):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if tsp_state:  # scheduler, optimizer state and weights checked before any changes
            scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=False)
            optimizer_dir = os.path.join(checkpoint, OPTIMIZER_DIR)
            check_checkpoint(optimizer_dir, self.model, self.optimizer, model_state=False)
            if self._pending_weights is not None:  # checked by _load_from_checkpoint
                self._pending_weights[1]()
                self._pending_weights = None
            tsp_core.load_checkpoint(optimizer_dir, self.model, self.optimizer,
                                     model_state=False)
            self.lr_scheduler.load_state_dict(scheduler)
            return
        elif os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):  # older: local, same degree
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, OPTIMIZER_DIR))
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        elif os.path.isfile(os.path.join(checkpoint, hf_trainer.OPTIMIZER_NAME)):
            raise ValueError(f"{checkpoint} was written by the plain Trainer (its "
                             f"{hf_trainer.OPTIMIZER_NAME} holds the optimizer state of the "
                             f"unmodified model): TSPTrainer resumes from its own checkpoints; "
                             f"start from the weights alone with model_init or from_pretrained")
        else:
            return  # no optimizer state (save_only_model): as the Trainer, nothing to load
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=False))

    def _load_best_model(self) -> None:
        """The best checkpoint's ``model.safetensors``, each rank reading its own slices (the
        Trainer's own ``load_state_dict`` of the full tensors does not fit sharded parameters);
        of a PeftModel its adapter files (:func:`weights_loader`)."""
        if not self._tsp:
            return super()._load_best_model()
        hf_trainer.logger.info(f"Loading best model from {self.state.best_model_checkpoint} "
                               f"(score: {self.state.best_metric}).")
        weights_loader(self.model, self.state.best_model_checkpoint)()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights, each rank reading its own slices (checked whole before any changes).
        The Trainer loads the optimizer later, once it exists: with a TSP optimizer checkpoint
        the weights are checked now and copied only in :meth:`_load_optimizer_and_scheduler`,
        after the optimizer's state has been checked too, so a resume that must fail fails
        before the weights change."""
        if not self._tsp:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        scheduler = os.path.join(resume_from_checkpoint, SCHEDULER_NAME)
        if os.path.isdir(os.path.join(resume_from_checkpoint, OPTIMIZER_DIR)) and \
                not os.path.isfile(scheduler):
            raise FileNotFoundError(f"{resume_from_checkpoint} holds {OPTIMIZER_DIR} but no "
                                    f"{SCHEDULER_NAME}: it cannot resume training; nothing was "
                                    f"loaded")
        load = weights_loader(model or self.model, resume_from_checkpoint)
        if os.path.isfile(os.path.join(resume_from_checkpoint, OPTIMIZER_DIR,
                                       RESHARDABLE_MARKER)):
            self._pending_weights = (resume_from_checkpoint, load)
            return
        load()
