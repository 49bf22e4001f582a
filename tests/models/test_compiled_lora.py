"""LoRA and QLoRA adapters in compiled layers (``parallelize(..., compile=...)`` of a PeftModel;
docs/lora.md, docs/design.md "Compiled layers"), at tsp 2 with the ``aot_eager`` backend, against
eager TSP from the same weights, on every rank: a PeftModel with LoRA r 4 on the seven
projections (A and B random) over a Llama with one key/value head in float64, and over the same
kind of Llama loaded 4-bit NF4 by bitsandbytes (float32 compute). 3 SGD steps of the adapters:
each step's loss, the adapters' first gradients, the collectives (bytes and order) and the host's
issues and waits of them bit for bit; no graph break; two graphs, unchanged after the first step
(the first layer's input needs no gradient under the frozen embedding, the later layers' does);
the base's loss under ``disable_adapter()`` equal. The float64 LoRA run's losses and first
adapter gradients against the unmodified PeftModel on one process, to 1e-10. The suite runs the
LoRA case; the QLoRA case is run by hand (its parameter below)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import test_compiled, test_qlora
from tests.support import dist_pool, hf_models, parity
from tests.support.reference import relative_error

pytest.importorskip("bitsandbytes")

STEPS = 3


def lora_model():
    """The zoo's Llama with one key/value head in float64 under PEFT's LoRA r 4 on the seven
    projections, B drawn at random too (PEFT starts it at zero: no adapter term to check)."""
    from peft import LoraConfig, get_peft_model

    base = hf_models.build("llama", torch.float64, kv_heads=1)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=test_qlora.ALL, lora_dropout=0.0,
                        init_lora_weights=False)
    return get_peft_model(base, config).train()


def _train(model, mesh, data) -> dict:
    """SGD (lr 0.5) on the adapters: each step's loss, collectives, issues and waits and
    compiled-graph count, the first step's adapter gradients (this rank's), and the loss with
    the adapters disabled afterwards."""
    import torch._dynamo as dynamo

    import tsp_core
    from tsp_core import comm

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    rec = dict(losses=[], logs=[], schedules=[], graphs=[], grads0=None)
    for ids, labels in data:
        batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)
        with comm.track() as stats, test_compiled._schedule() as events:
            loss = model(**batch).loss
            loss.backward()
        rec["logs"].append(stats.log)
        rec["schedules"].append(events)
        rec["graphs"].append(dynamo.utils.counters["stats"]["unique_graphs"])
        if rec["grads0"] is None:
            rec["grads0"] = test_qlora.grads(model)
        opt.step()
        opt.zero_grad()
        rec["losses"].append(loss.item())
    ids, labels = data[0]
    with model.disable_adapter():
        rec["base_loss"] = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels},
                                                        mesh)).loss.item()
    return rec


def _reference(ref, data) -> dict:
    """The unmodified PeftModel on one process, the whole batch, its loss from its logits."""
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    losses, grads0 = [], None
    for ids, labels in data:
        loss = hf_models.reference_loss(ref, ids, labels)
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grads0=grads0)


def _fresh(ref, path: str):
    """A copy of the LoRA model ``ref``, or (None) the QLoRA model loaded afresh from ``path``."""
    return copy.deepcopy(ref) if ref is not None else test_qlora.qlora_model(path)


def adapters_compiled_and_eager(kind: str, path: str) -> dict:
    """Run on every rank: for LoRA (float64) or QLoRA (float32, the base saved at ``path``),
    the eager and the compiled records with the compiled run's graph breaks; for LoRA the
    one-process reference too."""
    import torch._dynamo as dynamo

    import tsp_core

    mesh = dist_pool.mesh(2)
    ref = lora_model() if kind == "lora" else None
    vocab = test_qlora.SMALL["vocab_size"] if ref is None else ref.config.vocab_size
    data = parity.batches(vocab, 2, 16, STEPS)
    eager = _train(tsp_core.parallelize(_fresh(ref, path), mesh), mesh, data)
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = _train(tsp_core.parallelize(_fresh(ref, path), mesh, compile="aot_eager"), mesh,
                      data)
    breaks = dict(dynamo.utils.counters["graph_break"])
    dynamo.reset()
    return dict(eager=eager, compiled=compiled, breaks=breaks,
                want=_reference(ref, data) if ref is not None else None)


def _check(rank: int, kind: str, res: dict) -> None:
    eager, compiled, what = res["eager"], res["compiled"], f"{kind} rank {rank}"
    assert res["breaks"] == {}, f"{what}: graph breaks {res['breaks']}"
    assert compiled["graphs"] == [2] * STEPS, f"{what}: compiled graphs {compiled['graphs']}"
    assert compiled["losses"] == eager["losses"], (what, compiled["losses"], eager["losses"])
    assert compiled["base_loss"] == eager["base_loss"], what
    assert compiled["logs"] == eager["logs"] and len(eager["logs"][0]) > 0, what
    assert compiled["schedules"] == eager["schedules"], f"{what}: issues and waits differ"
    assert compiled["grads0"].keys() == eager["grads0"].keys() and eager["grads0"], what
    for name, g in eager["grads0"].items():
        assert torch.equal(compiled["grads0"][name], g), f"{what}: gradient of {name} differs"
    want = res["want"]
    if want is None:
        return
    for step, (a, b) in enumerate(zip(compiled["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= 1e-10 * abs(b), f"{what} step {step}: loss {a!r} vs one process {b!r}"
    for name, g in want["grads0"].items():
        err = relative_error(compiled["grads0"][name], g)
        assert err <= 1e-10, f"{what}: gradient of {name} off the one process's by {err:.2e}"


# "qlora" runs by hand (test_adapters_in_compiled_layers_match_eager(pools, tmp_path, "qlora"):
# its compile costs the suite about half a minute more; the LoRA layers are the same)
@pytest.mark.parametrize("kind", ["lora"])
def test_adapters_in_compiled_layers_match_eager(pools, tmp_path, kind):
    if kind == "qlora":
        test_qlora.save_base(str(tmp_path), test_qlora.SMALL)
    for rank, res in enumerate(pools.of(2).run(adapters_compiled_and_eager, kind,
                                               str(tmp_path))):
        _check(rank, kind, res)
