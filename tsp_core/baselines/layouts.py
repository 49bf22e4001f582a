"""Every layout of the side-by-side comparison behind one interface: build it on a Hugging Face
causal LM, shard a full batch for this rank, run a training step.

Names (used by the CLI and the docs): ``tsp``; ``tp`` (Megatron, no sequence parallel); ``tp-sp``
(with sequence parallel); ``cp`` (context parallel); ``tp+cp`` and ``tp-sp+cp`` (a T x S mesh,
tensor parallel on T inside context parallel on S), labelled e.g. ``tp+cp(4x2)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..distributed import comm
from ..distributed.data_parallel import install_gradient_sync, remove_gradient_sync
from ..distributed.mesh import TSPMesh, init_mesh, init_process_group_from_env
from ..layers.moe import load_balancing_loss
from ..layers.rope import length_dependent_types
from ..models.offload import install_activation_offload
from ..models.parallelize import parallelize
from ..models.policies import find_policy
from ..models.wrap import own_config
from ..sequence.layout import IGNORE_INDEX, shard_batch
from . import context_parallel
from .compiled import compile_baseline_layers
from .moe import TensorParallelMoE, check_moe
from .tensor_parallel import apply_tensor_parallel, check_tensor_parallel

LAYOUTS = ("tsp", "tp", "tp-sp", "cp", "tp+cp", "tp-sp+cp")


@dataclass(frozen=True)
class LayoutSpec:
    """One layout at one shape: ``tp`` tensor-parallel ranks inside ``cp`` context-parallel ones
    (TSP uses ``tp`` for its degree)."""

    name: str
    tp: int
    cp: int = 1

    @property
    def degree(self) -> int:
        return self.tp * self.cp

    @property
    def label(self) -> str:
        return f"{self.name}({self.tp}x{self.cp})" if "+" in self.name else self.name

    @property
    def sequence_parallel(self) -> bool:
        return self.name.startswith("tp-sp")


def layout_specs(name: str, degree: int) -> list[LayoutSpec]:
    """The shapes a layout takes on ``degree`` ranks: every T x S = degree with T, S > 1 for the
    2-D layouts, one shape otherwise."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    if degree < 1:
        raise ValueError(f"degree ({degree}) must be at least 1")
    if name in ("tsp", "tp", "tp-sp"):
        return [LayoutSpec(name, degree, 1)]
    if name == "cp":
        return [LayoutSpec(name, 1, degree)]
    splits = [LayoutSpec(name, t, degree // t) for t in range(2, degree) if degree % t == 0]
    if not splits:
        raise ValueError(f"{name} needs a degree with a split T x S, T and S > 1; {degree} has "
                         f"none")
    return splits


def parse_layouts(names: str, degree: int) -> list[LayoutSpec]:
    """``"tsp,tp,tp+cp"`` -> every shape of every layout, in the given order."""
    return [s for n in names.split(",") if n.strip() for s in layout_specs(n.strip(), degree)]


class ParallelModel:
    """A model laid out one way, with its batch sharding and training step.

    ``step(batch)`` takes the full batch (``input_ids``, ``labels``; identical on every rank),
    runs forward and backward and returns the global mean loss (identical on every rank).
    ``full_grads()`` gathers every gradient to full shape by Hugging Face name.

    A mixture-of-experts model whose config asks for the router logits
    (``output_router_logits``) gets Hugging Face's load-balancing loss added with
    ``router_aux_loss_coef``, as its own loss does, but over the global batch
    (:func:`tsp_core.baselines.moe.load_balancing_loss`).
    """

    def __init__(self, model: nn.Module, spec: LayoutSpec, mesh: TSPMesh,
                 gradient_sync: Any = None) -> None:
        self.model, self.spec, self.mesh = model, spec, mesh
        # a baseline's data-parallel gradient hook (a TSP model's state keeps its own)
        self.gradient_sync = gradient_sync

    def remove_gradient_sync(self) -> None:
        """Leave the data-parallel gradients to an engine that sums them itself (FSDP2)."""
        if self.gradient_sync is not None:
            self.gradient_sync.remove()
            self.gradient_sync = None
        remove_gradient_sync(self.model)

    @property
    def layers(self) -> nn.ModuleList:
        policy = find_policy(self.model)
        return getattr(getattr(self.model, policy.modules.base_model), policy.modules.layers)

    @contextlib.contextmanager
    def layer_traffic(self, index: int = 0) -> Iterator[comm.CommStats]:
        """Count the collectives of decoder layer ``index``'s forward (its first call inside the
        block: a recompute during backward is not counted)."""
        stats = comm.CommStats()
        state: dict[str, object] = {}

        def pre(_m, _args):
            if "cm" not in state:
                state["cm"] = comm.track()
                state["stats"] = state["cm"].__enter__()

        def post(_m, _args, _out):
            if "stats" in state and "done" not in state:
                state["cm"].__exit__(None, None, None)
                state["done"] = True

        layer = self.layers[index]
        handles = [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
        try:
            with self.counting():
                yield stats
        finally:
            for hnd in handles:
                hnd.remove()
            if "stats" in state:
                if "done" not in state:
                    state["cm"].__exit__(None, None, None)
                got: comm.CommStats = state["stats"]
                stats.calls.update(got.calls)
                stats.bytes.update(got.bytes)
                stats.log.extend(got.log)

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        local = shard_batch(batch, self.mesh)
        docs = local.pop("tsp_docs")
        if docs.shape[1] > 1:  # packed rows, or a padding document
            if self.spec.name != "tsp":
                raise ValueError(f"the baseline layouts take unpacked rows whose length is a "
                                 f"multiple of {2 * self.mesh.size}; pad them, or use tsp")
            local["tsp_docs"] = docs
        return local

    def loss(self, local: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.spec.name == "tsp":
            return self.model(**local).loss
        aux = self._aux_loss_layers()
        kwargs = {} if aux is None else {"output_router_logits": not aux}
        out = self.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                         use_cache=False, **kwargs)
        logits = out.logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        labels = local["shift_labels"]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        if isinstance(loss_sum, DTensor):
            loss_sum = loss_sum.full_tensor()
        count = (labels != IGNORE_INDEX).sum().to(loss_sum.dtype)
        comm.all_reduce(count, self.mesh.group)
        loss = comm.sum_over(loss_sum, [self.mesh.group]) / count
        blocks = [m for m in self.model.modules() if isinstance(m, TensorParallelMoE)]
        # tensor parallel: the blocks' own router logits; context parallel alone: Hugging Face's
        router_logits = [m.router_logits for m in blocks] if aux else (
            None if aux is None else list(out.router_logits))
        for m in blocks:  # released every step, used or not
            m.router_logits = None
        if aux is None:
            return loss
        c = self.model.config
        experts = find_policy(self.model).ffn.moe
        balance = load_balancing_loss(
            router_logits, getattr(c, experts.num_experts), getattr(c, experts.top_k),
            [self.mesh.group])
        return loss + c.router_aux_loss_coef * balance

    def _aux_loss_layers(self) -> list[TensorParallelMoE] | None:
        """None: no load-balancing loss (a dense model, or ``output_router_logits`` off); else
        the tensor-parallel MoE blocks (empty under context parallel alone)."""
        if find_policy(self.model).ffn.moe is None or not self.model.config.output_router_logits:
            return None
        return [m for m in self.model.modules() if isinstance(m, TensorParallelMoE)]

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count DTensor's collectives too (tensor-parallel layouts) inside the block. Off by
        default: the counter sees every op, which would slow timed steps."""
        self._count_dtensor = True
        try:
            yield
        finally:
            self._count_dtensor = False

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        if self.spec.tp > 1 and self.spec.name != "tsp":
            from torch.distributed.tensor.parallel import loss_parallel

            with contextlib.ExitStack() as stack:
                stack.enter_context(loss_parallel())
                if getattr(self, "_count_dtensor", False):
                    stack.enter_context(comm.count_functional_collectives())
                yield
        else:
            yield

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.step_local(self.shard(batch))

    def step_local(self, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of this rank's part of a batch (from :meth:`shard`)."""
        with self._context():
            loss = self.loss(local)
            loss.backward()
        return loss.detach()

    def full_grads(self) -> dict[str, torch.Tensor]:
        if self.spec.name == "tsp":
            from ..state.checkpoint import sharded_modules

            return {prefix + n: g for prefix, m in sharded_modules(self.model)
                    for n, g in m.full_tensors(grads=True).items()}
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                for n, p in self.model.named_parameters() if p.grad is not None}


# the families the tensor/context-parallel baselines are checked on
# (tests/baselines/test_baselines.py)
BASELINE_FAMILIES = ("llama", "mistral", "qwen2", "mixtral")


def build_mesh(spec: LayoutSpec) -> TSPMesh:
    """The mesh of ``spec`` over every process (world size = ``spec.degree``): TSP's ("dp", "tsp"),
    or ("cp", "tp") with tensor parallel innermost; the returned TSPMesh names the dim whose
    ranks hold different tokens."""
    init_process_group_from_env()
    world = dist.get_world_size()
    if world != spec.degree:
        raise ValueError(f"{spec.label} needs {spec.degree} processes, the world has {world}")
    if spec.name == "tsp":
        return init_mesh(spec.tp)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dm = init_device_mesh(device, (spec.cp, spec.tp), mesh_dim_names=("cp", "tp"))
    return TSPMesh(dm, "cp")


def build(model: nn.Module, spec: LayoutSpec, mesh: TSPMesh | None = None, *,
          tile_tokens: int | None = None, activation_offload: bool = False,
          compile: bool | str = False) -> ParallelModel:
    """Lay ``model`` out as ``spec`` in place (on ``mesh`` from :func:`build_mesh`, built here
    when not given). ``tile_tokens``, ``activation_offload`` and ``compile`` are
    :func:`parallelize`'s; ``compile`` compiles each baseline's decoder layers the same way
    (:mod:`tsp_core.baselines.compiled`: fullgraph, the same backend and options). Host
    offload of the checkpointed layer inputs does not depend on the layout, so every layout gets
    the same one (:func:`tsp_core.models.offload.install_activation_offload`); tiles are TSP's:
    the baselines' MLP and loss are Hugging Face's, untiled, and ``tile_tokens`` is refused for
    them."""
    if spec.name != "tsp" and tile_tokens is not None:
        raise ValueError(f"tile_tokens ({tile_tokens}) is TSP's: {spec.label}'s MLP and loss are "
                         f"Hugging Face's, not tiled; leave it None")
    if spec.name != "tsp":
        check_tensor_parallel(model.config, spec.tp)  # before any collective
        if spec.tp > 1:
            check_moe(model.config, find_policy(model), spec.tp)
        family = find_policy(model).name
        if family not in BASELINE_FAMILIES:
            raise NotImplementedError(
                f"layout {spec.label}: the baselines are built and tested for "
                f"{', '.join(BASELINE_FAMILIES)}, not {family} ({type(model).__name__}); e.g. "
                f"Qwen3's and Gemma 3's per-head q/k norms are one weight used by tensor-parallel "
                f"ranks that hold different heads, whose gradient the tp styles would not sum")
        ropes = [m for m in model.modules() if length_dependent_types(m)]
        if spec.cp > 1 and ropes:  # each context-parallel rank would use its own longest position
            raise NotImplementedError(
                f"layout {spec.label}: {type(ropes[0]).__name__} ("
                f"{', '.join(length_dependent_types(ropes[0]))} rope) computes its frequencies "
                f"from the longest position it sees, which differs between context-parallel ranks; "
                f"the baselines do not give it the global length (TSP does): use a default rope")
    mesh = mesh or build_mesh(spec)
    if spec.name == "tsp":
        return ParallelModel(parallelize(model, mesh, tile_tokens=tile_tokens,
                                         activation_offload=activation_offload,
                                         compile=compile), spec, mesh)
    own_config(model)  # the attention implementation set below stays off the caller's config
    policy = find_policy(model)
    dm = mesh.device_mesh
    names = policy.modules
    base = getattr(model, names.base_model)
    layers = list(getattr(base, names.layers))
    windows = [policy.attn.sliding_window(model.config, getattr(layer, names.attention))
               for layer in layers]
    if spec.tp > 1:
        apply_tensor_parallel(model, dm["tp"], policy, spec.sequence_parallel)
    context_parallel.install(model, layers, names.attention, mesh.group, mesh.layout, windows)
    sync = install_gradient_sync(model, TSPMesh(dm, "tp"))  # sums every gradient over the cp dim
    if activation_offload:
        install_activation_offload(model, layers)
    compile_baseline_layers(model, layers, getattr(base, names.embed), compile, spec.tp > 1)
    return ParallelModel(model, spec, mesh, sync)
