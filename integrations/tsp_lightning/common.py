"""What the Trainer and Fabric strategies share: sizes, precision, finding the model to convert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

import tsp_core
from tsp_core.distributed.mesh import TSPMesh, check_mesh_shape, set_timeout
from tsp_core.distributed.model_state import find_model_state
from tsp_core.layers.tiles import check_tile_tokens
from tsp_core.models import TSPCausalLM
from tsp_core.models.compiled import check_compile, compile_layers, compiled_by
from tsp_core.models.lora import is_peft_model
from tsp_core.models.offload import check_converted
from tsp_core.plan.auto import TSPChoice, log_choice, resolve_degree

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "64-true")


def resolve_sizes(tsp_size: Any, data_parallel_size: Any, num_nodes: int, num_processes: int,
                  model_config: Any = None, seq_len: int | None = None,
                  memory_gb: float | None = None) -> tuple[int, TSPChoice]:
    """(dp, the TSP choice), checked against the number of processes before any process group
    exists. ``tsp_size``: None = ``TSP_SIZE`` from the environment, else every process of a
    node; "auto" = the planner's smallest degree inside a node that fits in memory
    (``tsp_core.plan.auto``); an int as given. dp: the rest."""
    world = num_nodes * num_processes
    choice = resolve_degree(tsp_size, local_processes=num_processes, model_config=model_config,
                            seq_len=seq_len, memory_gb=memory_gb)
    dp = None if data_parallel_size == "auto" else int(data_parallel_size)
    return check_mesh_shape(world, choice.size, dp), choice


def check_precision(precision: str) -> None:
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported by the TSP strategy; use one "
                         f"of {list(SUPPORTED_PRECISIONS)}")


def parallelize_target(module: nn.Module, mesh: TSPMesh, **options: Any) -> nn.Module:
    """Convert the model the user means, unless it already is converted: ``module`` itself when
    it is a supported transformers model, else its ``model`` attribute. Returns the TSP model.
    ``options``: :func:`tsp_core.parallelize`'s (FSDP2's ``mp_policy`` and
    ``reshard_after_forward`` when the mesh shards data parallel; ``tile_tokens``,
    ``activation_offload``; ``compile``); a model converted already must have been converted
    with the long-context ones (:func:`tsp_core.models.offload.check_converted`), and its
    decoder layers are compiled here for ``compile`` unless they are already."""
    converted = [m for m in module.modules() if isinstance(m, TSPCausalLM)]
    if converted:
        check_converted(converted[0], tile_tokens=options.get("tile_tokens"),
                        activation_offload=options.get("activation_offload", False))
        compile_converted(converted[0], options.get("compile", False))
        return converted[0]
    for candidate in (module, getattr(module, "model", None)):
        if candidate is None or not hasattr(candidate, "config"):
            continue
        return tsp_core.parallelize(candidate, mesh, **options)
    raise ValueError(f"the TSP strategy converts a Hugging Face causal LM: either the module "
                     f"itself or its `model` attribute (set in __init__ or configure_model); "
                     f"{type(module).__name__} has neither. Or convert it yourself in "
                     f"configure_model with tsp_core.parallelize(model, strategy.tsp_mesh)")


def compile_converted(model: nn.Module, compile: bool | str) -> None:
    """Compile the decoder layers of the converted (TSP) ``model`` unless ``compile`` is False
    or one is compiled already."""
    if compile is False:
        return
    modules = find_model_state(model).policy.modules
    layers = getattr(getattr(model, modules.base_model), modules.layers)
    if not any(compiled_by(layer) for layer in layers):
        compile_layers(model, compile)


def shard(batch: Any, mesh: TSPMesh) -> dict:
    """This rank's part of a full-sequence batch (a mapping with ``input_ids``)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(f"the TSP strategy shards batches given as a mapping with 'input_ids' "
                        f"(and optionally 'labels', 'attention_mask', 'position_ids'), got "
                        f"{type(batch).__name__}")
    return tsp_core.shard_batch(dict(batch), mesh)


class TSPMeshMixin:
    """What the Trainer and Fabric strategies share: both subclass a ModelParallelStrategy whose
    tensor-parallel dim holds the TSP group."""

    _layout: str = "zigzag"
    _built_mesh: TSPMesh | None = None
    _auto_inputs: dict[str, Any] = {}
    tsp_choice: TSPChoice | None = None
    _fsdp: bool = False
    _fsdp_options: dict[str, Any] = {}
    _long_context: dict[str, Any] = {}
    _compile: bool | str = False

    def _set_compile(self, compile: bool | str) -> None:
        """``compile``: each decoder layer compiled with ``torch.compile(fullgraph=True)``
        (:func:`tsp_core.parallelize`'s option; docs/lightning.md "torch.compile"), checked
        before any process group exists."""
        check_compile(compile)
        self._compile = compile

    def _set_long_context(self, tile_tokens: int | None, activation_offload: bool) -> None:
        """:func:`tsp_core.parallelize`'s ``tile_tokens`` and ``activation_offload``
        (docs/long-context.md), checked here: before any process group exists."""
        check_tile_tokens(tile_tokens)
        if not isinstance(activation_offload, bool):
            raise TypeError(f"activation_offload must be True or False, got "
                            f"{activation_offload!r}")
        self._long_context = {"tile_tokens": tile_tokens,
                              "activation_offload": activation_offload}

    def _set_fsdp(self, fsdp: bool, mp_policy: Any, reshard_after_forward: bool) -> None:
        """``fsdp=True``: FSDP2 (``fully_shard``) over the whole data-parallel dim, per decoder
        layer and the root, with these two options of it (docs/design.md "FSDP2 on the data-parallel
        axis")."""
        if not fsdp and (mp_policy is not None or reshard_after_forward is not True):
            raise ValueError(f"fsdp_mp_policy ({mp_policy!r}) and reshard_after_forward "
                             f"({reshard_after_forward!r}) are FSDP2's options: pass fsdp=True "
                             f"too, or leave them unset")
        self._fsdp = bool(fsdp)
        self._fsdp_options = {"mp_policy": mp_policy,
                              "reshard_after_forward": reshard_after_forward}

    def _parallelize_options(self) -> dict[str, Any]:
        """The options for ``tsp_core.parallelize``: the long-context ones, and FSDP2's only when
        the mesh shards (its checks refuse an ``mp_policy`` without FSDP2)."""
        fsdp = dict(self._fsdp_options) if self.tsp_mesh.fsdp_size > 1 else {}
        return {**fsdp, **self._long_context, "compile": self._compile}

    def _check_fsdp(self, world: int) -> None:
        """Before any process group exists, identically on every rank."""
        if not self._fsdp or self._data_parallel_size > 1:
            return
        if self._fsdp_options.get("mp_policy") is not None:
            raise ValueError(f"fsdp_mp_policy needs FSDP2 to shard over data parallel, but the "
                             f"data-parallel size is 1 ({world} processes / tsp_size "
                             f"{self.tsp_choice.size}): launch more processes or lower tsp_size, "
                             f"or drop fsdp_mp_policy and train with precision='bf16-mixed'")
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"fsdp=True has nothing to shard: the data-parallel size is 1 ({world} "
                       f"processes / tsp_size {self.tsp_choice.size}); each rank keeps its whole "
                       f"1/{self.tsp_choice.size} TSP shard")

    def _check_peft_fsdp(self) -> None:
        """LoRA with FSDP2 is refused by the conversion, in tsp_core's words (``dp_shard``); a
        strategy user sets ``fsdp=``, so say that here, identically on every rank before any
        process group exists (the Trainer strategies; Fabric sees the model later)."""
        if not self._fsdp or self._data_parallel_size <= 1:
            return
        module = getattr(self, "_lightning_module", None)
        model = getattr(module, "model", None)
        if not is_peft_model(module) and not is_peft_model(model):
            return
        raise NotImplementedError(
            f"a PEFT PeftModel (LoRA) with fsdp=True is not supported yet: FSDP2 would shard it "
            f"over the {self._data_parallel_size} data-parallel replicas. Pass fsdp=False (plain "
            f"data parallelism: each rank keeps its 1/{self.tsp_choice.size} TSP shard of the "
            f"frozen base; docs/lora.md)")

    def _set_auto_inputs(self, seq_len: int | None, memory_gb: float | None,
                         model_config: Any) -> None:
        self._auto_inputs = {"seq_len": seq_len, "memory_gb": memory_gb,
                             "model_config": model_config}

    @property
    def tsp_mesh(self) -> TSPMesh:
        """The TSP mesh, built in ``setup_environment``: with the Trainer when ``fit`` (or
        ``validate``, ``test``, ``predict``) starts, before the LightningModule's
        ``prepare_data``, ``setup`` and ``configure_model`` hooks; with Fabric in
        ``fabric.launch()``."""
        if self._built_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.tsp_mesh was read before the strategy built it. The "
                f"strategy builds the TSP mesh in setup_environment, once the processes are "
                f"started: with the Trainer when trainer.fit (or validate, test, predict) starts, "
                f"so it exists from the LightningModule's prepare_data(), setup() and "
                f"configure_model() hooks on; with Fabric once fabric.launch() has run. It was "
                f"probably read in the LightningModule's __init__ or before trainer.fit / "
                f"fabric.launch(). Read it in configure_model (e.g. "
                f"tsp_core.parallelize(self.model, self.trainer.strategy.tsp_mesh)) or later, or "
                f"let the strategy convert the model: it does so itself when configure_model "
                f"leaves it unconverted")
        return self._built_mesh

    def _model_config(self) -> Any:
        """The config ``tsp_size="auto"`` plans with: given, else the LightningModule's model's
        (the Trainer strategies; Fabric sees no model before its mesh exists)."""
        if self._auto_inputs.get("model_config") is not None:
            return self._auto_inputs["model_config"]
        module = getattr(self, "_lightning_module", None)
        for candidate in (module, getattr(module, "model", None)):
            if candidate is not None and hasattr(getattr(candidate, "config", None), "hidden_size"):
                return candidate.config
        return None

    def _setup_tsp_environment(self, precision: str, setup_environment) -> None:
        # every check that can fail runs first, identically on every rank: no rank hangs
        check_precision(precision)
        self._data_parallel_size, self.tsp_choice = resolve_sizes(
            self._tensor_parallel_size, self._data_parallel_size, self.num_nodes,
            self.num_processes, self._model_config(), self._auto_inputs.get("seq_len"),
            self._auto_inputs.get("memory_gb"))
        self._tensor_parallel_size = self.tsp_choice.size
        self._check_fsdp(self.num_nodes * self.num_processes)
        self._check_peft_fsdp()
        log_choice(self.tsp_choice)
        setup_environment()
        # fsdp: FSDP2 shards each rank's TSP shard over the whole data-parallel dim
        self._built_mesh = TSPMesh.from_device_mesh(
            self.device_mesh, "tensor_parallel", self._layout,
            shard_dim="data_parallel" if self._fsdp else None)
        timeout = getattr(self, "_timeout", None)
        if timeout is not None:  # Lightning gives it to the default process group only
            set_timeout(self._built_mesh, timeout)
