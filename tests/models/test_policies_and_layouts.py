"""Whole models in float64 on 4 processes against one process (1e-10): a custom ``DecoderPolicy``
passed to ``parallelize`` (its module names and sliding window are the ones used), the contiguous
token layout on a whole causal model, and gradient accumulation in a plain loop (2 micro-batches
give the gradients of the one batch they make up). In one process: ``register_policy`` refuses a
name already registered unless told to replace it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close
from tsp_core.models.policies import AttentionPolicy, DecoderPolicy, ModuleNames


def batch(rows: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[0, : 2 + seed] = -100   # each batch ignores a different number of tokens
    return ids, labels


def loss_sum(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unmodified model's summed token loss, taken from its logits in float64."""
    logits = model(input_ids=ids).logits
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="sum")


def assert_grads(model, ref, tol: float = 1e-10) -> None:
    got = gather.full_grads(model)
    for name, p in ref.named_parameters():
        assert_close(got[name], p.grad, tol, f"grad of {name}")


def custom_policy() -> None:
    # Llama under other names (backbone, output) with a sliding window of 5 for every layer: the
    # policy's names and window must be the ones used, so the TSP model is Mistral (window 5)
    # with Llama's weights, not Llama; dp 2 x tsp 2, each replica its rows
    from transformers import MistralConfig, MistralForCausalLM

    mesh = dist_pool.mesh(2)
    llama = hf_models.build("llama", torch.float64)
    ref = MistralForCausalLM(MistralConfig(vocab_size=96, sliding_window=5, **hf_models.COMMON))
    ref = ref.to(torch.float64)
    ref.load_state_dict(llama.state_dict())
    model = copy.deepcopy(llama)
    model.add_module("backbone", model.model)
    model.add_module("output", model.lm_head)
    del model.model, model.lm_head
    policy = DecoderPolicy(name="renamed-llama", model_types=(),
                           modules=ModuleNames(base_model="backbone", lm_head="output"),
                           attn=AttentionPolicy(sliding_window=lambda config, attention: 5))
    model = tsp_core.parallelize(model, mesh, policy=policy)
    ids, labels = batch(4, 24, 96, seed=1)
    replica = mesh.device_mesh.get_coordinate()[0]
    mine = slice(2 * replica, 2 * replica + 2)
    sharded = tsp_core.shard_batch({"input_ids": ids[mine], "labels": labels[mine]}, mesh)
    loss = model(**sharded).loss
    expected = loss_sum(ref, ids, labels) / (labels[:, 1:] != -100).sum()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item(), (loss, expected)
    plain = loss_sum(llama, ids, labels) / (labels[:, 1:] != -100).sum()
    assert abs(plain.item() - expected.item()) > 1e-4, "the window must change the loss"
    expected.backward()
    loss.backward()
    renamed = {("model." + n[len("backbone."):] if n.startswith("backbone.") else
                "lm_head." + n[len("output."):] if n.startswith("output.") else n): g
               for n, g in gather.full_grads(model).items()}
    for name, p in ref.named_parameters():
        assert_close(renamed[name], p.grad, 1e-10, f"grad of {name}")


def contiguous_layout() -> None:
    # rank p holds the p-th quarter of the (padded) sequence; causal attention is exact, only the
    # work is unbalanced (zigzag is the default for that reason). 30 tokens pad to 32 at D=4.
    mesh = dist_pool.mesh(4, "contiguous")
    ref = hf_models.build("llama", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, labels = batch(2, 30, 96, seed=2)
    sharded = tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)
    r = mesh.rank
    assert torch.equal(sharded["position_ids"][0], torch.arange(8 * r, 8 * r + 8))
    loss = model(**sharded).loss
    expected = loss_sum(ref, ids, labels) / (labels[:, 1:] != -100).sum()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item(), (loss, expected)
    expected.backward()
    loss.backward()
    assert_grads(model, ref)
    with torch.no_grad():
        logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
        full = F.pad(ref(input_ids=ids).logits, (0, 0, 0, 2))   # padded positions: not compared
    keep = slice(0, 8) if r < 3 else slice(0, 6)
    assert_close(logits[:, keep], full[:, 8 * r:8 * r + 8][:, keep], 1e-10, "logits")


def gradient_accumulation() -> None:
    # dp 2 x tsp 2: each replica takes 2 micro-batches of 1 row; num_items_in_batch is the
    # non-ignored token count of the whole global batch, so the accumulated gradients are those
    # of one process on all 4 rows, whatever each micro-batch ignores
    mesh = dist_pool.mesh(2)
    replica = mesh.device_mesh.get_coordinate()[0]
    ref = hf_models.build("llama", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, labels = batch(4, 20, 96, seed=3)
    labels[3, 5:9] = -100
    count = int((labels[:, 1:] != -100).sum())
    expected = loss_sum(ref, ids, labels) / count
    expected.backward()
    total = 0.0
    for micro in range(2):
        row = slice(2 * replica + micro, 2 * replica + micro + 1)
        loss = model(**tsp_core.shard_batch({"input_ids": ids[row], "labels": labels[row]}, mesh),
                     num_items_in_batch=count).loss
        loss.backward()
        total += loss.item()
    assert abs(total - expected.item()) <= 1e-10 * expected.item(), (total, expected)
    assert_grads(model, ref)


def test_register_policy_refuses_a_duplicate_name():
    # a second policy under a registered name would silently change every model that finds it:
    # refused, naming the policy and how to replace it on purpose; replace=True replaces it
    from tsp_core.models.policies import base, register_policy, supported
    from tsp_core.models.policies.llama import POLICY as LLAMA

    before = supported()
    with pytest.raises(ValueError, match=r"^a policy named 'llama' is already registered; "
                                         r"register_policy\(policy, replace=True\) replaces it "
                                         r"on purpose, or give the new policy another name$"):
        register_policy(DecoderPolicy(name="llama", model_types=("llama",)))
    assert base._POLICIES["llama"] is LLAMA and supported() == before
    renamed = dataclasses.replace(LLAMA, modules=ModuleNames(base_model="backbone"))
    try:
        assert register_policy(renamed, replace=True) is renamed
        assert base._POLICIES["llama"] is renamed and supported() == before
    finally:
        register_policy(LLAMA, replace=True)  # the registry as it was, for the other tests
    assert base._POLICIES["llama"] is LLAMA


def test_custom_policy(pools):
    pools.of(4).run(custom_policy)


def test_contiguous_layout_whole_model(pools):
    pools.of(4).run(contiguous_layout)


def test_gradient_accumulation_plain_loop(pools):
    pools.of(4).run(gradient_accumulation)
