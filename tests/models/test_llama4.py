"""Llama 4 text on packed rows. Its float64 training parity, generation and round trips run with
the other families (tests/support/hf_models.py FAMILIES: chunked attention, a NoPE layer with
attention temperature, the L2 q/k norm and an MoE layer, against a float64-faithful copy of
Hugging Face's float32 steps, tests/support/llama4_reference.py). Here: Hugging Face counts
chunks from each document's start on a packed row (transformers >= 5 remaps the chunked mask to
the restarting position_ids), and so does TSP: a packed row trains as its documents run alone;
the attention temperature instead counts positions across the row in Hugging Face, which a TSP
rank cannot give, so packed rows are refused on such a model, on every rank, by the input
check's one all-gather and before any other collective."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, gather, hf_models, parity
from tests.support.reference import assert_close
from tsp_core import comm

LENGTHS = [13, 4, 19]  # 36 tokens: documents straddle chunk boundaries of the row (chunk 5)


def _packed(vocab: int):
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return docs, torch.cat(docs)[None], labels, positions


def packed_chunks(tsp: int) -> None:
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("llama4_text", torch.float64)
    for layer in ref.model.layers:  # the temperature off: chunks are what is tested here
        layer.self_attn.attn_temperature_tuning = False
    assert ref.config.attention_chunk_size < min(n for n in LENGTHS if n > 5)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    docs, ids, labels, positions = _packed(ref.config.vocab_size)
    with torch.no_grad():  # Hugging Face's packed row (no cache: with one it ignores packing)
        packed = ref(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        assert_close(packed, alone, 1e-12, "HF packed row against its documents alone")
    total = sum(F.cross_entropy(ref(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum")
                for d in docs)
    loss_ref = total / sum(n - 1 for n in LENGTHS)
    loss_ref.backward()
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions},
                                 mesh)
    loss = model(**batch).loss
    assert abs(loss.item() - loss_ref.item()) <= 1e-10 * abs(loss_ref.item()), (loss, loss_ref)
    loss.backward()
    got = gather.full_grads(model)
    for name, p in ref.named_parameters():
        assert_close(got[name], p.grad, 1e-10, f"grad of {name}")
    dist.barrier()


def packed_temperature_refused(tsp: int) -> str:
    mesh = dist_pool.mesh(tsp)
    model = tsp_core.parallelize(hf_models.build("llama4_text", torch.float64), mesh)
    _, ids, labels, positions = _packed(model.config.vocab_size)
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions},
                                 mesh)
    with comm.track() as stats, pytest.raises(ValueError, match=r"packed rows .*Llama 4's "
                                              r"attn_temperature_tuning") as err:
        model(**batch)
    assert dict(stats.calls) == {"all_gather": 1}, dict(stats.calls)  # the input check's only
    assert f"row 0 holds 3 documents {[n for n in batch['tsp_docs'][0].tolist() if n]}" \
        in str(err.value)
    one = {k: v[:, :LENGTHS[0]] for k, v in (("input_ids", ids), ("labels", labels))}
    assert model(**tsp_core.shard_batch(one, mesh)).loss.isfinite()  # one document: runs
    dist.barrier()
    return str(err.value)


def one_moe_layer(ref, model) -> None:
    """The tiny Llama 4's MoE layers, and no other, became TSP's expert layers."""
    from tsp_core.layers.moe import TSPMoE

    moe = [m for m in model.modules() if isinstance(m, TSPMoE)]
    assert len(moe) == len(hf_models.LLAMA4_MOE_LAYERS), moe


def test_moe_ring_schedule(pools):
    """The MoE layer under the ring schedule (every expert's channels split, the slices travel;
    the family tests run the expert schedule): the loss, every gradient and every weight after
    one SGD step (tests/support/parity.py), at tsp 2."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, hf_models.build("llama4_text", torch.float64).config.vocab_size,
                        (2, 24), generator=gen)
    case = parity.Parity(partial(hf_models.build, "llama4_text", torch.float64), 2,
                         data=[(ids, ids)], options=dict(moe_schedule="ring"),
                         guard=one_moe_layer, name="llama4_text ring schedule")
    pools.of(2).run(parity.train_parity, case)


def test_training_parity_bf16_autocast(pools):
    """Float32 weights, forward and backward under bf16 autocast (chunked attention, the L2 q/k
    norm, the MoE layer under the expert schedule, the attention temperature): one SGD step
    against the unmodified model under the same autocast, within bf16's bounds
    (tests/support/parity.py compare_bf16: G = 9 u). Measured: 1.6 u."""
    case = parity.bf16_parity(partial(hf_models.build, "llama4_text", torch.float32), 2,
                              "llama4_text", guard=one_moe_layer)
    parity.assert_same_losses(pools.of(2).run(parity.train_parity, case))


@pytest.mark.parametrize("tsp", [2, 4])
def test_packed_rows_count_chunks_per_document(pools, tsp):
    pools.of(tsp).run(packed_chunks, tsp)


def test_packed_rows_refused_with_attention_temperature(pools):
    msgs = pools.of(2).run(packed_temperature_refused, 2)
    assert len({m.split(". This rank")[0] for m in msgs}) == 1, msgs  # every rank, one message
