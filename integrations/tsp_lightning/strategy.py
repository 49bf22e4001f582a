"""``TSPStrategy``: Lightning's ModelParallelStrategy with a TSP group on its tensor-parallel dim.

The strategy builds the mesh, converts the LightningModule's model (the ``model`` attribute, as
set in ``__init__`` or ``configure_model``) unless the user already did, and shards every batch
before the step sees it, so ``return self.model(**batch).loss`` works with or without TSP. The
model's loss is the global mean (identical on every rank), so logged losses are true ones.
Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``) load at any
TSP degree and data-parallel size (``tsp_lightning.checkpoint``); :meth:`export_hf` writes a
consolidated Hugging Face checkpoint. ``fsdp=True``: the conversion also applies FSDP2 over the
whole data-parallel dim (``tsp_core.distributed.fsdp``), before ``configure_optimizers`` runs.
``compile=True`` (or a backend's name): each decoder layer compiled with
``torch.compile(fullgraph=True)``; ``torch.compile(lightning_module)``, Lightning's way, would
compile the whole module and is refused with that option named (:func:`refuse_compiled_module`).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from torch.distributed.constants import default_pg_timeout

import tsp_core

from . import checkpoint as ckpt
from .common import SUPPORTED_PRECISIONS, TSPMeshMixin, parallelize_target, shard
from .monitor import add_monitor

__all__ = ["SUPPORTED_PRECISIONS", "TSPStrategy"]


def refuse_compiled_module(module: Any) -> None:
    """Refuse a LightningModule that ``torch.compile`` wrapped (Lightning unwraps it and marks
    it with ``_compiler_ctx`` before handing it to the strategy): that compiles the whole
    module, every layer's collectives in one graph, recompiled whenever anything outside the
    layers changes. The strategy compiles each decoder layer instead. The module is given its
    own methods back first, so it can be passed again uncompiled."""
    if getattr(module, "_compiler_ctx", None) is None:
        return
    to_uncompiled(module)
    raise RuntimeError("torch.compile(lightning_module) compiles the whole LightningModule, "
                       "which the TSP strategy does not do: it compiles each decoder layer "
                       "instead. Pass the LightningModule itself and "
                       "Trainer(strategy=TSPStrategy(compile=True)) (torch.compile's default "
                       "backend, inductor) or compile='<backend>' (docs/lightning.md)")


class TSPStrategy(TSPMeshMixin, ModelParallelStrategy):
    """``TSPStrategy(tsp_size=None | "auto" | int, data_parallel_size="auto" | int,
    save_distributed_checkpoint=True, layout="zigzag", tsp_seq_len=None, tsp_memory_gb=None,
    tsp_model_config=None, metrics=True, fsdp=False, fsdp_mp_policy=None,
    reshard_after_forward=True, tile_tokens=None, activation_offload=False)``. No TSP size means
    every process of a node; "auto" asks the planner for the smallest degree inside a node that
    fits in memory (``tsp_core.plan.auto``: the sequence length from ``tsp_seq_len``,
    ``TSP_SEQ_LEN`` or the model's max_position_embeddings; the model's config from the
    LightningModule's ``model`` set in ``__init__``). Data parallel
    takes the rest. ``save_distributed_checkpoint``: True writes a reshardable sharded directory,
    False one file with full Hugging Face-shaped weights and optimizer state that any strategy
    loads (``tsp_lightning.checkpoint``). ``metrics``: log TSP's per-step figures (communication,
    waiting, tokens/s, peak memory) to the Trainer's loggers every ``log_every_n_steps``
    (:class:`tsp_lightning.TSPMonitor`, added when the Trainer has a logger and no monitor).
    ``fsdp=True``: FSDP2 also shards each rank's TSP shard over the whole data-parallel dim (per
    decoder layer and the root; model state 1/(tsp x dp) per rank), with FSDP2's
    ``fsdp_mp_policy`` (a ``MixedPrecisionPolicy``) and ``reshard_after_forward``. Long context
    (docs/long-context.md): ``tile_tokens`` and ``activation_offload`` go to
    ``tsp_core.parallelize``; ``activation_offload=True`` keeps each checkpointed decoder layer's
    input in host memory between its forward and its backward, and needs activation
    checkpointing (``model.activation_checkpointing_enable()`` in ``configure_model``).
    ``compile``: False, True (inductor) or a ``torch.compile`` backend's name: each decoder
    layer compiled with ``torch.compile(fullgraph=True)`` (``tsp_core.parallelize``'s option;
    the layers of a model ``configure_model`` converted are compiled too)."""

    strategy_name = "tsp"

    def __init__(self, tsp_size: Literal["auto"] | int | None = None,
                 data_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True, layout: str = "zigzag",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_model_config: Any = None,
                 metrics: bool = True, fsdp: bool = False, fsdp_mp_policy: Any = None,
                 reshard_after_forward: bool = True, tile_tokens: int | None = None,
                 activation_offload: bool = False, compile: bool | str = False) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tsp_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._layout, self._metrics = layout, metrics
        self._set_auto_inputs(tsp_seq_len, tsp_memory_gb, tsp_model_config)
        self._set_fsdp(fsdp, fsdp_mp_policy, reshard_after_forward)
        self._set_long_context(tile_tokens, activation_offload)
        self._set_compile(compile)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def _lightning_module(self) -> Any:
        return self.__dict__.get("_checked_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Any) -> None:
        """Where ``Trainer.fit`` (validate, test, predict) hands over the module, before any
        process group exists: a ``torch.compile``-wrapped one is refused here."""
        refuse_compiled_module(module)
        self.__dict__["_checked_lightning_module"] = module

    def setup_environment(self) -> None:
        self._setup_tsp_environment(self.precision_plugin.precision, super().setup_environment)

    def setup(self, trainer) -> None:
        """ModelParallelStrategy.setup, converting the model instead of requiring
        ``configure_model`` to do it."""
        assert self.model is not None and self.accelerator is not None
        if self._metrics:
            add_monitor(trainer)
        self.accelerator.setup(trainer)
        # before the optimizers: configure_optimizers sees the (FSDP2-)sharded parameters
        parallelize_target(self.lightning_module, self.tsp_mesh, **self._parallelize_options())
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        return shard(super().batch_to_device(batch, device, dataloader_idx), self.tsp_mesh)

    def export_hf(self, path: str) -> None:
        """Write a consolidated Hugging Face checkpoint (config + safetensors) of the converted
        model to ``path``; every rank must call it, rank 0 writes."""
        tsp_core.save_pretrained(parallelize_target(self.lightning_module, self.tsp_mesh), path)
        self.barrier()

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: :meth:`save_checkpoint` writes the weights from the model itself."""
        return {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Empty: :meth:`save_checkpoint` writes the optimizer states from the optimizers."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath,
                        storage_options: Any = None) -> None:
        """Lightning's checkpoint dict with the weights and, unless it was dumped weights-only,
        the optimizer states of the live model and optimizers, in a format every TSP degree and a
        plain model load (module docstring of ``tsp_lightning.checkpoint``)."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is "
                            f"not supported: the TSP strategy does not use a `CheckpointIO`")
        with tsp_core.metrics.paused():  # not a training step's work
            self._save_checkpoint(checkpoint, filepath)

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath) -> None:
        path = Path(self.broadcast(filepath))
        with_optimizers = "optimizer_states" in checkpoint
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizers = list(self.optimizers) if with_optimizers else []
        if self._save_distributed_checkpoint:
            ckpt.save_reshardable(path, self.lightning_module, optimizers, meta)
        else:
            ckpt.save_one_file(path, self.lightning_module, optimizers, lambda sd, osds: {
                **meta, "state_dict": sd,
                **({"optimizer_states": osds} if with_optimizers else {})})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format at any degree (into the optimizers when fitting); an older local-layout
        folder through the base class (the degree that wrote it only)."""
        path = Path(self.broadcast(checkpoint_path))
        module, optimizers = self.lightning_module, list(self.optimizers)
        if ckpt.is_reshardable(path):
            return ckpt.load_reshardable(path, module, optimizers, weights_only)
        if path.is_file():
            loaded = ckpt.read_one_file(path, weights_only)
            ckpt.load_one_file(module, loaded.pop("state_dict"), optimizers,
                               loaded.pop("optimizer_states", None), path)
            return loaded
        return super().load_checkpoint(checkpoint_path, weights_only)
