"""Host offload of checkpointed decoder layers' saved inputs (docs/design.md "Long context").

With activation checkpointing a decoder layer keeps only its input for the backward, and at long
context those inputs (layers x S/D x h per rank) are most of what stays on the GPU between the
forward and the backward. :func:`install_activation_offload` moves each of them to host memory
after its layer's forward and brings it back one layer ahead in the backward.

How: saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) pushed around each decoder
layer's call by a forward pre-hook / hook pair. Hugging Face checkpoints a layer's ``forward``,
inside its ``__call__``, so these hooks sit outside the checkpoint: non-reentrant
``torch.utils.checkpoint`` saves the layer's inputs through them, while the layer's own ops save
through the checkpoint's hooks (and the recompute in the backward calls ``forward``, not
``__call__``, so it never sees them). Only the layer's inputs are packed.

Where each input goes:

- a CUDA tensor: a pinned host copy made on a side stream (the device memory is released to the
  allocator once the copy is done: ``record_stream``); in the backward the copy back runs on the
  side stream too, started for layer i-1 when layer i's backward begins;
- a CPU tensor stays where it is (it is already on the host): the same path, exact;
- a fake tensor (``tsp simulate``, the memory tests) goes to the ``meta`` device, which
  MemTracker counts apart from the simulated device: host bytes are the meta device's.

Parameters, and device tensors under :data:`MIN_BYTES`, stay where they are."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

# device tensors smaller than this stay on the device: their copies would cost more in launch
# latency than they free
MIN_BYTES = 64 * 1024

_SIDE_STREAMS: dict[torch.device, Any] = {}


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _side_stream(device: torch.device):
    """One copy stream per CUDA device, shared by every offloaded model."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class _Transfer:
    """A tensor being copied on a side stream: :meth:`wait` makes the current stream wait for
    it and returns it (CUDA); elsewhere the copy is already done."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor: torch.Tensor, event: Any = None) -> None:
        self.tensor, self.event = tensor, event

    def wait(self) -> torch.Tensor:
        t = self.tensor
        if self.event is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(self.event)
            t.record_stream(current)  # freed later on the compute stream: not reused too early
        return t


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The host copy of a saved layer input (the tensor itself on the CPU)."""
    with torch.no_grad():
        t = t.detach()
        if _is_fake(t):
            return t.to("meta")
        if t.device.type == "cpu":
            return t
        if t.device.type != "cuda":  # another accelerator: a plain copy, not overlapped
            return t.to("cpu")
        side = _side_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        t.record_stream(side)  # the caching allocator keeps t's memory until the copy is done
        return host


def _to_device(host: torch.Tensor, device: torch.device) -> _Transfer:
    """Start bringing a host copy back to ``device``."""
    with torch.no_grad():
        if _is_fake(host):
            return _Transfer(host.to(device))
        if device.type == "cpu":
            return _Transfer(host)
        if device.type != "cuda":
            return _Transfer(host.to(device))
        side = _side_stream(device)
        with torch.cuda.stream(side):
            back = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return _Transfer(back, event)


class _LayerInputs:
    """The inputs one decoder layer call saved, on the host; ``prev`` is the layer that ran
    before it in the same forward, whose inputs the backward needs next. Only the autograd graph
    holds it (through :class:`_Ref`): it goes when the backward has used it."""

    __slots__ = ("offload", "prev", "host", "devices", "back", "__weakref__")

    def __init__(self, offload: ActivationOffload, prev: _LayerInputs | None) -> None:
        self.offload, self.prev = offload, prev
        self.host: list[torch.Tensor] = []
        self.devices: list[torch.device] = []
        self.back: dict[int, _Transfer] = {}  # copies on their way back to the device

    def add(self, t: torch.Tensor) -> int:
        self.host.append(_to_host(t))
        self.devices.append(t.device)
        self.offload.stats["offloaded"] += 1
        return len(self.host) - 1

    def prefetch(self) -> None:
        """Start bringing back every input not already on its way."""
        for i, (host, device) in enumerate(zip(self.host, self.devices)):
            if i not in self.back:
                self.back[i] = _to_device(host, device)
                self.offload.stats["prefetched"] += 1

    def take(self, i: int) -> torch.Tensor:
        """Input ``i`` on its device (waited for), and the previous layer's on its way."""
        if i not in self.back:  # not prefetched: the last layer, or a backward that skipped one
            self.back[i] = _to_device(self.host[i], self.devices[i])
        t = self.back.pop(i).wait()
        self.offload.stats["brought_back"] += 1
        if self.prev is not None:
            self.prev.prefetch()
        return t


class _Ref:
    """What the autograd graph holds instead of a saved layer input."""

    __slots__ = ("inputs", "index")

    def __init__(self, inputs: _LayerInputs, index: int) -> None:
        self.inputs, self.index = inputs, index


class ActivationOffload:
    """The hooks of one model (:func:`installed_offload`). ``stats`` counts, since install, the
    layer inputs moved to the host (``offloaded``), brought back (``brought_back``) and those of
    them whose copy back started one layer ahead (``prefetched``)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.stats = {"offloaded": 0, "brought_back": 0, "prefetched": 0}
        # the latest layer call's inputs in this forward: weak, so that nothing here keeps a
        # step's inputs after its backward
        self._last: weakref.ref[_LayerInputs] | None = None
        # (layer, its inputs, its hooks' context) while it runs
        self._open: list[tuple[nn.Module, _LayerInputs, Any]] = []

    # ------------------------------------------------------------------------------ model hook

    def check(self, model: nn.Module, *_: Any) -> None:
        """Forward pre-hook of the model, before any collective: a training forward with grad
        enabled needs checkpointed layers (the same flags, so the same answer, on every rank)."""
        self._last = None  # a new forward: a new chain of layer inputs
        if not torch.is_grad_enabled():
            return
        training = [layer for layer in self.layers if layer.training]
        if training and not any(_checkpointed(layer) for layer in training):
            raise ValueError(
                f"activation_offload moves each checkpointed decoder layer's saved input to host "
                f"memory, but none of this model's {len(self.layers)} decoder layers is "
                f"checkpointed ({len(training)} in training mode, grad enabled): call "
                f"model.activation_checkpointing_enable() before training, or parallelize with "
                f"activation_offload=False")

    # ------------------------------------------------------------------------------ layer hooks

    def enter(self, layer: nn.Module, *_: Any) -> None:
        """Forward pre-hook of a layer: push the saved-tensor hooks when Hugging Face will
        checkpoint this call (its own condition); a layer it does not checkpoint runs as is."""
        if not (_checkpointed(layer) and layer.training and torch.is_grad_enabled()):
            return
        inputs = _LayerInputs(self, self._last() if self._last is not None else None)
        self._last = weakref.ref(inputs)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._open.append((layer, inputs, hooks))

    def leave(self, layer: nn.Module, *_: Any) -> None:
        """Forward hook of a layer (also when its forward raised): pop what :meth:`enter`
        pushed."""
        if self._open and self._open[-1][0] is layer:
            self._open.pop()[2].__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        on_device = _is_fake(t) or t.device.type != "cpu"  # a fake tensor stands for a GPU's
        if isinstance(t, nn.Parameter) or not self._open or (
                on_device and t.numel() * t.element_size() < MIN_BYTES):
            return t
        inputs = self._open[-1][1]
        return _Ref(inputs, inputs.add(t))

    @staticmethod
    def _unpack(ref: Any) -> torch.Tensor:
        return ref if isinstance(ref, torch.Tensor) else ref.inputs.take(ref.index)


def _checkpointed(layer: nn.Module) -> bool:
    return bool(getattr(layer, "gradient_checkpointing", False))


# the offload installed on each model (weakly: a model's hooks go with it)
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def installed_offload(model: nn.Module) -> ActivationOffload | None:
    """The activation offload installed on ``model`` (its hooks and ``stats``), None if none."""
    return _INSTALLED.get(model)


def install_activation_offload(model: nn.Module, layers: list[nn.Module]) -> ActivationOffload:
    """Keep each decoder layer's saved input in host memory between its forward and its
    backward, when activation checkpointing (``model.activation_checkpointing_enable()``) is on;
    the copy back of layer i-1's input starts when layer i's backward begins, so the device holds
    two layer inputs at most, whatever the layer count. Layers that Hugging Face does not
    checkpoint (``every_n_layers``) keep their activations as usual; a training forward with grad
    enabled and no checkpointed layer raises a ``ValueError`` before any collective. Works on any
    Hugging Face decoder (its layers must be ``GradientCheckpointingLayer``s, which checkpoint
    their ``forward`` inside their hooks) whatever the parallel layout. Returns the hooks' owner,
    also :func:`installed_offload`'s."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if installed_offload(model) is not None:
        raise ValueError("activation offload is already installed on this model")
    if not layers:
        raise ValueError("activation_offload needs the model's decoder layers; got none")
    odd = sorted({type(layer).__name__ for layer in layers
                  if not isinstance(layer, GradientCheckpointingLayer)})
    if odd:
        raise ValueError(f"activation_offload needs decoder layers that Hugging Face checkpoints "
                         f"(transformers' GradientCheckpointingLayer, whose checkpoint runs inside "
                         f"the layer's hooks); {odd} are not")
    offload = ActivationOffload(list(layers))
    model.register_forward_pre_hook(offload.check, prepend=True)
    for layer in layers:
        layer.register_forward_pre_hook(offload.enter)
        layer.register_forward_hook(offload.leave, always_call=True)
    _INSTALLED[model] = offload
    return offload


def check_converted(model: nn.Module, *, tile_tokens: int | None = None,
                    activation_offload: bool = False) -> None:
    """For the adapters, handed a model that is already TSP (converted by the user, a loader or
    a framework hook): raise when it was converted without the long-context options the adapter
    was given, which the adapter cannot apply to it any more. The same on every rank (flags
    only, no collective)."""
    if activation_offload and installed_offload(model) is None:
        raise ValueError("activation_offload=True was given, but the model was already "
                         "converted without it: pass activation_offload=True to the call that "
                         "converted it (tsp_core.parallelize, tsp_transformers.load_pretrained), "
                         "or hand over the unconverted model")
    if tile_tokens is not None:
        found = sorted({m.tile_tokens for m in model.modules() if hasattr(m, "tile_tokens")},
                       key=str)
        if found and found != [tile_tokens]:
            raise ValueError(f"tile_tokens={tile_tokens} was given, but the model was already "
                             f"converted with tile_tokens {found}: pass tile_tokens="
                             f"{tile_tokens} to the call that converted it (tsp_core.parallelize, "
                             f"tsp_transformers.load_pretrained), or hand over the unconverted "
                             f"model")
