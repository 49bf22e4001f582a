"""Rotary embeddings whose frequencies depend on the sequence length (Hugging Face's dynamic NTK and
longrope): under TSP every rank rotates with the frequencies of the global length, so loss, every
gradient, the rotary's state (dynamic NTK grows and resets) and greedy generation equal the
unmodified model on one process, at tsp 2 and 4, for sequences below, around and far above the
original context; a batch without the global length raises on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close
from tsp_core import comm
from tsp_core.distributed.model_state import find_model_state
from tsp_core.layers import rope

ORIGINAL = 20  # the original context: dynamic's max_position_embeddings, longrope's original_...
# 3x the context; 0.5x right after it (dynamic NTK resets); 19: padded to 24 at tsp 4, so a rank's
# local positions reach past the context while the sequence does not; 24: the ranks holding only
# middle chunks see positions below the context while the sequence is above it
LENGTHS = (60, 10, 19, 24)


def build(kind: str, seed: int = 0):
    """``kind``: "dynamic" or "longrope" (Llama), or "phi3-longrope" (Phi-3, whose generate
    recomputes the KV cache once the sequence first passes the original context)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    half = 8  # head_dim 16
    if kind == "dynamic":
        params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        max_pos = ORIGINAL
    else:
        params = {"rope_type": "longrope", "rope_theta": 10000.0,
                  "short_factor": [1.0 + 0.1 * i for i in range(half)],
                  "long_factor": [1.0 + 0.7 * i for i in range(half)],
                  "original_max_position_embeddings": ORIGINAL}
        max_pos = 4 * ORIGINAL
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 max_position_embeddings=max_pos)
    torch.manual_seed(seed)
    if kind == "phi3-longrope":
        params.pop("original_max_position_embeddings")
        config = Phi3Config(**shape, rope_parameters=params,
                            original_max_position_embeddings=ORIGINAL,
                            pad_token_id=0, eos_token_id=2)
        return Phi3ForCausalLM(config).to(torch.float64)
    return LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=params)).to(torch.float64)


def rotary_state(model) -> tuple:
    r = model.model.rotary_emb
    return r.inv_freq.clone(), getattr(r, "max_seq_len_cached", None), r.attention_scaling


def training_parity(kind: str, tsp: int) -> list[float]:
    """Loss and every gradient (full shapes) to 1e-10 against one process, batch after batch."""
    mesh = dist_pool.mesh(tsp)
    ref = build(kind)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for seq in LENGTHS:
        ids = torch.randint(0, 96, (2, seq), generator=gen)
        labels = ids.clone()
        labels[0, :2] = -100
        ref.zero_grad()
        model.zero_grad()
        want = hf_models.reference_loss(ref, ids, labels)
        want.backward()
        batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)
        assert batch["tsp_rope_len"].tolist() == [seq, seq]
        got = model(**batch).loss
        got.backward()
        rel = abs(got.item() - want.item()) / abs(want.item())
        assert rel <= 1e-10, f"{kind} D={tsp} seq {seq}: loss {got.item()!r} vs {want.item()!r}"
        grads, ref_grads = gather.full_grads(model), gather.full_grads(ref)
        assert sorted(grads) == sorted(ref_grads)
        for name, g in ref_grads.items():
            assert_close(grads[name], g, 1e-10, f"{kind} D={tsp} seq {seq}: grad of {name}")
        for a, b in zip(rotary_state(model), rotary_state(ref)):  # dynamic NTK's state
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), (kind, seq, a, b)
        losses.append(got.item())
    dist.barrier()
    return losses


@pytest.mark.parametrize("tsp", [2, 4])
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_training_matches_one_process(pools, kind, tsp):
    losses = pools.of(tsp).run(training_parity, kind, tsp)
    assert all(r == losses[0] for r in losses)


# dp 2 x tsp 2, packed rows: each data-parallel replica's two rows (one length) per step. Step 1:
# replica 0 holds a document at 2.25x the context (tsp 2 pads it to 48: rank 0's positions reach
# 47, rank 1's 35); replica 1's longest document is 19, below the context, in rows of 32 tokens
# (the row length is past it). Step 2: dynamic NTK resets on replica 0 (one unpacked row) and
# grows on replica 1, whose longest document (24) is past the context while its rank 1's
# positions (the middle chunks) stay below it (up to 17)
PACKED_STEPS = (([[45, 7], [9, 30, 13]], [[19, 13], [6, 10, 16]]),
                ([[16], [4, 12]], [[24, 9], [11, 22]]))


def packed_rows(docs: list[list[int]], seed: int) -> dict[str, torch.Tensor]:
    """Rows of documents of these lengths: ids, labels with -100 on each document's first token
    (DataCollatorWithFlattening's convention) and positions that restart at each document."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (len(docs), sum(docs[0])), generator=gen)
    labels = ids.clone()
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    labels[positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def packed_reference_sum(ref, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The unmodified model on packed rows (no mask, no cache: transformers then keeps the
    documents apart by their restarting positions, and its rope sees max(position_ids) + 1):
    the summed cross-entropy (in float64) and the count of predicted tokens."""
    logits = ref(input_ids=rows["input_ids"], position_ids=rows["position_ids"],
                 use_cache=False).logits
    shifted = F.pad(rows["labels"], (0, 1), value=-100)[:, 1:]
    return (F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100,
                            reduction="sum"), int((shifted != -100).sum()))


def packed_data_parallel_parity(kind: str) -> list[float]:
    """Each data-parallel replica rotates with its own batch's longest document, as the unmodified
    model does on that batch (under DDP too), never with a rank's local or padded length or the
    row length: loss, every gradient (summed over the replicas) to 1e-10 and each replica's
    rotary state equal to the unmodified model's on that replica's rows, step after step.
    Replica 0 gives its packing as position_ids in step 1, replica 1 as cu_seqlens (then the
    other way round)."""
    mesh = dist_pool.mesh(2)
    assert mesh.dp_size == 2, mesh.dp_size
    replica = dist.get_rank() // mesh.size
    refs = [build(kind), build(kind)]  # one per replica: dynamic NTK's state follows its batches
    model = tsp_core.parallelize(copy.deepcopy(refs[0]), mesh)
    losses = []
    for step, per_replica in enumerate(PACKED_STEPS):
        rows = [packed_rows(docs, seed=10 * step + k) for k, docs in enumerate(per_replica)]
        for m in (model, *refs):
            m.zero_grad()
        sums = [packed_reference_sum(ref, r) for ref, r in zip(refs, rows)]
        want = sum(s for s, _ in sums) / sum(n for _, n in sums)
        want.backward()
        mine = dict(rows[replica])
        if (step + replica) % 2:
            del mine["position_ids"]
            mine["cu_seqlens"] = [torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()])
                                  for row in per_replica[replica]]
        batch = tsp_core.shard_batch(mine, mesh)
        longest = [max(row) for row in per_replica[replica]]
        assert batch["tsp_rope_len"].tolist() == longest, (batch["tsp_rope_len"], longest)
        got = model(**batch).loss
        got.backward()
        what = f"{kind} step {step} replica {replica}"
        rel = abs(got.item() - want.item()) / abs(want.item())
        assert rel <= 1e-10, f"{what}: loss {got.item()!r} vs {want.item()!r}"
        grads = gather.full_grads(model)
        assert sorted(grads) == sorted(n for n, _ in refs[0].named_parameters())
        for (name, a), b in zip(refs[0].named_parameters(), refs[1].parameters()):
            assert_close(grads[name], a.grad + b.grad, 1e-10, f"{what}: grad of {name}")
        for a, b in zip(rotary_state(model), rotary_state(refs[replica])):
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), (what, a, b)
        losses.append(got.item())
    dist.barrier()
    return losses


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_packed_rows_with_data_parallel_match_one_process(pools, kind):
    losses = pools.of(4).run(packed_data_parallel_parity, kind)
    assert all(r == losses[0] for r in losses)


def generation_parity(kind: str, tsp: int) -> list[list[int]]:
    """Greedy tokens identical to Hugging Face's generate and each step's logits equal (float32,
    as generate returns them), for prompts below the context that grow past it while decoding and
    prompts already past it; the rotary state after generating is the same too."""
    from tests.inference.test_decode import left_padded

    mesh = dist_pool.mesh(tsp)
    ref = build(kind)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    out = []
    for lengths in ([7, 19], [9, 30]):  # 19: padded to 24 at tsp 4, past the context
        ids, mask = left_padded(96, lengths)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, output_logits=True,
                             return_dict_in_generate=True)
        assert torch.equal(got.sequences, want.sequences), (kind, tsp, lengths)
        for t, (a, b) in enumerate(zip(got.logits, want.logits)):
            assert_close(a, b, 1e-6, f"{kind} D={tsp} prompts {lengths} step {t} logits")
        for a, b in zip(rotary_state(model), rotary_state(ref)):
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), (kind, lengths, a, b)
        out.append(got.sequences.tolist())
    return out


@pytest.mark.parametrize("tsp", [2, 4])
def test_greedy_generation_matches_hf(pools, tsp):
    for kind in ("dynamic", "longrope", "phi3-longrope"):
        outs = pools.of(tsp).run(generation_parity, kind, tsp)
        assert all(o == outs[0] for o in outs)


def missing_length() -> list[str]:
    """A batch without tsp_rope_len (built by hand, or on one rank only) raises on every rank after
    the one agreed all-gather, before any schedule collective."""
    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(build("dynamic"), mesh)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    msgs = []
    for drop_on in ([0, 1], [1]):
        local = {k: v for k, v in batch.items() if k != "tsp_rope_len" or mesh.rank not in drop_on}
        with comm.track() as stats, pytest.raises(ValueError, match="tsp_rope_len") as info:
            model(**local)
        assert dict(stats.calls) == {"all_gather": 1}, dict(stats.calls)
        msgs.append(str(info.value).split(". This rank")[0])
    assert "TSP rank(s) [0, 1]: no tsp_rope_len, which this model's rotary embedding (dynamic" \
        in msgs[0], msgs[0]
    assert "TSP rank(s) [1]: no tsp_rope_len" in msgs[1], msgs[1]
    with pytest.raises(ValueError, match="computes its frequencies from the sequence length"):
        model.model.rotary_emb(torch.zeros(1, 4, 64), torch.arange(4)[None])
    # a length-dependent rope that does not update through transformers' dynamic_rope_update
    other = build("dynamic")
    plain = type(other.model.rotary_emb).forward.__wrapped__
    other.model.rotary_emb.__class__ = type("Custom", (type(other.model.rotary_emb),),
                                            {"forward": plain})
    with pytest.raises(NotImplementedError, match="not transformers' dynamic_rope_update"):
        tsp_core.parallelize(other, mesh)
    assert find_model_state(other) is None
    model.zero_grad()
    model(**batch).loss.backward()  # the group is still in step
    return msgs


def test_missing_length_raises_on_every_rank(pools):
    msgs = pools.of(2).run(missing_length)
    assert msgs[0] == msgs[1]


def test_per_layer_type_rope_uses_the_global_length():
    """A rotary with one rope per layer type (Gemma 3: dynamic on full attention, default on
    sliding layers): each rank's part of the positions rotated under global_length equals the
    one-process rotation of the whole sequence, and the state is the same, also after a reset."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=ORIGINAL,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                            "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    ref = Gemma3RotaryEmbedding(config)
    ranks = [copy.deepcopy(ref) for _ in range(4)]  # one per rank of a tsp 4 group: own state
    for mine in ranks:
        assert rope.length_dependent_rotaries(mine) == [mine]
        rope.use_global_length([mine])
    x = torch.zeros(1, 1, 32, dtype=torch.float64)
    for seq in (60, 10, 24):
        full = torch.arange(seq)[None]
        for layer_type in ("full_attention", "sliding_attention"):
            want = ref(x, full, layer_type)
            for rank, mine in enumerate(ranks):
                pos = tsp_core.layout.position_ids(-(-seq // 8) * 8, rank, 4)
                pos = pos[pos < seq][None]
                with rope.global_length([mine], seq):
                    got = mine(x, pos, layer_type)
                for g, w in zip(got, want):
                    assert torch.equal(g, w[:, pos[0]]), (seq, layer_type, rank)
                assert torch.equal(mine.full_attention_inv_freq, ref.full_attention_inv_freq)


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_interleaved_rope_is_glm4s_forward_and_backward(rotary_dim):
    """``rope.apply(..., interleaved=True)`` equals GLM-4's ``apply_rotary_pos_emb`` (channel pairs
    (2i, 2i+1), partial and full rotary) in float64, and ``apply_backward`` is its gradient."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    pos = torch.arange(5)[None].expand(2, -1)
    cos, sin = rope.cos_sin(pos, rope.default_inv_freq(rotary_dim), 1.0, torch.float64)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = rope.apply(q, cos, sin, interleaved=True)
    assert_close(got, want, 1e-12, "forward")
    assert not torch.allclose(rope.apply(q, cos, sin), want)  # the half-split convention differs
    g = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    (want_grad,) = torch.autograd.grad(want, q, g)
    assert_close(rope.apply_backward(g, cos, sin, interleaved=True), want_grad, 1e-12, "backward")


# ------------------------------------------------------- the rotation's precision (float32 island)

def float32_island(family: str, tsp: int) -> int:
    """One bf16 training step of a tiny ``family`` (Ernie 4.5, OLMo 2: their rotary embedding
    returns float32 cos/sin and their ``apply_rotary_pos_emb`` rotates bf16 q and k in float32,
    then rounds) under TSP at ``tsp``: every rotation TSP computes (rope.apply; rope.apply_backward
    where the schedule calls it) equals, bit for bit, Hugging Face's own function on the same
    input with the cos/sin of Hugging Face's rotary embedding at the rank's positions (its
    backward by autograd through that function). Returns the rotations compared."""
    import importlib

    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build(family, torch.bfloat16)
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf_apply = getattr(hf.apply_rotary_pos_emb, "hf_original", hf.apply_rotary_pos_emb)
    model = tsp_core.parallelize(ref, mesh)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 16), generator=gen)
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    cos, sin = model.model.rotary_emb(torch.ones(1, dtype=torch.bfloat16), batch["position_ids"])
    assert cos.dtype == torch.float32  # Hugging Face's float32 island

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return hf_apply(t, t, cos, sin)[0]

    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    forward, backward = rope.apply, rope.apply_backward

    def apply(x, *args, **kwargs):
        out = forward(x, *args, **kwargs)
        calls.append(("apply", x.detach(), out.detach()))
        return out

    def apply_backward(g, *args, **kwargs):
        out = backward(g, *args, **kwargs)
        calls.append(("apply_backward", g, out))
        return out

    rope.apply, rope.apply_backward = apply, apply_backward
    try:
        model(**batch).loss.backward()
    finally:
        rope.apply, rope.apply_backward = forward, backward
    for i, (name, x, got) in enumerate(calls):
        assert got.dtype == torch.bfloat16, (name, got.dtype)
        if name == "apply":
            want = rotate(x)
        else:
            leaf = torch.zeros_like(x, requires_grad=True)
            (want,) = torch.autograd.grad(rotate(leaf), leaf, x)
        diff = (got.float() - want.float()).abs().max().item()
        assert torch.equal(got, want), f"{family} tsp {tsp} call {i} ({name}): off by {diff:.3g}"
    assert calls and all(n == "apply" for n, *_ in calls[:2])
    dist.barrier()
    return len(calls)


@pytest.mark.parametrize("family,tsp", [("ernie4_5", 1), ("ernie4_5", 2), ("olmo2", 2)])
def test_bf16_rotation_is_hugging_faces_float32_island(pools, family, tsp):
    counts = pools.of(tsp).run(float32_island, family, tsp)
    assert min(counts) > 0, counts
