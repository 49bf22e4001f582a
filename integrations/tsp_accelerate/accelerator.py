"""``TSPAccelerator``: Accelerate with a TSP group on the tensor-parallel axis of its
``ParallelismConfig`` (the hook Accelerate has; docs/accelerate.md).

- TSP degree: ``TSPAccelerator(tsp_size=D)``; otherwise ``TSP_SIZE`` from the environment, which
  ``accelerate launch`` passes to its workers (Accelerate 1.15 rejects unknown config-file keys
  and forwards its own ``--parallelism_config_tp_size`` only together with FSDP2; that tp size is
  honoured when present); otherwise every process of the node. Data parallel takes the rest.
  ``tsp_size="auto"`` / ``TSP_SIZE=auto`` asks the planner for the smallest degree inside a node
  that fits in memory (``tsp_core.plan.auto``; it needs the model's config before ``prepare``:
  ``tsp_model_config=`` or ``TSP_MODEL_CONFIG``).
- ``prepare()`` converts the model with ``tsp_core.parallelize`` (optimizers built on the original
  parameters are pointed at the converted ones, matched by name), lets it shard full-sequence
  batches itself, and leaves the data-parallel gradient sum to ``tsp_core`` (Accelerate does none
  with ``tp`` and no FSDP2). Every rank of a TSP group gets the same batches from Accelerate.
- ``save_state`` / ``load_state`` write and read each model with its optimizers through
  :func:`tsp_core.save_checkpoint` (``<dir>/tsp_model``: Hugging Face names and shapes, so a state
  saved at one TSP degree and data-parallel size resumes at another, or into the unmodified
  model); Accelerate's own code writes everything else as usual (schedulers, samplers, scaler,
  ``step``, each rank's RNG state, registered objects, automatic checkpoint naming). Accelerate's
  ``optimizer.bin`` would come from rank 0 only and cannot hold sharded Adam state.

FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)`` with ``ParallelismConfig(dp_shard_size=N,
tp_size=D)``, or an ``accelerate config`` file with ``distributed_type: FSDP``, ``fsdp_version: 2``
and ``parallelism_config_*`` keys): ``prepare()`` converts the model with ``tsp_core.parallelize``
on Accelerate's mesh, TSP on "tp" and ``fully_shard`` per decoder layer and root on "dp_shard",
with the plugin's ``mixed_precision_policy`` and ``reshard_after_forward``; Accelerate's own FSDP2
preparation then finds an ``FSDPModule`` and only points the optimizer at its parameters (no
second ``fully_shard``, upcast or broadcast from rank 0). Options TSP cannot honour are refused in
the constructor (:func:`check_fsdp_plugin`), before any collective.

DeepSpeed (``accelerate launch --use_deepspeed``; a ``DeepSpeedPlugin`` too, untested): Accelerate
calls ``deepspeed.initialize`` itself, with no mpu; ``prepare()`` sends that call through
``tsp_deepspeed.initialize`` (``tsp_deepspeed.routed``), so ZeRO partitions over the data-parallel
axis, and ``save_state`` / ``load_state`` are Accelerate's own (``engine.save_checkpoint`` writes
every TSP rank's shards). On CPU the accelerator is created with a gloo process group instead of
``cpu=True``, which would switch DeepSpeed off.

CPU compatibility shim (three parts, all tested by the 4-process CPU test): without CUDA the
accelerator is created with ``cpu=True``, or Accelerate does not see the launcher's processes;
:attr:`multi_device` also answers True for a multi-process CPU run (``DistributedType.MULTI_CPU``),
which Accelerate counts as not "multi-device" and ``ParallelismConfig`` would then refuse
(Accelerate takes its ``tp`` path, which does no DDP wrapping: what TSP needs on CPU as on GPU);
and with an FSDP2 plugin the distributed type is made FSDP, as Accelerate makes it only for GPU-like
devices (:meth:`_enable_fsdp_on_cpu`).
On a CPU-only machine ``accelerate launch --cpu`` starts a single process (multi-CPU needs
mpirun); ``accelerate launch --multi_gpu --num_processes 2`` starts torchrun workers, which run
on CPU with gloo.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    recursively_apply,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tsp_core
from tsp_core.distributed.mesh import TSPMesh, check_mesh_shape, set_timeout
from tsp_core.distributed.metrics import StepMetrics
from tsp_core.inference.logits import gather_data_parallel
from tsp_core.layers.tiles import check_tile_tokens
from tsp_core.models import TSPCausalLM, shard_full_batches
from tsp_core.models.lora import inner_model
from tsp_core.models.offload import check_converted
from tsp_core.models.policies import find_policy
from tsp_core.plan.auto import TSPChoice, log_choice, resolve_degree
from tsp_core.state.resharding import check_checkpoint

from .compiling import (
    compile_converted,
    layer_compile,
    not_compiled,
    refuse_compiled_model,
    requested_plugin,
)


def _local_processes() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def choose_accelerate_tsp_size(tsp_size: int | str | None, config: ParallelismConfig | None,
              model_config: Any = None, seq_len: int | None = None,
              memory_gb: float | None = None, batch: int = 1) -> TSPChoice:
    """Explicit argument > ``TSP_SIZE`` in the environment (``accelerate launch`` passes the
    environment to its workers) > a tp size given to Accelerate > every process of the node.
    ``"auto"`` (argument or ``TSP_SIZE=auto``) asks the planner (``tsp_core.plan.auto``)."""
    planning = dict(model_config=model_config, seq_len=seq_len, memory_gb=memory_gb, batch=batch)
    if tsp_size is not None or os.environ.get("TSP_SIZE"):
        return resolve_degree(tsp_size, local_processes=_local_processes(), **planning)
    if config is not None and config.tp_size > 1:
        return TSPChoice(config.tp_size, f"tp_size={config.tp_size} of the ParallelismConfig")
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
        launched = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
        if launched > 1:
            return TSPChoice(launched, f"--parallelism_config_tp_size {launched}")
    return resolve_degree(None, local_processes=_local_processes(), **planning)


def _model_dir(i: int) -> str:
    """Where ``save_state`` writes model ``i`` and its optimizers (a tsp_core checkpoint)."""
    return "tsp_model" if i == 0 else f"tsp_model_{i}"


class _DataParallelScheduler(AcceleratedScheduler):
    """``AcceleratedScheduler`` stepping once per data-parallel replica per optimizer step.
    Accelerate steps a prepared scheduler once per process (each process adds a batch); the
    ranks of a TSP group share one batch, so only ``dp`` batches were consumed. Without this an LR
    schedule at TSP degree D ran D times too fast, unlike one process."""

    dp: int = 1

    def step(self, *args: Any, **kwargs: Any) -> None:
        if (self.split_batches or not self.step_with_optimizer
                or not self.gradient_state.sync_gradients):
            return super().step(*args, **kwargs)  # one step, or none: as Accelerate does
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.dp):  # Accelerate's loop, with dp where it has num_processes
            if hasattr(self.scheduler, "total_steps"):
                if self.scheduler._step_count <= self.scheduler.total_steps:
                    self.scheduler.step(*args, **kwargs)
            else:
                self.scheduler.step(*args, **kwargs)


def _uses_deepspeed(kwargs: dict) -> bool:
    """What Accelerator.__init__ reads: a DeepSpeed plugin, or the launcher's environment."""
    return kwargs.get("deepspeed_plugin") is not None or \
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _requested_fsdp_plugin(kwargs: dict) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin ``Accelerator.__init__`` would use: the argument, else the one it builds
    from the launcher's environment (``accelerate launch`` with ``distributed_type: FSDP``)."""
    plugin = kwargs.get("fsdp_plugin")
    if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        plugin = FullyShardedDataParallelPlugin()
    return plugin


def _requested_parallelism_config(kwargs: dict) -> ParallelismConfig | None:
    """The ``ParallelismConfig`` given, else the launcher's (``parallelism_config_*`` keys of an
    ``accelerate config`` file, forwarded with FSDP2), as ``Accelerator.__init__`` builds it."""
    given = kwargs.get("parallelism_config")
    if given is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG",
                                        "false").lower() == "true":
        given = ParallelismConfig()  # reads PARALLELISM_CONFIG_* from the environment
    return given


def check_fp16_device(mixed_precision: str | None, cpu: bool, who: str) -> None:
    """Refuse fp16 mixed precision on the CPU. Accelerate accepts it there and then runs no fp16
    autocast and no GradScaler (``native_amp`` stays False), so the plain Accelerator and Trainer
    train in float32 while set to fp16, silently. Called before any collective."""
    if mixed_precision == "fp16" and cpu:
        raise ValueError(f"{who}: fp16 mixed precision on the CPU would train in float32: "
                         f"Accelerate runs no fp16 autocast and no GradScaler on a CPU. Use bf16 "
                         f"(mixed_precision='bf16', or bf16=True in TrainingArguments), which "
                         f"autocasts on the CPU, or fp16 on a GPU")


def check_fsdp_version(version: int) -> None:
    if version != 2:
        raise ValueError(f"TSP composes with FSDP2 only, not fsdp_version={version} (FSDP1's "
                         f"flat parameters cannot hold TSP's DTensor shards): set fsdp_version: "
                         f"2 in the accelerate config, FullyShardedDataParallelPlugin("
                         f"fsdp_version=2), or the Trainer's fsdp_config={{'fsdp_version': 2}}")


def check_fsdp_plugin(plugin: FullyShardedDataParallelPlugin) -> None:
    """Refuse, naming the fix, the FSDP options TSP cannot honour. TSP applies FSDP2 itself
    (``tsp_core.parallelize``: each decoder layer and the root, over "dp_shard") and routes the
    plugin's ``mixed_precision_policy`` and ``reshard_after_forward`` into it; Accelerate's own
    ``fully_shard`` then finds the model sharded and leaves it alone, so options that only that
    path applies would be silently dropped. Raises before any collective."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    check_fsdp_version(plugin.fsdp_version)
    refused = []
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        refused.append("cpu_offload (fsdp_offload_params; the Trainer's fsdp='offload'): the TSP "
                       "schedules broadcast each layer's shards from the accelerator; set it "
                       "to false")
    if plugin.activation_checkpointing:
        refused.append("activation_checkpointing (fsdp_activation_checkpointing): Accelerate "
                       "would wrap the decoder layers after TSP sharded them; set it to false "
                       "and, for recompute, call model.activation_checkpointing_enable("
                       "activation_checkpointing_kwargs={'use_reentrant': False}) before the "
                       "model is converted (before prepare, or before creating the TSPTrainer)")
    if plugin.ignored_modules is not None:
        refused.append(f"ignored_modules ({plugin.ignored_modules!r}): TSP shards every "
                       f"parameter; leave it unset")
    if plugin.cpu_ram_efficient_loading:
        refused.append("cpu_ram_efficient_loading (fsdp_cpu_ram_efficient_loading): "
                       "transformers then loads the weights on rank 0 only, for Accelerate's "
                       "own fully_shard to broadcast, which TSP replaces; set it to false (to "
                       "read a large checkpoint without a full copy per rank, use "
                       "tsp_transformers.load_pretrained, which reads each rank's slices)")
    wrap = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if wrap is size_based_auto_wrap_policy and (plugin.min_num_params or 0) > 0:
        refused.append(f"auto_wrap_policy SIZE_BASED_WRAP (min_num_params "
                       f"{plugin.min_num_params}): TSP's FSDP2 units are each decoder layer and "
                       f"the root; use TRANSFORMER_BASED_WRAP or NO_WRAP")
    if refused:
        raise ValueError("TSP with FSDP2 cannot honour " + "; ".join(refused))


def _wrap_class_names(plugin: FullyShardedDataParallelPlugin) -> list[str] | None:
    """The classes a TRANSFORMER_BASED_WRAP policy names (None: it names none)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    wrap = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if wrap is not transformer_auto_wrap_policy:
        return None
    return list(plugin.transformer_cls_names_to_wrap or []) or None


def _check_wrap_classes(names: list[str] | None, model: nn.Module) -> None:
    """TRANSFORMER_BASED_WRAP may only name the decoder layer class: TSP's FSDP2 units are
    each decoder layer and the root, whatever else is named."""
    if not names:
        return
    policy = find_policy(model)
    base = getattr(model, policy.modules.base_model)
    layers = {type(layer).__name__ for layer in getattr(base, policy.modules.layers)}
    other = sorted(set(names) - layers)
    if other:
        raise ValueError(f"transformer_cls_names_to_wrap names {other}: TSP's FSDP2 units are "
                         f"each decoder layer ({', '.join(sorted(layers))}) and the root; name "
                         f"the decoder layer class or leave it unset")


def fsdp_sizes(world: int, tsp: int, config: ParallelismConfig | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of an FSDP2 run: the config's, dp_shard filling the world when
    unset; FSDP2 needs dp_shard > 1. Raises with the numbers, before any collective."""
    replicate = config.dp_replicate_size if config is not None else 1
    if world % (tsp * replicate):
        raise ValueError(f"tsp_size ({tsp}) x dp_replicate_size ({replicate}) must divide the "
                         f"world size ({world})")
    shard = world // (tsp * replicate)
    if config is not None and config.dp_shard_size > 1 and config.dp_shard_size != shard:
        raise ValueError(f"dp_replicate_size ({replicate}) x dp_shard_size "
                         f"({config.dp_shard_size}) x tsp_size ({tsp}) = "
                         f"{replicate * config.dp_shard_size * tsp} does not match the world "
                         f"size ({world}); dp_shard_size {shard} would")
    if shard < 2:
        raise ValueError(f"FSDP2 shards over data parallel, but tsp_size ({tsp}) x "
                         f"dp_replicate_size ({replicate}) takes all {world} processes "
                         f"(dp_shard {shard}): launch more processes, lower tsp_size, or run "
                         f"without FSDP")
    return replicate, shard


class TSPAccelerator(Accelerator):
    """``Accelerator`` with TSP. Takes every ``Accelerator`` argument plus ``tsp_size`` (an int,
    ``"auto"`` or None), ``layout`` and, for ``"auto"``, ``tsp_model_config`` (the model's config,
    a dict or a path; or ``TSP_MODEL_CONFIG``: the accelerator exists before ``prepare`` sees the
    model), ``tsp_seq_len`` (or ``TSP_SEQ_LEN``; default the config's max_position_embeddings),
    ``tsp_memory_gb`` (or ``TSP_MEMORY_GB``; default detected) and ``tsp_batch`` (sequences per
    micro-step, 1). ``parallelism_config`` may set the tp size (the TSP degree) and, with an FSDP2
    plugin, ``dp_shard_size`` / ``dp_replicate_size``; cp and sp are not TSP. Long context
    (docs/long-context.md): ``tile_tokens`` and ``activation_offload`` go to
    ``tsp_core.parallelize``; ``activation_offload=True`` keeps each checkpointed decoder layer's
    input in host memory between its forward and its backward, and needs activation
    checkpointing (``model.activation_checkpointing_enable()``). ``dynamo_backend`` /
    ``dynamo_plugin`` (or ``accelerate launch --dynamo_backend``) compile each decoder layer
    (``tsp_core.parallelize(..., compile=backend)``), never the whole model
    (:mod:`tsp_accelerate.compiling`)."""

    def __init__(self, *args: Any, tsp_size: int | str | None = None, layout: str = "zigzag",
                 tsp_model_config: Any = None, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_batch: int = 1,
                 tile_tokens: int | None = None, activation_offload: bool = False,
                 **kwargs: Any) -> None:
        check_tile_tokens(tile_tokens)  # before any collective
        if not isinstance(activation_offload, bool):
            raise TypeError(f"activation_offload must be True or False, got "
                            f"{activation_offload!r}")
        self._long_context = {"tile_tokens": tile_tokens,
                              "activation_offload": activation_offload}
        self.tsp_compile = layer_compile(requested_plugin(kwargs.pop("dynamo_backend", None),
                                                          kwargs.pop("dynamo_plugin", None)))
        kwargs["dynamo_plugin"] = not_compiled()  # Accelerate compiles nothing whole
        deepspeed = _uses_deepspeed(kwargs)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        fsdp = None if deepspeed or world == 1 else _requested_fsdp_plugin(kwargs)
        given = _requested_parallelism_config(kwargs)
        if given is not None and (given.cp_size > 1 or given.sp_size > 1):
            raise ValueError(f"TSPAccelerator composes with data parallel (and FSDP2) only; got "
                             f"cp_size {given.cp_size}, sp_size {given.sp_size}")
        if given is not None and given.dp_shard_size > 1 and fsdp is None and not deepspeed:
            raise ValueError(f"dp_shard_size ({given.dp_shard_size}) shards data parallel with "
                             f"FSDP2, and no FSDP plugin is given: pass fsdp_plugin="
                             f"FullyShardedDataParallelPlugin(fsdp_version=2) (or launch with an "
                             f"FSDP2 accelerate config), or leave dp_shard_size unset for plain "
                             f"data parallel")
        if fsdp is not None:
            check_fsdp_plugin(fsdp)  # before any collective
        self.tsp_choice = choose_accelerate_tsp_size(tsp_size, given, tsp_model_config,
                                                     tsp_seq_len, tsp_memory_gb, tsp_batch)
        log_choice(self.tsp_choice)
        size = self.tsp_choice.size
        if given is not None and given.tp_size > 1 and given.tp_size != size:
            raise ValueError(f"the ParallelismConfig's tp_size ({given.tp_size}) is the TSP "
                             f"degree, and tsp_size is {size} ({self.tsp_choice.reason}): give "
                             f"one of them, or the same value")
        dp = check_mesh_shape(world, size, None)  # raises with the numbers, before any collective
        if deepspeed:  # Accelerate's tp axis would prepare everything before DeepSpeed sees it
            kwargs.pop("parallelism_config", None)
        elif fsdp is not None:
            # FSDP2 over "dp_shard" (replicas of it on "dp_replicate": HSDP), TSP on "tp"
            replicate, shard = fsdp_sizes(world, size, given)
            kwargs["parallelism_config"] = ParallelismConfig(
                dp_replicate_size=replicate, dp_shard_size=shard, tp_size=size)
            kwargs["fsdp_plugin"] = fsdp
        else:
            # data parallel goes on Accelerate's dp_shard axis: it refuses tp with dp_replicate
            # alone, and without an FSDP plugin nothing shards; it only splits batches over it
            kwargs["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, tp_size=size)
        if not deepspeed:  # DeepSpeed's config sets its own precision
            check_fp16_device(kwargs.get("mixed_precision") or os.environ.get(
                "ACCELERATE_MIXED_PRECISION"), bool(kwargs.get("cpu")) or
                not torch.cuda.is_available(), "TSPAccelerator")
        if not torch.cuda.is_available():
            if deepspeed:  # cpu=True would switch DeepSpeed off: a gloo process group instead
                handlers = list(kwargs.get("kwargs_handlers") or [])
                if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                    kwargs["kwargs_handlers"] = handlers + [InitProcessGroupKwargs(backend="gloo")]
            else:
                kwargs.setdefault("cpu", True)  # shim: Accelerate needs cpu=True to see a CPU world
        super().__init__(*args, **kwargs)
        if fsdp is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self._enable_fsdp_on_cpu(fsdp)
        self._fsdp_wrap_names = None
        if self.is_fsdp2:
            # TSP applies FSDP2 itself, each decoder layer and the root: Accelerate's
            # _prepare_fsdp2 would look the policy's classes up in the converted model, where
            # fully_shard has renamed them (FSDPLlamaDecoderLayer), and fail; they are checked
            # against the model in prepare instead
            self._fsdp_wrap_names = _wrap_class_names(self.state.fsdp_plugin)
            self.state.fsdp_plugin.auto_wrap_policy = None
        mesh = self.torch_device_mesh
        if self.distributed_type == DistributedType.DEEPSPEED:
            # Accelerate's DeepSpeed data loaders give every rank of a "tp" dim of this mesh the
            # same batches (it is where DeepSpeed's AutoTP mesh goes)
            mesh = init_device_mesh(self.device.type, (dp, size), mesh_dim_names=("dp", "tp"))
            self.state.ds_device_mesh = mesh
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() != size:
            # AcceleratorState is one per process: a second accelerator keeps the first's mesh
            raise ValueError(f"this process already has an Accelerator whose tp axis has "
                             f"{mesh['tp'].size()} ranks; a TSPAccelerator with tsp_size {size} "
                             f"cannot change it (Accelerate keeps one AcceleratorState per "
                             f"process): reuse the first accelerator, or call "
                             f"AcceleratorState._reset_state(True) before creating this one")
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            shard_dim = "dp_shard" if self.is_fsdp2 else None
            self.tsp_mesh = TSPMesh.from_device_mesh(mesh, "tp", layout, shard_dim=shard_dim)
        else:  # one process: Accelerate builds no mesh
            self.tsp_mesh = tsp_core.init_mesh(size, layout=layout)
        timeout = next((h.timeout for h in kwargs.get("kwargs_handlers") or []
                        if isinstance(h, InitProcessGroupKwargs) and h.timeout is not None), None)
        if timeout is not None:  # Accelerate gives it to the default process group only
            set_timeout(self.tsp_mesh, timeout)
        self._step_metrics = StepMetrics(self.tsp_mesh)
        self._optimizer_steps: dict[int, int] = {}  # optimizer steps taken, per prepared optimizer

    @property
    def multi_device(self) -> bool:
        """The CPU shim (see the module docstring)."""
        return super().multi_device or (self.distributed_type == DistributedType.MULTI_CPU
                                        and self.num_processes > 1)

    def _enable_fsdp_on_cpu(self, plugin: FullyShardedDataParallelPlugin) -> None:
        """The CPU shim's third part: Accelerate switches to FSDP only for multi-GPU-like
        distributed types, so a multi-process CPU run (gloo) stays MULTI_CPU and would drop the
        plugin. Do what ``AcceleratorState`` does for a GPU run: keep the plugin, give it the
        accelerator's mixed precision, and make the distributed type FSDP (process-wide, as
        Accelerate does)."""
        self.state.fsdp_plugin = plugin
        if self.state.mixed_precision != "no":
            plugin.set_mixed_precision(self.state.mixed_precision)
        self.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    def tsp_parallelize(self, model: nn.Module) -> nn.Module:
        """Convert ``model`` to TSP on this accelerator's mesh, in place, as :meth:`prepare`
        does (a converted model is returned as it is). With FSDP2, ``fully_shard`` then splits
        each rank's TSP shards over "dp_shard" per decoder layer and the root, with the plugin's
        ``mixed_precision_policy`` and ``reshard_after_forward``; with mixed precision the
        parameters are first made float32, as Accelerate's FSDP2 path does. The accelerator's
        ``tile_tokens`` and ``activation_offload`` go to ``parallelize`` too (a model converted
        already must have them), and so does its dynamo backend (``compile``: each decoder
        layer compiled; a converted model's layers are compiled here unless they are already).
        Build the optimizer afterwards, or let :meth:`prepare` point it
        at the new parameters."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(inner_model(model), TSPCausalLM):  # a PeftModel's model inside
            if self.is_fsdp2 and not isinstance(model, FSDPModule):
                raise ValueError(f"{type(model).__name__} was converted to TSP without FSDP2, and "
                                 f"this accelerator shards with FSDP2 (Accelerate's own "
                                 f"fully_shard would then wrap it a second way): pass the "
                                 f"unconverted model to prepare()")
            check_converted(model, **self._long_context)
            compile_converted(model, self.tsp_compile)
            return model
        refuse_compiled_model(model)
        options: dict[str, Any] = dict(self._long_context, compile=self.tsp_compile)
        if self.is_fsdp2:
            plugin = self.state.fsdp_plugin
            _check_wrap_classes(self._fsdp_wrap_names, model)
            if self.mixed_precision != "no":  # fp32 master weights, as fsdp2_prepare_model
                for p in model.parameters():
                    if p.is_floating_point() and p.dtype != torch.float32:
                        p.data = p.data.to(torch.float32)
            options.update(mp_policy=plugin.mixed_precision_policy,
                           reshard_after_forward=plugin.reshard_after_forward)
        tsp_core.parallelize(model, self.tsp_mesh, **options)
        return model

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        swaps: dict[int, nn.Parameter] = {}
        for obj in args:
            if not isinstance(obj, nn.Module):
                continue
            if not isinstance(inner_model(obj), TSPCausalLM):
                old = dict(obj.named_parameters())
                self.tsp_parallelize(obj)
                new = dict(obj.named_parameters())
                swaps.update({id(p): new[n] for n, p in old.items() if n in new})
            else:
                self.tsp_parallelize(obj)  # checks that it fits this accelerator
            shard_full_batches(obj)
            # what Accelerate's tp path checks (a PeftModel reads its model's)
            inner_model(obj)._tp_size = self.tsp_mesh.size
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and swaps:
                for group in obj.param_groups:
                    group["params"] = [swaps.get(id(p), p) for p in group["params"]]
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._optimizer_steps:
                self._optimizer_steps[id(obj)] = 0
                obj.register_step_post_hook(self._count_step)
        if not self._step_metrics.started:
            self._step_metrics.start(0)
        if self.distributed_type == DistributedType.DEEPSPEED:
            import tsp_deepspeed

            with tsp_deepspeed.routed():  # Accelerate's own deepspeed.initialize call, with the mpu
                return super().prepare(*args, device_placement=device_placement)
        if self.is_fsdp2 and any(isinstance(o, nn.Module) for o in args) and \
                not any(isinstance(o, torch.optim.Optimizer) for o in args):
            return self._prepare_without_optimizer(args, device_placement)
        # FSDP2: Accelerate's fsdp2_prepare_model finds the model sharded (an FSDPModule) and
        # returns it untouched: no second fully_shard, no upcast, no broadcast from rank 0
        return super().prepare(*args, device_placement=device_placement)

    def _prepare_tp(self, *args: Any):
        """Accelerate's tp preparation; with FSDP2 without its step that wraps non-DTensor
        parameters as ``Replicate`` on "tp" (every TSP parameter is a DTensor on the whole mesh
        already, so it would change nothing; in Accelerate 1.15 it imports transformers'
        ``ReplicateParallel``, which transformers 5.24 no longer has: ImportError). What remains
        is what it does for everything but the model: loaders, optimizers, then schedulers."""
        if not self.is_fsdp2:
            return super()._prepare_tp(*args)
        from torch.distributed.tensor import DTensor

        for obj in args:
            if isinstance(obj, nn.Module):
                plain = [n for n, p in obj.named_parameters() if not isinstance(p, DTensor)]
                if plain:
                    raise ValueError(f"parameters {plain[:3]} are not DTensors after the TSP "
                                     f"conversion; FSDP2 over TSP needs every parameter sharded "
                                     f"or replicated on the mesh")
        result = [obj if isinstance(obj, nn.Module) else self._prepare_one(obj, first_pass=True)
                  for obj in args]
        return [obj if isinstance(obj, nn.Module) else self._prepare_one(obj) for obj in result]

    def _prepare_without_optimizer(self, args: tuple, device_placement: list[bool] | None):
        """FSDP2: Accelerate prepares a model only together with its optimizer (it points the
        optimizer at the sharded parameters it creates). TSP has sharded the model already, so a
        model alone (the Trainer's ``evaluate()`` before ``train()``) needs nothing more than to
        be registered; everything else is prepared by Accelerate as usual."""
        result = list(args)
        for obj in args:
            if isinstance(obj, nn.Module):
                if not any(m is obj for m in self._models):
                    self._models.append(obj)
                obj._is_accelerate_prepared = True
        rest = [i for i, o in enumerate(args) if not isinstance(o, nn.Module)]
        if rest:
            placement = None if device_placement is None else [device_placement[i] for i in rest]
            done = super().prepare(*[args[i] for i in rest], device_placement=placement)
            for i, obj in zip(rest, done if len(rest) > 1 else (done,)):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def _count_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # not while paused: torch.distributed.checkpoint's optimizer state dicts (save_state,
        # load_state) take a zero-gradient step to create missing state
        if not self._step_metrics.paused:
            self._optimizer_steps[id(optimizer)] += 1

    def tsp_metrics(self, group_max: bool = False, steps: int | None = None) -> dict[str, float]:
        """TSP's figures per optimizer step since the previous call (the first: since
        ``prepare``), for ``accelerator.log(accelerator.tsp_metrics(), step=...)``: MiB sent,
        collectives, seconds waiting, tokens/s, peak memory (``tsp_core.metrics``; save_state and
        load_state left out; wrap your evaluation in ``tsp_core.metrics.paused()``). Steps are
        the most any prepared optimizer took (or ``steps``, your own count so far: under
        DeepSpeed the engine steps). ``group_max``: also the largest over all ranks (one small
        all-reduce). Empty when no step was taken."""
        taken = steps if steps is not None else max(self._optimizer_steps.values(), default=0)
        return self._step_metrics.read(taken, group_max)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """One copy per data-parallel replica: the ranks of a TSP group hold the same losses,
        logits and labels (from ``tsp_core.full_logits``), so Accelerate's gather over the whole
        world would take each D times. Then Accelerate's rule: the final batch keeps the
        dataset's remainder. (``gather`` stays Accelerate's: every rank's copy.)"""
        if use_gather_object:
            raise ValueError("TSPAccelerator.gather_for_metrics gathers tensors (one copy per "
                             "data-parallel replica); gather Python objects with "
                             "accelerate.utils.gather_object over the data-parallel ranks yourself")
        data = recursively_apply(lambda t: gather_data_parallel(t, self.tsp_mesh), input_data,
                                 error_on_other_type=True)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[:state.remainder], data)
        return data

    def prepare_scheduler(self, scheduler):
        """Accelerate's, stepping once per data-parallel replica
        (:class:`_DataParallelScheduler`)."""
        prepared = super().prepare_scheduler(scheduler)
        if type(prepared) is AcceleratedScheduler:
            prepared.__class__ = _DataParallelScheduler
            prepared.dp = self.tsp_mesh.dp_size
        return prepared

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_pairs(self) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        """(model, its optimizers) as ``save_state`` writes them: one model takes every optimizer;
        several models are paired with optimizers by position."""
        models = [self.unwrap_model(m) for m in self._models]
        optims = [getattr(o, "optimizer", o) for o in self._optimizers]
        if len(models) == 1:
            return [(models[0], optims)]
        if optims and len(optims) != len(models):
            raise ValueError(f"TSPAccelerator.save_state/load_state pairs optimizers with models "
                             f"by position: {len(models)} models and {len(optims)} optimizers were "
                             f"prepared; prepare one optimizer per model (or a single model)")
        return [(m, optims[i:i + 1]) for i, m in enumerate(models)]

    @contextmanager
    def _through_tsp_core(self, hook_name: str, hook: Callable[..., None]):
        """Accelerate's own save_state/load_state with no models or optimizers and ``hook`` as its
        only model-state pre-hook: it then handles the directory (automatic checkpoint naming,
        ``total_limit``), schedulers, samplers, the gradient scaler, ``step``, RNG states and
        registered objects exactly as it always does, while ``hook`` writes or reads the models
        and optimizers through tsp_core in the directory Accelerate resolved."""
        saved = self._models, self._optimizers, getattr(self, hook_name)
        self._models, self._optimizers = [], []
        setattr(self, hook_name, {0: hook})
        try:
            yield
        finally:
            self._models, self._optimizers = saved[0], saved[1]
            setattr(self, hook_name, saved[2])

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any):
        """Accelerate's ``save_state``, with each model and its optimizers written by
        :func:`tsp_core.save_checkpoint` to ``<dir>/tsp_model`` (``tsp_model_<i>`` for a further
        model): Hugging Face names and shapes, so the state resumes at any TSP degree and
        data-parallel size, or into the unmodified model (``tsp_core.load_checkpoint``).
        Registered save-state pre-hooks see the models and their state dicts as usual; models
        whose entry a hook removes are not written."""
        with tsp_core.metrics.paused():  # not a training step's work
            return self._save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def _save_state(self, output_dir: str | None, safe_serialization: bool,
                    **save_model_func_kwargs: Any):
        if self.distributed_type == DistributedType.DEEPSPEED:  # every rank writes its shards
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        pairs, models = self._checkpoint_pairs(), list(self._models)
        user_hooks = list(self._save_model_state_pre_hook.values())

        def write(_models: list, _weights: list, directory: str) -> None:
            weights = [model.state_dict() for model, _ in pairs]
            for user_hook in user_hooks:
                user_hook(models, weights, directory)
            for i, (model, optims) in enumerate(pairs[:len(weights)]):
                tsp_core.save_checkpoint(os.path.join(directory, _model_dir(i)), model, optims,
                                         step=self.step)

        with self._through_tsp_core("_save_model_state_pre_hook", write):
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Accelerate's ``load_state`` for a :meth:`save_state` directory written at any TSP
        degree and data-parallel size. ``step`` comes back on every rank (Accelerate reads it from
        each rank's RNG file, which ranks beyond the saving world size do not have; they keep
        their RNG state, as in Accelerate)."""
        with tsp_core.metrics.paused():  # not a training step's work
            self._load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def _load_state(self, input_dir: str | None, load_kwargs: dict | None,
                    **load_model_func_kwargs: Any) -> None:
        if self.distributed_type == DistributedType.DEEPSPEED:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        pairs, models = self._checkpoint_pairs(), list(self._models)
        user_hooks = list(self._load_model_state_pre_hook.values())
        step: list[int] = []

        def read(_models: list, directory: str) -> None:
            for user_hook in user_hooks:  # a hook that loads a model itself removes it from models
                user_hook(models, directory)
            todo = [(os.path.join(directory, _model_dir(i)), model, optims)
                    for i, (model, optims) in enumerate(pairs)
                    if any(self.unwrap_model(m) is model for m in models)]
            for path, model, optims in todo:  # every model checked before any changes
                check_checkpoint(path, model, optims)
            for path, model, optims in todo:
                step.append(tsp_core.load_checkpoint(path, model, optims)["step"])

        with self._through_tsp_core("_load_model_state_pre_hook", read):
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if step:
            self.step = step[0]
