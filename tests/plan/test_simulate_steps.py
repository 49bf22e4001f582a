"""``tsp simulate --step grpo`` and ``--lora R``: their accounting on the tiny model under fake
tensors.

The GRPO step must add to the plain step exactly what GRPO keeps: the reference model's
parameters (laid out like the policy: 1/D of them under TSP) and the per-token log-probabilities
its no-grad forward leaves, never a gradient or an optimizer state for the reference. A LoRA
step must hold gradients and AdamW moments for the adapters alone, whose parameters are
r x (in + out) per adapted projection. A QLoRA step (``--qlora``) must hold the base's seven
projections as NF4 shards, elements / 2 + 4 x elements / 64 bytes per rank, in place of their bf16
bytes, and refuse what QLoRA training refuses.
"""

from __future__ import annotations

import pytest

from tests.support.simulations import simulate_all
from tsp_core.plan.simulate import SimulationRequest

D, BATCH, SEQ = 4, 8, 256


RANK = 8
# QLoRA's pair: "small" (heads of 32) cut to one layer, whose o_proj shard at D = 4 is one NF4
# block of 64 columns wide (tiny's, 16 wide, is refused: test_qlora_is_refused...)
QLORA = dict(model="small", layers=1)


def request(layout: str, degree: int, step: str) -> SimulationRequest:
    if step in ("lora-small", "qlora"):
        return SimulationRequest(layout, degree, 1, SEQ, recompute="full", lora=RANK,
                                 qlora=step == "qlora", **QLORA)
    lora = RANK if step == "lora" else None
    return SimulationRequest(layout, degree, 1, SEQ, "tiny", batch=BATCH, recompute="full",
                             step="train" if lora else step, lora=lora)


@pytest.fixture(scope="module")
def records(simulations) -> dict[tuple[str, int, str], object]:
    """Plain and GRPO steps of tsp and tp-sp at D = 4, the unsplit model (tp at D = 1), a LoRA
    step of tsp at D = 4, and LoRA and QLoRA steps of :data:`QLORA` at D = 4."""
    keys = [(layout, degree, step) for layout, degree in (("tsp", D), ("tp-sp", D), ("tp", 1))
            for step in ("train", "grpo")] + [("tsp", D, s) for s in ("lora", "lora-small",
                                                                       "qlora")]
    got = simulate_all(simulations, [request(*k) for k in keys])
    return dict(zip(keys, got))


@pytest.mark.parametrize("layout", ["tsp", "tp-sp"])
def test_grpo_adds_the_reference_parameters_and_nothing_to_train(records, layout):
    train, grpo = records[(layout, D, "train")], records[(layout, D, "grpo")]
    # the reference is laid out like the policy: the same bytes per rank
    assert grpo.reference_bytes == train.breakdown["parameters"], (
        f"{layout}: reference {grpo.reference_bytes} B vs the policy's "
        f"{train.breakdown['parameters']} B")
    assert grpo.breakdown["parameters"] == train.breakdown["parameters"] + grpo.reference_bytes
    # no optimizer state for the reference, and never more gradient than the policy's
    assert grpo.breakdown["optimizer_states"] == train.breakdown["optimizer_states"]
    assert grpo.phases["end"]["gradients"] == train.phases["end"]["gradients"]
    # the peak moves by the reference's parameters plus the per-token float32 log-probabilities
    # and GRPO's per-token terms (a few [batch, tokens] float32 tensors), nothing of its forward
    extra = grpo.peak_bytes - train.peak_bytes - grpo.reference_bytes
    per_token = BATCH * SEQ * 4
    assert 0 <= extra <= 4 * per_token, (
        f"{layout}: GRPO peak {grpo.peak_bytes} B = plain {train.peak_bytes} B + reference "
        f"{grpo.reference_bytes} B + {extra} B, more than 4 x {per_token} B of per-token terms")


def test_reference_is_one_dth_of_the_model_under_tsp(records):
    whole = records[("tp", 1, "grpo")].reference_bytes  # the unsplit model's parameters
    ref = records[("tsp", D, "grpo")].reference_bytes
    # the norms are replicated: a sliver over 1/D
    assert whole / D <= ref <= whole / D * 1.01, f"tsp reference {ref} B vs {whole} B / {D}"


def test_rollout_is_resident_state_plus_the_kv_cache(records):
    rec = records[("tsp", D, "grpo")]
    # tiny: 2 layers, 4 key/value heads of 16, bf16; TSP keeps 1/D of the tokens
    kv = 2 * 2 * 4 * 16 * BATCH * SEQ * 2 // D
    b = rec.breakdown
    resident = b["parameters"] + b.get("buffers", 0) + b["optimizer_states"]
    assert rec.rollout_bytes == resident + kv
    assert records[("tsp", D, "train")].rollout_bytes == 0


def test_grpo_with_fsdp2_is_refused():
    from tsp_core.plan.simulate import check_request

    req = SimulationRequest("tsp", D, 1, SEQ, "tiny", step="grpo", dp_shard=2)
    with pytest.raises(ValueError, match=r"dp_shard \(2\) must be 1"):
        check_request(req)


def adapter_bytes(rank: int) -> int:
    """LoRA's float32 A and B on the tiny model's seven projections: r x (in + out) each."""
    from tsp_core.plan.simulate import model_config

    c = model_config("tiny")
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    return c.num_hidden_layers * sum(rank * (a + b) for a, b in shapes) * 4


def test_lora_trains_the_adapters_alone(records):
    full, lora = records[("tsp", D, "train")], records[("tsp", D, "lora")]
    adapters = adapter_bytes(RANK)
    assert lora.trainable_bytes == adapters, f"{lora.trainable_bytes} B vs {adapters} B computed"
    # the base shard as in full fine-tuning, plus the replicated adapters
    assert lora.breakdown["parameters"] == full.breakdown["parameters"] + adapters
    # gradients: the adapters' only, none of the base
    assert lora.phases["end"]["gradients"] == adapters, lora.phases["end"]
    # AdamW: two moments of the adapters, plus one 4-byte step count per adapter tensor
    tensors = 2 * 7 * 2  # layers x projections x (A, B)
    assert lora.breakdown["optimizer_states"] == 2 * adapters + 4 * tensors


def test_lora_is_refused_where_a_layout_cannot_take_a_peft_model():
    from tsp_core.plan.simulate import check_request

    with pytest.raises(ValueError, match=r"lora \(r=8\) is simulated for tsp only, not tp-sp"):
        check_request(SimulationRequest("tp-sp", D, 1, SEQ, "tiny", lora=8))


def base_elements_per_rank() -> int:
    """The seven projections' weights of :data:`QLORA` that one rank's shards hold: 1/D."""
    from tsp_core.plan.simulate import model_config

    c = model_config(QLORA["model"], QLORA["layers"])
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i  # q o, k v, gate up down
    return c.num_hidden_layers * per_layer // D


def test_qlora_holds_the_base_in_nf4(records):
    lora, qlora = records[("tsp", D, "lora-small")], records[("tsp", D, "qlora")]
    elements = base_elements_per_rank()
    nf4 = elements // 2 + 4 * elements // 64  # two codes a byte, a float32 absmax per 64
    # the bf16 shards are gone from the parameters; the packed shards and absmax are buffers
    assert lora.breakdown["parameters"] - qlora.breakdown["parameters"] == 2 * elements
    assert qlora.breakdown["buffers"] - lora.breakdown["buffers"] == nf4, (
        f"NF4 base {qlora.breakdown['buffers'] - lora.breakdown['buffers']} B vs {nf4} B "
        f"computed for {elements} weights")
    # the adapters train as under LoRA: their gradients and AdamW moments alone
    assert qlora.trainable_bytes == lora.trainable_bytes
    for kind in ("gradients", "optimizer_states"):
        assert qlora.breakdown[kind] == lora.breakdown[kind], kind
    # the peak falls by at least what the resident base no longer holds (the rounds' packed
    # buffers are smaller too)
    assert qlora.peak_bytes <= lora.peak_bytes - (2 * elements - nf4), (
        f"QLoRA peak {qlora.peak_bytes} B vs LoRA's {lora.peak_bytes} B - {2 * elements - nf4}")
    assert qlora.qlora and not lora.qlora


def test_qlora_is_refused_without_lora_and_where_training_refuses_it(simulations):
    from tsp_core.plan.simulate import check_request

    with pytest.raises(ValueError, match=r"give the adapters' rank too \(--lora R"):
        check_request(SimulationRequest("tsp", D, 1, SEQ, "tiny", qlora=True))
    # tiny's o_proj at D = 4: one head's 16 columns, no whole NF4 block, as parallelize refuses
    tiny = SimulationRequest("tsp", D, 1, SEQ, "tiny", recompute="full", lora=RANK, qlora=True)
    with pytest.raises(ValueError, match=r"qlora: .*o_proj at tsp_size 4, rank 0: this rank's "
                                         r"shard, columns \[0, 16\) .* whole NF4 blocks of 64"):
        simulate_all(simulations, [tiny])
