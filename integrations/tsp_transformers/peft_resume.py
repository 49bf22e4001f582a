"""Resuming a converted PeftModel from a Trainer checkpoint (docs/lora.md "Checkpoints").

The Trainer's checkpoint of a PeftModel holds PEFT's adapter files, not ``model.safetensors``:
``TSPTrainer.save_model`` writes them with the converted PeftModel's ``save_pretrained``, as the
Trainer does on one process. The Trainer resumes such a run by loading ``adapter_model.safetensors``
into the active adapter with PEFT's ``load_adapter``, which cannot reach TSP's adapters; these
functions read the same files, by the same rule, into them. Every adapter tensor is replicated
over the TSP group, so a run resumes from these files at any TSP degree."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from safetensors import safe_open
from torch import nn
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME

from tsp_core.layers.lora import TSPLoRA

Expected = dict[str, tuple[TSPLoRA, str, tuple[int, ...]]]


def adapter_files(directory: str, active: str) -> dict[str, str]:
    """Adapter name -> the ``adapter_model.safetensors`` that holds it in a checkpoint, by the
    Trainer's ``_load_from_checkpoint`` rule: a subdirectory holding one is the adapter of its
    name (PEFT's ``save_pretrained`` writes every adapter but "default" there); the directory's
    own file is the active adapter's, or "default"'s when there are such subdirectories."""
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name, ADAPTER_SAFE_WEIGHTS_NAME)
        if os.path.isfile(path):
            files[name] = path
    own = os.path.join(directory, ADAPTER_SAFE_WEIGHTS_NAME)
    if os.path.isfile(own):
        files["default" if files else active] = own
    return files


def expected_tensors(model: nn.Module, adapter: str) -> Expected:
    """PEFT's key in the adapter file -> (the TSP adapter, its tensor's name, full shape), for
    adapter ``adapter`` of the converted PeftModel ``model``: the model's own parameter name with
    the adapter name taken out by the PeftModel's tuner, as PEFT saves it."""
    remove_name = type(model.base_model)._remove_adapter_name_from_key
    out: Expected = {}
    for prefix, m in model.named_modules():
        if isinstance(m, TSPLoRA) and adapter in m.r:
            for kind in m.adapter_layer_names:
                own = f"{kind}.{adapter}.weight"
                out[remove_name(f"{prefix}.{own}", adapter)] = (m, own, m.full_shapes[own])
    return out


def mismatches(path: str, expected: Expected) -> list[str]:
    """What keeps the file ``path`` from being exactly the ``expected`` tensors (read from its
    header alone): missing, unexpected and differently shaped tensors."""
    with safe_open(path, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    shaped = [f"{k} has shape {shapes[k]} in the file, {tuple(want)} here"
              for k, (_, _, want) in expected.items() if k in shapes and shapes[k] != tuple(want)]
    return ([f"{len(missing)} tensors missing (e.g. {missing[:2]})"] if missing else []) + \
        ([f"{len(extra)} tensors this model does not have (e.g. {extra[:2]})"] if extra else []) \
        + shaped[:3]


def adapter_loader(model: nn.Module, directory: str) -> Callable[[], None]:
    """Check the adapter files of the checkpoint ``directory`` against the converted PeftModel
    ``model`` (names and shapes, on every rank alike, before anything changes) and return the
    function that copies them into its adapters (no collective: the adapters are replicated).
    Raises, naming what differs and the fix, for a checkpoint without adapter files or with
    other adapters than the model's."""
    files = adapter_files(directory, model.active_adapter)
    if not files:
        raise FileNotFoundError(f"{directory} holds neither model.safetensors nor PEFT's "
                                f"{ADAPTER_SAFE_WEIGHTS_NAME}: it is no checkpoint of this "
                                f"PeftModel's training; nothing was loaded")
    plan = []
    for adapter, path in files.items():
        expected = expected_tensors(model, adapter)
        problems = mismatches(path, expected) if expected else [
            f"adapter {adapter!r} is not one of this PeftModel's {sorted(model.peft_config)}"]
        if problems:
            raise ValueError(f"{path} does not match this PeftModel's adapter {adapter!r}: "
                             + "; ".join(problems) + ". Resume with the PeftModel it was "
                             "trained as (the same base, LoraConfig and adapter names); "
                             "nothing was loaded")
        plan.append((path, expected))

    def load() -> None:
        for path, expected in plan:
            read: dict[int, tuple[TSPLoRA, dict[str, torch.Tensor]]] = {}
            with safe_open(path, "pt") as f:
                for key, (m, own, _) in expected.items():
                    read.setdefault(id(m), (m, {}))[1][own] = f.get_tensor(key)
            for m, tensors in read.values():  # the module's other adapters as they are
                m.load_full({**m.full_tensors(), **tensors})

    return load
