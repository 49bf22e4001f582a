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
- ``save_state`` / ``load_state`` write and read model and optimizer through
  torch.distributed.checkpoint (Accelerate's own ``optimizer.bin`` comes from rank 0 only and
  cannot hold sharded Adam state), plus schedulers, the step and every rank's RNG state.

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
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import tsp_core
from tsp_core.mesh import TSPMesh, check_mesh_shape
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
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            self.tsp_mesh = TSPMesh.from_device_mesh(mesh, "tp", layout)
        else:  # one process: Accelerate builds no mesh
            self.tsp_mesh = tsp_core.init_mesh(size, layout=layout)

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
        if self.distributed_type == DistributedType.DEEPSPEED:
            import tsp_deepspeed

            with tsp_deepspeed.routed():  # Accelerate's own deepspeed.initialize call, with the mpu
                return super().prepare(*args, device_placement=device_placement)
        return super().prepare(*args, device_placement=device_placement)

    # ------------------------------------------------------------------ checkpoints
    def _pairs(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        models = [self.unwrap_model(m) for m in self._models]
        optims = [getattr(o, "optimizer", o) for o in self._optimizers]
        return [(m, optims[i] if i < len(optims) else None) for i, m in enumerate(models)]

    def save_state(self, output_dir: str | None = None, **kwargs: Any) -> str:
        if self.distributed_type == DistributedType.DEEPSPEED:  # every rank writes its shards
            return super().save_state(output_dir, **kwargs)
        if output_dir is None:
            raise ValueError("TSPAccelerator.save_state needs an output_dir")
        state: dict[str, Any] = {}
        for i, (model, opt) in enumerate(self._pairs()):
            state[f"model_{i}"] = get_model_state_dict(model)
            if opt is not None:
                state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt)
        dcp.save(state, checkpoint_id=os.path.join(output_dir, "dcp"))
        extra = {"step": self.step, "schedulers": [s.state_dict() for s in self._schedulers]}
        if self.is_main_process:
            torch.save(extra, os.path.join(output_dir, "accelerator_state.pt"))
        torch.save({"torch": torch.get_rng_state()},
                   os.path.join(output_dir, f"rng_state_{self.process_index}.pt"))
        self.wait_for_everyone()
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        if self.distributed_type == DistributedType.DEEPSPEED:
            return super().load_state(input_dir, **kwargs)
        if input_dir is None:
            raise ValueError("TSPAccelerator.load_state needs an input_dir")
        pairs = self._pairs()
        state: dict[str, Any] = {}
        for i, (model, opt) in enumerate(pairs):
            state[f"model_{i}"] = get_model_state_dict(model)
            if opt is not None:
                state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt)
        dcp.load(state, checkpoint_id=os.path.join(input_dir, "dcp"))
        for i, (model, opt) in enumerate(pairs):
            set_model_state_dict(model, state[f"model_{i}"])
            if opt is not None:
                set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"])
        extra = torch.load(os.path.join(input_dir, "accelerator_state.pt"), weights_only=False)
        self.step = extra["step"]
        for sched, sd in zip(self._schedulers, extra["schedulers"]):
            sched.load_state_dict(sd)
        rng = torch.load(os.path.join(input_dir, f"rng_state_{self.process_index}.pt"))
        torch.set_rng_state(rng["torch"])
        if dist.is_initialized():
            self.wait_for_everyone()
