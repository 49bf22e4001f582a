"""``TSPFabricStrategy``: ``Fabric(strategy="tsp")``. ``fabric.setup(model)`` converts the model
(the module itself if it is a Hugging Face causal LM, else its ``model`` attribute), and the
converted model shards full-sequence batches itself, so a Fabric loop calling
``model(**batch).loss`` works unchanged. ``fabric.save`` / ``fabric.load`` use the formats of
``tsp_lightning.checkpoint``: they load at any TSP degree and data-parallel size."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

import tsp_core
from tsp_core.distributed.params import ShardedModule
from tsp_core.models import shard_full_batches

from . import checkpoint as ckpt
from .common import TSPMeshMixin, parallelize_target


class TSPFabricStrategy(TSPMeshMixin, ModelParallelStrategy):
    """Same arguments as :class:`tsp_lightning.TSPStrategy` (``tile_tokens``,
    ``activation_offload`` and ``compile`` too; ``fsdp=True`` too: build the optimizer after
    ``fabric.setup_module``, over the sharded parameters). Fabric builds the mesh at
    ``fabric.launch()``, before it sees the model: ``tsp_size="auto"`` needs ``tsp_model_config``
    (a config, a dict or a path) or ``TSP_MODEL_CONFIG``."""

    def __init__(self, tsp_size: Literal["auto"] | int | None = None,
                 data_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True, layout: str = "zigzag",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_model_config: Any = None,
                 fsdp: bool = False, fsdp_mp_policy: Any = None,
                 reshard_after_forward: bool = True, tile_tokens: int | None = None,
                 activation_offload: bool = False, compile: bool | str = False) -> None:
        super().__init__(parallelize_fn=self._convert, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tsp_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._layout = layout
        self._set_auto_inputs(tsp_seq_len, tsp_memory_gb, tsp_model_config)
        self._set_fsdp(fsdp, fsdp_mp_policy, reshard_after_forward)
        self._set_long_context(tile_tokens, activation_offload)
        self._set_compile(compile)

    def setup_environment(self) -> None:
        self._setup_tsp_environment(self.precision.precision, super().setup_environment)

    def _convert(self, module: nn.Module, _device_mesh) -> nn.Module:
        shard_full_batches(parallelize_target(module, self.tsp_mesh,
                                              **self._parallelize_options()))
        return module

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _split(state: dict[str, Any]
               ) -> tuple[str, nn.Module, dict[str, Optimizer], dict[str, Any]]:
        """(key of the TSP model, the model, the optimizers by key, the other values)."""
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        tsp = [k for k, m in modules.items()
               if any(isinstance(x, ShardedModule) for x in m.modules())]
        if len(tsp) != 1 or len(modules) != 1:
            raise ValueError(f"the TSP strategy checkpoints one model set up with it per call; the "
                             f"state has modules {sorted(modules)}, of which {sorted(tsp)} are TSP "
                             f"models. Save other models in their own call")
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
        return tsp[0], modules[tsp[0]], optimizers, rest

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        """The model, its optimizers and the other values of ``state``
        (``tsp_lightning.checkpoint``: a reshardable directory, or with
        ``save_distributed_checkpoint=False`` one file with full Hugging Face-shaped tensors under
        the state's keys)."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is "
                            f"not supported: the TSP strategy does not use a `CheckpointIO`")
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not save filtered checkpoints")
        path = Path(self.broadcast(path))
        key, module, optimizers, rest = self._split(state)
        if self._save_distributed_checkpoint:
            ckpt.save_reshardable(path, module, list(optimizers.values()), rest)
        else:
            ckpt.save_one_file(path, module, list(optimizers.values()), lambda sd, osds: {
                **rest, key: sd, **dict(zip(optimizers, osds))})

    def load_checkpoint(self, path, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Into a model (and its optimizers) at any TSP degree; the requested values are filled
        in ``state``, the others returned, as Fabric does."""
        if not state:
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs a state with the model "
                             f"to load into: state={{'model': model, ...}}")
        path = Path(self.broadcast(path))
        if not (ckpt.is_reshardable(path) or path.is_file()):
            return super().load_checkpoint(path, state, strict, weights_only)  # older folders
        if isinstance(state, Optimizer):
            raise NotImplementedError(f"loading a single optimizer object is not supported by "
                                      f"{type(self).__name__}; pass "
                                      f"{{'model': ..., 'optimizer': ...}}")
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model): the weights only
            if ckpt.is_reshardable(path):
                tsp_core.load_checkpoint(path, state, weights_only=weights_only is not False)
            else:
                tsp_core.load_full_state_dict(state, ckpt.read_one_file(path, weights_only))
            return {}
        key, module, optimizers, requested = self._split(state)
        if ckpt.is_reshardable(path):
            rest = ckpt.load_reshardable(path, module, list(optimizers.values()), weights_only)
        else:
            rest = ckpt.read_one_file(path, weights_only)
            missing = [k for k in optimizers if k not in rest]
            ckpt.load_one_file(module, rest.pop(key), list(optimizers.values()),
                               None if missing else [rest.pop(k) for k in optimizers], path)
        _validate_keys_for_strict_loading(requested, rest, strict=strict)
        for k in requested:
            if k in rest:
                state[k] = rest.pop(k)
        return rest
