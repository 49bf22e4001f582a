"""Whole Hugging Face models under TSP: the first step's gradient of every parameter (gathered to
full shape, relative error 1e-10 on every rank), then 5 AdamW steps give the losses and the final
full state dict of the unmodified model on one process (Llama, tied Llama, Mistral with a sliding
window, Qwen2 with biases and a sliding layer, Qwen3 with per-head q/k norms, head_dim unlike
hidden/heads, and 1 key/value head) at world sizes 1, 2, 4 and dp 2 x tsp 2; float32 weights
under bf16 autocast (test_training_parity_bf16_autocast)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tsp_core
from tests.support import dist_pool, hf_models, parity


def family_parity(family: str, tsp: int, dtype: torch.dtype, seq: int, steps: int = 5,
                  kv_heads: int | None = None) -> parity.Parity:
    """The zoo's ``family`` trained ``steps`` AdamW steps (lr 1e-3) on batches with ignored
    labels (tests/support/parity.py): float64 to 1e-10 (losses, first gradients) and 1e-8
    (weights), float32 to 1e-4 (losses, weights)."""
    return parity.Parity(
        partial(hf_models.build, family, dtype, kv_heads=kv_heads), tsp, steps=steps, seq=seq,
        middle_ignored=True, optimizer=partial(torch.optim.AdamW, lr=1e-3),
        tol=parity.FLOAT64 if dtype == torch.float64 else parity.FLOAT32, name=family)


CONFIGS = [(1, 1), (2, 2), (4, 4), (4, 2)]   # (world size, tsp size); (4, 2) is dp 2 x tsp 2


@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_training_parity_float64(pools, family, world, tsp):
    parity.assert_same_losses(pools.of(world).run(
        parity.train_parity, family_parity(family, tsp, torch.float64, 24)))


@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", hf_models.FLOAT32_FAMILIES)
def test_training_parity_float32(pools, family, world, tsp):
    pools.of(world).run(parity.train_parity, family_parity(family, tsp, torch.float32, 24))


@pytest.mark.parametrize("family,world,tsp", [("llama-tied", 2, 2), ("gemma2", 4, 2)], ids=str)
def test_training_parity_bf16_autocast(pools, family, world, tsp):
    # float32 weights, the forward and backward under bf16 autocast (how users train in mixed
    # precision): one SGD step against the unmodified model under the same autocast, the loss,
    # every first gradient and the weights after the step within bf16's bounds
    # (tests/support/parity.py compare_bf16: G = 9 u). Llama tied: the tied, padded vocabulary;
    # Gemma 2 at dp 2 x tsp 2: soft-capped scores (TSP's math kernel, whose backward keeps
    # float32 under autocast), sandwich norms. Measured: 1.4 u and 3.2 u
    parity.assert_same_losses(pools.of(world).run(parity.train_parity, parity.bf16_parity(
        partial(hf_models.build, family, torch.float32), tsp, family)))


@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["qwen3", "gemma", "gemma3", "olmo2"])
def test_one_kv_head(pools, family, world, tsp):
    # one key/value head (Gemma 2B and Gemma 3 1B ship with one) split over 2 or 4 ranks, each a
    # slice of its rows: Qwen3's and Gemma 3's per-head k norm and OLMo 2's whole-width one on a
    # sliced head, the norm's weight gradient summed once per head, not once per round
    parity.assert_same_losses(pools.of(world).run(
        parity.train_parity, family_parity(family, tsp, torch.float64, 24, 5, 1)))


def test_padding_and_ignored_labels(pools):
    # 21 tokens: padded to 24 at tsp 2 and 4; the loss is HF's on the unpadded 21 tokens
    pools.of(4).run(parity.train_parity, family_parity("llama", 4, torch.float64, 21, 2))
    pools.of(4).run(parity.train_parity, family_parity("mistral", 2, torch.float64, 21, 2))


def bad_models() -> list[str]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    mesh = dist_pool.mesh(4)
    msgs = []
    cases = [
        (GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)),
         r"no TSP policy for GPT2LMHeadModel \(model_type='gpt2'\); supported: "
         r"\['apertus', 'deepseek_v3', 'ernie4_5', 'exaone4', 'gemma', 'gemma2', 'gemma3', "
         r"'gemma4', 'glm4', "
         r"'glm4_moe', 'gpt_oss', 'granite', 'hunyuan_v1_dense', 'llama', 'llama4_text', "
         r"'mistral', 'mixtral', 'olmo2', 'olmo3', 'phi3', "
         r"'qwen2', 'qwen3', 'qwen3_5', "
         r"'qwen3_moe', 'qwen3_next', 'seed_oss', 'smollm3'\]\. "
         r"Describe its module names"),
        (LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=6,
                                      num_key_value_heads=6)),
         r"tsp_size \(4\) must divide num_attention_heads \(6\); valid tsp_size values for "
         r"this model: 1, 2$"),
        (LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=66,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4)),
         r"tsp_size \(4\) must divide intermediate_size \(66\); valid tsp_size values for "
         r"this model: 1, 2$"),
        (LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, attention_dropout=1.0)),
         r"attention_dropout \(1\.0\) must be in \[0, 1\)"),
    ]
    # what a family uses and TSP does not implement is refused by its config field and value
    # (Gemma 2's soft-capping, once refused here, is implemented: test_training_parity_float64)
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    small = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    cases.append((Gemma3ForCausalLM(Gemma3TextConfig(use_bidirectional_attention=True, **small)),
                  r"Gemma3ForCausalLM: config\.use_bidirectional_attention=True \(bidirectional "
                  r"attention\) not implemented by TSP; set it to None/False"))
    # Gemma 4's MoE block beside the MLP with experts a rank cannot own whole, and bidirectional
    # attention (docs/families.md "Gemma 4")
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    g4 = dict(small, num_hidden_layers=3, global_head_dim=16, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention", "full_attention"])
    cases.append((Gemma4ForCausalLM(Gemma4TextConfig(
        enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=32, **g4)),
                  r"tsp_size \(4\) must divide the number of experts \(6\)"))
    cases.append((Gemma4ForCausalLM(Gemma4TextConfig(use_bidirectional_attention="all", **g4)),
                  r"Gemma4ForCausalLM: config\.use_bidirectional_attention='all' \(bidirectional "
                  r"attention\) not implemented by TSP"))
    # attention dropout: HFTSPAttention refuses it in training (tests/models/test_dropout.py);
    # a family's own attention module (DeepSeek-V3's latent attention) at parallelize
    from tests.models import test_deepseek_v3

    deepseek = test_deepseek_v3.build()
    deepseek.config.attention_dropout = 0.1
    cases.append((deepseek, r"attention_dropout \(0\.1\) is not supported by deepseek_v3's TSP "
                            r"attention; set it to 0\.0"))
    # an ungated MLP (Apertus's) takes the activations TSPPlainMLP implements, and says which
    from transformers import ApertusConfig, ApertusForCausalLM

    cases.append((ApertusForCausalLM(ApertusConfig(hidden_act="relu", **{
        k: v for k, v in small.items() if k != "head_dim"})),
                  r"hidden_act 'relu' is not supported by TSPPlainMLP; supported: "
                  r"\['gelu_pytorch_tanh', 'gelu_tanh', 'silu', 'swish', 'xielu'\]$"))
    # experts that cannot be owned whole, 1/D each (docs/moe.md)
    from transformers import MixtralConfig, MixtralForCausalLM

    cases.append((MixtralForCausalLM(MixtralConfig(num_local_experts=6, **small)),
                  r"tsp_size \(4\) must divide the number of experts \(6\).*; valid "
                  r"tsp_size values for this model: 1, 2; or moe_schedule=\"ring\""))
    # a soft-cap of 0 (HF would divide by it) is refused, naming it
    cases.append((Gemma2ForCausalLM(Gemma2Config(attn_logit_softcapping=0.0, **small)),
                  r"Gemma2ForCausalLM: the attention soft-cap \(0\.0\) must be positive"))
    # a mixture-of-experts model under a policy that describes no experts is refused by the
    # field that makes it one, not run as a dense model
    from tsp_core.models.policies.mistral import POLICY as MISTRAL

    cases.append((MixtralForCausalLM(MixtralConfig(num_local_experts=4, **small)),
                  r"MixtralForCausalLM is a mixture-of-experts model \(config\.num_local_experts"
                  r"=4\) and the policy 'mistral' describes no experts", MISTRAL))
    # a policy that leaves out tensors of a module it replaces (Qwen3's per-head q/k norms) is
    # refused, naming them, instead of running another model
    import dataclasses

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tsp_core.models.policies.qwen3 import POLICY as QWEN3

    cases.append((Qwen3ForCausalLM(Qwen3Config(**small)),
                  r"policy 'qwen3-without-norms': Qwen3DecoderLayer\.self_attn holds \['k_norm\."
                  r"weight', 'q_norm\.weight'\], which its TSP replacement \(HFTSPAttention\) "
                  r"does not take",
                  dataclasses.replace(QWEN3, name="qwen3-without-norms",
                                      attn=dataclasses.replace(QWEN3.attn, qk_norm=None))))
    for model, pattern, *policy in cases:
        before = dict(model.state_dict(keep_vars=True))
        with tsp_core.comm.track() as stats, pytest.raises(ValueError, match=pattern) as e:
            tsp_core.parallelize(model, mesh, policy=policy[0] if policy else None)
        assert not stats.calls, "a collective ran before the error"
        after = model.state_dict(keep_vars=True)
        assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items()), \
            "the model was changed before the error"
        msgs.append(str(e.value))
    # OLMo 2's q/k norms span all heads of a token (one statistic over every head group): a
    # policy naming them as per-head norms (qk_norm_all_heads left False) is refused, naming the
    # shapes
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from tsp_core.layers.attention import QKNorm
    from tsp_core.models.policies import AttentionPolicy, DecoderPolicy, ModuleNames

    olmo = Olmo2ForCausalLM(Olmo2Config(vocab_size=32, hidden_size=64, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=4))
    per_head = DecoderPolicy(name="olmo2-as-per-head", model_types=(),
                             modules=ModuleNames(layer_norms=("post_attention_layernorm",
                                                              "post_feedforward_layernorm")),
                             attn=AttentionPolicy(qk_norm=QKNorm(names=("q_norm", "k_norm"))))
    with tsp_core.comm.track() as stats, pytest.raises(
            ValueError, match=r"layer 0: q/k norm weights of shapes \[\(64,\), \(64,\)\], but "
                              r"the policy 'olmo2-as-per-head' describes norms per head: "
                              r"\[\(16,\), \(16,\)\]; set DecoderPolicy.attn.qk_norm.scope"):
        tsp_core.parallelize(olmo, mesh, policy=per_head)
    assert not stats.calls
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64), mesh)
    with pytest.raises(ValueError, match="already parallelized"):
        tsp_core.parallelize(model, mesh)
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="takes shift_labels"):
        model(input_ids=ids[:, :4], position_ids=torch.arange(4)[None], labels=ids[:, :4])
    with pytest.raises(ValueError, match="needs the global position_ids"):
        model(input_ids=ids[:, :4])
    with pytest.raises(ValueError, match="was not parallelized"):
        tsp_core.get_mesh(hf_models.build("llama", torch.float64))
    # a plain model built from a TSP model's config, which says "tsp" (the config it was built
    # from does not: tests/models/test_config_copy.py): its attention module says what happened
    # and what to do instead
    from transformers import AutoModelForCausalLM

    tsp_model = tsp_core.parallelize(LlamaForCausalLM(LlamaConfig(vocab_size=96,
                                                                  **hf_models.COMMON)), mesh)
    plain = LlamaForCausalLM(tsp_model.config)
    with tsp_core.comm.track() as stats, pytest.raises(
            RuntimeError, match=r'LlamaAttention called the "tsp" attention implementation, which '
                                r"only tsp_core\.parallelize's attention modules "
                                r"\(HFTSPAttention\) "
                                r"run: this LlamaAttention belongs to a model that was not "
                                r"parallelized.* built from a TSP model's config "
                                r'\(tsp_model\.config says "tsp".*AutoModelForCausalLM\.'
                                r"from_config\(copy\.deepcopy\(tsp_model\.config\), "
                                r'attn_implementation="sdpa"\)') as e:
        plain(input_ids=ids[:, :4])
    assert not stats.calls
    msgs.append(str(e.value))
    # and the fix it names runs
    AutoModelForCausalLM.from_config(copy.deepcopy(tsp_model.config), attn_implementation="sdpa")(
        input_ids=ids[:, :4])
    return msgs


def test_bad_models_fail_before_any_change(pools):
    pools.of(4).run(bad_models)


def test_gemma2_softcaps_change_the_loss():
    # the test model's soft-caps are far from linear: without either, HF's own float64 loss
    # (hf_models.reference_loss, soft-capped logits) moves by more than 0.1%, so the parity
    # tests would see a cap applied wrongly or not at all
    ref = hf_models.build("gemma2", torch.float64)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        capped = hf_models.reference_loss(ref, ids, ids).item()
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            model = copy.deepcopy(ref)
            setattr(model.config, field, None)
            for layer in model.model.layers:  # each attention keeps its own copy of the field
                layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
            plain = hf_models.reference_loss(model, ids, ids).item()
            assert abs(plain - capped) > 1e-3 * abs(capped), (field, plain, capped)


@pytest.mark.parametrize("intermediate, valid", [(24, [1, 2, 4, 12]), (18, [1, 2])])
def test_size_errors_list_exactly_the_sizes_that_work(intermediate, valid):
    # 12 query heads, 4 key/value heads: 3 and 6 divide the heads but split key/value heads
    # unevenly; the intermediate size rules out more. Every refusal lists the sizes parallelize
    # accepts and no other, and the planner (tsp plan) refuses exactly the same sizes
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from tsp_core.baselines.layouts import LayoutSpec
    from tsp_core.models.checks import check_model
    from tsp_core.models.policies import find_policy
    from tsp_core.models.reading import read_model
    from tsp_core.plan.cost import check_layout
    from tsp_core.plan.traffic import ModelShape

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=48, num_hidden_layers=1,
                                         intermediate_size=intermediate, num_attention_heads=12,
                                         num_key_value_heads=4))
    policy, shape = find_policy(model), ModelShape.from_config(model.config)
    hint = "; valid tsp_size values for this model: " + ", ".join(map(str, valid))
    accepted = []
    for d in range(1, 25):
        try:
            mesh = SimpleNamespace(size=d, fsdp_size=1)
            check_model(model, mesh, policy, read_model(model, mesh, policy), "expert")
            accepted.append(d)
        except ValueError as e:
            assert str(e).startswith((f"tsp_size ({d}) must divide",
                                      f"num_key_value_heads (4) and tsp_size ({d})")), str(e)
            assert str(e).endswith(hint), (d, str(e))
        planned = check_layout(shape, LayoutSpec("tsp", d))
        assert (planned is None) == (d in accepted), (d, planned)
    assert accepted == valid


def rope_stays_float32() -> None:
    """``.to(bfloat16)`` / ``.bfloat16()`` / ``.half()`` of a TSP model (or of a module holding
    it, as Lightning's bf16-true and DeepSpeed's bf16 do) cast the weights but keep every rotary
    frequency buffer float32 and bit for bit; a device move or a wider type still applies."""
    from tsp_core.layers.attention import AttentionParts, AttentionShape, Rotary

    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float32), mesh)
    attention = tsp_core.TSPAttention(mesh, AttentionShape(32, 4, 2),
                                      AttentionParts(rotary=Rotary(theta=500000.0)))
    holder = nn.ModuleDict({"model": model, "attention": attention})  # a LightningModule, say
    frequencies = {n: b.clone() for n, b in holder.named_buffers() if n.endswith("inv_freq")}
    assert any(n.startswith("model.") for n in frequencies), sorted(frequencies)
    assert "attention.inv_freq" in frequencies
    for name, cast, dtype in (("to", lambda m: m.to(torch.bfloat16), torch.bfloat16),
                              ("bfloat16", lambda m: m.bfloat16(), torch.bfloat16),
                              ("half", lambda m: m.half(), torch.float16)):
        cast(holder)
        weight = model.model.layers[0].mlp.gate_proj.weight
        assert weight.dtype == dtype, (name, weight.dtype)  # the cast happened
        now = dict(holder.named_buffers())
        for n, want in frequencies.items():
            assert now[n].dtype == torch.float32 and torch.equal(now[n], want), (name, n, now[n])
        holder.float()
    holder.double()  # wider: the frequencies follow
    assert all(b.dtype == torch.float64 for n, b in holder.named_buffers()
               if n.endswith("inv_freq"))
    dist.barrier()


def test_rope_frequencies_stay_float32_under_a_bf16_cast(pools):
    pools.of(2).run(rope_stays_float32)


def replicas_must_agree() -> None:
    """dp 2 x tsp 2: replicas built from different seeds are refused on every rank, naming the
    first tensor, before the model changes; the same seed converts, with one all-gather of the
    sums over the data-parallel dim; a mesh without data parallelism adds no collective."""
    from tsp_core.models import TSPCausalLM

    mesh = dist_pool.mesh(2)
    dp_rank = mesh.device_mesh.get_coordinate()[0]
    differing = hf_models.build("llama", torch.float32, seed=dp_rank)
    with pytest.raises(ValueError, match=r"data-parallel replicas \(mesh dim 'dp', 2 ranks\) "
                                         r"hold different weights, model\.embed_tokens\.weight "
                                         r"first: build the model from the same seed"):
        tsp_core.parallelize(differing, mesh)
    assert not isinstance(differing, TSPCausalLM)
    assert not any(isinstance(m, tsp_core.TSPAttention) for m in differing.modules())
    # only a later tensor differs (the final norm): found too
    late = hf_models.build("llama", torch.float32)
    with torch.no_grad():
        late.model.norm.weight.add_(1e-3 * dp_rank)
    with pytest.raises(ValueError, match=r"hold different weights, model\.norm\.weight first"):
        tsp_core.parallelize(late, mesh)
    # LoRA adapters, whole on every rank of the TSP group, created from each TSP rank's own seed
    lora = hf_models.lora_model(hf_models.build("llama", torch.float32), 2, seed=mesh.rank)
    with pytest.raises(ValueError, match=r"the ranks of the TSP group, which each hold these "
                                         r"tensors whole, \(mesh dim 'tsp', 2 ranks\) hold "
                                         r"different weights, .*lora_A"):
        tsp_core.parallelize(lora, mesh)
    with tsp_core.comm.track() as stats:
        tsp_core.parallelize(hf_models.build("llama", torch.float32), mesh)
    assert dict(stats.calls) == {"all_gather": 1}, stats.calls
    dist.barrier()


def no_replicas_no_collective() -> None:
    with tsp_core.comm.track() as stats:
        tsp_core.parallelize(hf_models.build("llama", torch.float32, seed=dist.get_rank()),
                             dist_pool.mesh(2))
    assert not stats.calls, stats.calls  # tsp 2 alone: each rank's slices, nothing to compare
    dist.barrier()


def test_data_parallel_replicas_must_start_equal(pools):
    pools.of(4).run(replicas_must_agree)
    pools.of(2).run(no_replicas_no_collective)
