"""Host offload of checkpointed layer inputs (tsp_core.models.offload): exact on the CPU (where
the copies stay on the host, the same code path), refused without checkpointing on every rank
before any collective, and, measured under fake tensors, the device keeps the same activations
after the forward at 8 and at 16 layers while the host holds every layer's input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_grads_close
from tsp_core.distributed.model_state import model_state

LAYERS = hf_models.COMMON["num_hidden_layers"]


@pytest.fixture(scope="module")
def pool(pools):
    return pools.of(2)


def step(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), gather.full_grads(model)


def exact_with_offload(reentrant: bool) -> dict[str, int]:
    """TSP with checkpointing and offload against the same TSP model with checkpointing only:
    the same loss and gradients, bit for bit (on the CPU the inputs stay where they are); and
    against the unmodified model on one process to 1e-10."""
    mesh = dist_pool.mesh(2)
    ref = hf_models.build("llama", torch.float64)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)
    ckpt = {"use_reentrant": reentrant}
    plain = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
    offloaded = tsp_core.parallelize(copy.deepcopy(ref), mesh, activation_offload=True)
    offloaded.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
    plain.train()
    offloaded.train()
    want_loss, want = step(plain, batch)
    loss, got = step(offloaded, batch)
    # the backward used every input: nothing keeps them (on the GPU: pinned host buffers)
    last = model_state(offloaded).offload._last
    assert last is not None and last() is None, "the layer inputs outlive their backward"
    assert torch.equal(loss, want_loss), (loss.item(), want_loss.item())
    assert_grads_close(got, want, 1e-12, f"offload vs checkpointing only, rank {dist.get_rank()}")
    expected = hf_models.reference_loss(ref, ids, labels)
    expected.backward()
    rel = abs(loss.item() - expected.item()) / abs(expected.item())
    assert rel <= 1e-10, (loss.item(), expected.item())
    assert_grads_close(got, {n: p.grad for n, p in ref.named_parameters()}, 1e-10,
                       f"offload vs Hugging Face, rank {dist.get_rank()}")
    dist.barrier()
    return model_state(offloaded).offload.stats


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_exact_with_checkpointing(pool, reentrant):
    for stats in pool.run(exact_with_offload, reentrant):
        # one input per layer went to the host and came back, each but the last layer's (the
        # first the backward needs) started one layer ahead
        assert stats == {"offloaded": LAYERS, "brought_back": LAYERS, "prefetched": LAYERS - 1}


def refused_without_checkpointing() -> str:
    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64), mesh,
                                 activation_offload=True)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    with tsp_core.comm.track() as issued, pytest.raises(ValueError) as e:
        model(**batch)
    assert sum(issued.calls.values()) == 0, dict(issued.calls)  # raised before any collective
    with torch.no_grad():  # evaluation needs no checkpointing
        model(**batch)
    model.eval()
    model(**batch)
    dist.barrier()
    return str(e.value)


def test_refused_without_checkpointing_on_every_rank(pool):
    for msg in pool.run(refused_without_checkpointing):
        assert msg == (
            f"activation_offload moves each checkpointed decoder layer's saved input to host "
            f"memory, but none of this model's {LAYERS} decoder layers is checkpointed ({LAYERS} "
            f"in training mode, grad enabled): call model.activation_checkpointing_enable() "
            f"before training, or parallelize with activation_offload=False")


def deepspeed_switch() -> dict[str, bool]:
    """``tsp_deepspeed.initialize(..., activation_offload=True)`` (or the config's ``"tsp"``
    section) reaches parallelize; a model converted without offload, or with another tile, is
    refused. DeepSpeed's own engine is stubbed: what it builds is not what this checks
    (tests/integrations test it)."""
    import deepspeed

    import tsp_deepspeed

    real, seen = deepspeed.initialize, {}
    deepspeed.initialize = lambda **kwargs: kwargs
    try:
        for how, kwargs in (("argument", {"activation_offload": True}),
                            ("config", {"config": {"tsp": {"activation_offload": True}}}),
                            ("off", {})):
            model = hf_models.build("llama", torch.float64)
            tsp_deepspeed.initialize(model, tsp_size=2, **kwargs)
            seen[how] = model_state(model).offload is not None
        converted = tsp_core.parallelize(hf_models.build("llama", torch.float64),
                                         dist_pool.mesh(2))
        with pytest.raises(ValueError, match="already converted without it"):
            tsp_deepspeed.initialize(converted, activation_offload=True)
        with pytest.raises(ValueError, match=r"tile_tokens=5 was given, but the model was "
                                             r"already converted with tile_tokens \[None\]"):
            tsp_deepspeed.initialize(converted, tile_tokens=5)
    finally:
        deepspeed.initialize = real
    dist.barrier()
    return seen


def test_deepspeed_switch_reaches_parallelize(pool):
    pytest.importorskip("deepspeed")
    for seen in pool.run(deepspeed_switch):
        assert seen == {"argument": True, "config": True, "off": False}


# ---------------------------------------------------------------- memory, under fake tensors

HIDDEN, SEQ = 128, 2048


def kept_after_forward(layers: int, seq: int) -> dict[str, int]:
    """Bytes of activations on the simulated device and on the host (the meta device) after
    the forward of a Llama with ``layers`` checkpointed, offloaded layers at ``seq`` tokens,
    under fake tensors (float32), and one layer input's bytes. Offload does not depend on the
    parallel layout, so the unmodified model stands in for every layout (no process group)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaConfig, LlamaForCausalLM

    from tsp_core.models.offload import install_activation_offload

    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=seq)
    with FakeTensorMode():
        model = LlamaForCausalLM(config)
        install_activation_offload(model, list(model.model.layers))
        model.activation_checkpointing_enable()
        model.train()
        ids = torch.zeros(1, seq, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(input_ids=ids, labels=ids)
            snap = tracker.get_tracker_snapshot()
    act = {dev.type: int(v) for dev, kinds in snap.items() for k, v in kinds.items()
           if str(k) != "Total" and k.value == "Activation"}
    return {"device": act.get("cpu", 0), "host": act.get("meta", 0), "input": seq * HIDDEN * 4}


def offload_violations(seq: int) -> list[str]:
    """With offload, what stays on the device after the forward is the same at 8 and 16 layers,
    and the host holds exactly one layer input per layer."""
    runs = {layers: kept_after_forward(layers, seq) for layers in (8, 16)}
    bad = []
    if runs[8]["device"] != runs[16]["device"]:
        bad.append(f"S={seq}: device-kept activations {runs[8]['device']} bytes at 8 layers, "
                   f"{runs[16]['device']} at 16")
    for layers, r in runs.items():
        if r["host"] != layers * r["input"]:
            bad.append(f"S={seq}, {layers} layers: the host holds {r['host']} bytes, not "
                       f"{layers} layer inputs of {r['input']}")
    return bad


@pytest.mark.parametrize("seq", [SEQ, 4 * SEQ], ids=["S", "4S"])
def test_device_keeps_the_same_at_8_and_16_layers(seq):
    bad = offload_violations(seq)
    assert not bad, "\n".join(bad)
