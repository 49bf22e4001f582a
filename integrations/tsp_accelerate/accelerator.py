"""``TSPAccelerator``: Accelerate with a TSP group on the tensor-parallel axis of its
``ParallelismConfig`` (the hook Accelerate has: INTEGRATION_NOTES).

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

DeepSpeed (``accelerate launch --use_deepspeed``; a ``DeepSpeedPlugin`` too, untested): Accelerate calls
``deepspeed.initialize`` itself, with no mpu; ``prepare()`` sends that call through
``tsp_deepspeed.initialize`` (``tsp_deepspeed.routed``), so ZeRO partitions over the data-parallel
axis, and ``save_state`` / ``load_state`` are Accelerate's own (``engine.save_checkpoint`` writes
every TSP rank's shards). On CPU the accelerator is created with a gloo process group instead of
``cpu=True``, which would switch DeepSpeed off.

CPU compatibility shim (two lines, both tested by the 2-process CPU test): without CUDA the
accelerator is created with ``cpu=True``, or Accelerate does not see the launcher's processes; and
:attr:`multi_device` also answers True for a multi-process CPU run (``DistributedType.MULTI_CPU``),
which Accelerate counts as not "multi-device" and ``ParallelismConfig`` would then refuse.
Accelerate takes its ``tp`` path, which does no DDP wrapping: what TSP needs on CPU as on GPU.
On a CPU-only machine ``accelerate launch --cpu`` starts a single process (multi-CPU needs
mpirun); ``accelerate launch --multi_gpu --num_processes 2`` starts torchrun workers, which run
on CPU with gloo.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, InitProcessGroupKwargs, recursively_apply
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tsp_core
from tsp_core.logits import gather_data_parallel
from tsp_core.mesh import TSPMesh, check_mesh_shape
from tsp_core.metrics import StepMetrics
from tsp_core.parallelize import TSPCausalLM, shard_full_batches
from tsp_core.plan.auto import TSPChoice, choose_tsp_size, log_choice


def _local_processes() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _tsp_size(tsp_size: int | str | None, config: ParallelismConfig | None,
              model_config: Any = None, seq_len: int | None = None,
              memory_gb: float | None = None, batch: int = 1) -> TSPChoice:
    """Explicit argument > ``TSP_SIZE`` in the environment (``accelerate launch`` passes the
    environment to its workers) > a tp size given to Accelerate > every process of the node.
    ``"auto"`` (argument or ``TSP_SIZE=auto``) asks the planner (``tsp_core.plan.auto``)."""
    given = tsp_size if tsp_size is not None else (os.environ.get("TSP_SIZE") or None)
    if given is not None:
        return choose_tsp_size(given, model_config=model_config, local_processes=_local_processes(),
                               seq_len=seq_len, memory_gb=memory_gb, batch=batch)
    if config is not None and config.tp_size > 1:
        return TSPChoice(config.tp_size, f"tp_size={config.tp_size} of the ParallelismConfig")
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
        launched = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
        if launched > 1:
            return TSPChoice(launched, f"--parallelism_config_tp_size {launched}")
    n = _local_processes()
    return TSPChoice(n, f"tsp_size unset: every process of a node ({n})")


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
        if self.split_batches or not self.step_with_optimizer or not self.gradient_state.sync_gradients:
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


class TSPAccelerator(Accelerator):
    """``Accelerator`` with TSP. Takes every ``Accelerator`` argument plus ``tsp_size`` (an int,
    ``"auto"`` or None), ``layout`` and, for ``"auto"``, ``tsp_model_config`` (the model's config,
    a dict or a path; or ``TSP_MODEL_CONFIG``: the accelerator exists before ``prepare`` sees the
    model), ``tsp_seq_len`` (or ``TSP_SEQ_LEN``; default the config's max_position_embeddings),
    ``tsp_memory_gb`` (or ``TSP_MEMORY_GB``; default detected) and ``tsp_batch`` (sequences per
    micro-step, 1). ``parallelism_config`` may only set the tp size (other axes are not TSP)."""

    def __init__(self, *args: Any, tsp_size: int | str | None = None, layout: str = "zigzag",
                 tsp_model_config: Any = None, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_batch: int = 1, **kwargs: Any) -> None:
        given = kwargs.get("parallelism_config")
        if given is not None and (given.cp_size > 1 or given.sp_size > 1 or given.dp_shard_size > 1):
            raise ValueError(f"TSPAccelerator composes with data parallel only; got {given}")
        self.tsp_choice = _tsp_size(tsp_size, given, tsp_model_config, tsp_seq_len, tsp_memory_gb,
                                    tsp_batch)
        log_choice(self.tsp_choice)
        size = self.tsp_choice.size
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = check_mesh_shape(world, size, None)  # raises with the numbers, before any collective
        deepspeed = _uses_deepspeed(kwargs)
        if deepspeed:  # Accelerate's tp axis would prepare everything before DeepSpeed sees it
            kwargs.pop("parallelism_config", None)
        else:
            # data parallel goes on Accelerate's dp_shard axis: it refuses tp with dp_replicate
            # alone, and without an FSDP plugin nothing shards; it only splits batches over it
            kwargs["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, tp_size=size)
        if not torch.cuda.is_available():
            if deepspeed:  # cpu=True would switch DeepSpeed off: a gloo process group instead
                handlers = list(kwargs.get("kwargs_handlers") or [])
                if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                    kwargs["kwargs_handlers"] = handlers + [InitProcessGroupKwargs(backend="gloo")]
            else:
                kwargs.setdefault("cpu", True)  # shim: Accelerate needs cpu=True to see a CPU world
        super().__init__(*args, **kwargs)
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
            self.tsp_mesh = TSPMesh.from_device_mesh(mesh, "tp", layout)
        else:  # one process: Accelerate builds no mesh
            self.tsp_mesh = tsp_core.init_mesh(size, layout=layout)
        self._tsp_meter = StepMetrics(self.tsp_mesh)
        self._tsp_steps: dict[int, int] = {}  # optimizer steps taken, per prepared optimizer

    @property
    def multi_device(self) -> bool:
        """The CPU shim (see the module docstring)."""
        return super().multi_device or (self.distributed_type == DistributedType.MULTI_CPU
                                        and self.num_processes > 1)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        swaps: dict[int, nn.Parameter] = {}
        for obj in args:
            if not isinstance(obj, nn.Module):
                continue
            if not isinstance(obj, TSPCausalLM):
                old = dict(obj.named_parameters())
                tsp_core.parallelize(obj, self.tsp_mesh)
                new = dict(obj.named_parameters())
                swaps.update({id(p): new[n] for n, p in old.items() if n in new})
            shard_full_batches(obj)
            obj._tp_size = self.tsp_mesh.size  # what Accelerate's tp path checks
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and swaps:
                for group in obj.param_groups:
                    group["params"] = [swaps.get(id(p), p) for p in group["params"]]
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._tsp_steps:
                self._tsp_steps[id(obj)] = 0
                obj.register_step_post_hook(self._count_step)
        if not self._tsp_meter.started:
            self._tsp_meter.start(0)
        if self.distributed_type == DistributedType.DEEPSPEED:
            import tsp_deepspeed

            with tsp_deepspeed.routed():  # Accelerate's own deepspeed.initialize call, with the mpu
                return super().prepare(*args, device_placement=device_placement)
        return super().prepare(*args, device_placement=device_placement)

    def _count_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # not while paused: torch.distributed.checkpoint's optimizer state dicts (save_state,
        # load_state) take a zero-gradient step to create missing state
        if not self._tsp_meter.paused:
            self._tsp_steps[id(optimizer)] += 1

    def tsp_metrics(self, group_max: bool = False, steps: int | None = None) -> dict[str, float]:
        """TSP's figures per optimizer step since the previous call (the first: since
        ``prepare``), for ``accelerator.log(accelerator.tsp_metrics(), step=...)``: MiB sent,
        collectives, seconds waiting, tokens/s, peak memory (``tsp_core.metrics``; save_state and
        load_state left out; wrap your evaluation in ``tsp_core.metrics.paused()``). Steps are
        the most any prepared optimizer took (or ``steps``, your own count so far: under
        DeepSpeed the engine steps). ``group_max``: also the largest over all ranks (one small
        all-reduce). Empty when no step was taken."""
        taken = steps if steps is not None else max(self._tsp_steps.values(), default=0)
        return self._tsp_meter.read(taken, group_max)

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
        """Accelerate's, stepping once per data-parallel replica (:class:`_DataParallelScheduler`)."""
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
            raise ValueError(f"TSPAccelerator.save_state/load_state pairs optimizers with models by "
                             f"position: {len(models)} models and {len(optims)} optimizers were "
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
            for i, (model, optims) in enumerate(pairs):
                if any(self.unwrap_model(m) is model for m in models):
                    extra = tsp_core.load_checkpoint(os.path.join(directory, _model_dir(i)),
                                                     model, optims)
                    step.append(extra["step"])

        with self._through_tsp_core("_load_model_state_pre_hook", read):
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if step:
            self.step = step[0]
