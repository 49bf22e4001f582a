"""LoRA under TSP (tsp_core/models/lora.py, tsp_core/layers/lora.py, docs/lora.md): a PEFT
``PeftModel`` parallelized against the same PeftModel on one process (unmodified PEFT and
Hugging Face, float64), on every rank: Llama with one key/value head (nkv < D: the sliced
key/value rows), Qwen3 with per-head q/k norms, rsLoRA and per-module ranks and alphas, every
projection adapted, Mixtral with its attention adapted (its experts untouched, on the expert
schedule; the ring schedule at tsp 2) and Phi-3 with its fused qkv_proj and gate_up_proj adapted,
at tsp 1, 2, 4 and dp 2 x tsp 2 (Qwen2's q/k/v biases at dp 2 x tsp 2).
Losses of 3 SGD steps to 1e-10, the adapters' first gradients to 1e-10 (no base weight has a
gradient), the adapters after 3 SGD and after 3 AdamW steps (1e-10, 1e-8), the base weights bit
for bit as they were, optimizer state for the adapters only. Collective bytes and calls of one
LoRA step against full fine-tuning's, by the formula of docs/design.md "LoRA". Refusals by name
on every rank before any collective. PEFT's ``print_trainable_parameters``, ``disable_adapter()``,
``save_pretrained`` (loaded by plain PEFT), ``unload()`` and ``merge_and_unload()`` on the
converted model (its generation: tests/inference/test_decode.py). The fused adapters saved
(loaded by plain PEFT) and merged; several named adapters switched with ``set_adapter``. Every
family of the test zoo (and Mixtral, its attention adapted) at tsp 2: one step exact, or refused
by name before any collective."""

from __future__ import annotations

import contextlib
import copy
import io
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, gather, hf_models, parity
from tests.support.reference import relative_error

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's projections


def base_model(family: str):
    """A small ``family`` model in float64: Llama with one key/value head, Qwen3 with 2,
    head_dim 16 and per-head q/k norms, Qwen2 with 2 and q/k/v biases, Mixtral with 2 and 4
    experts (top 2), Phi-3 with one key/value head and its fused ``qkv_proj``, ``gate_up_proj``."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=1)).double()
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2)).double()
    if family == "mixtral":
        config = MixtralConfig(**{**SMALL, "intermediate_size": 64}, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               experts_implementation="eager")
        return MixtralForCausalLM(config).double()
    if family == "phi3":
        config = Phi3Config(**SMALL, num_key_value_heads=1, pad_token_id=None, eos_token_id=2)
        return Phi3ForCausalLM(config).double()
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16)).double()


def peft_model(family: str, config: dict | None = None):
    """:func:`base_model` wrapped by ``get_peft_model``: Llama r 4, alpha 8; Qwen3 r 3, alpha 5,
    rsLoRA, down_proj r 2 and q_proj alpha 7 (rank_pattern, alpha_pattern); every projection
    adapted (Mixtral: the attention's; its experts are fused tensors, which PEFT's
    target_modules cannot adapt, left to the MoE schedule), both LoRA matrices random
    (init_lora_weights=False: B = 0 would give A no gradient). ``config``: LoraConfig fields
    instead of these."""
    from peft import LoraConfig, get_peft_model

    lora = dict(r=4, lora_alpha=8) if family != "qwen3" else dict(
        r=3, lora_alpha=5, use_rslora=True, rank_pattern={"down_proj": 2},
        alpha_pattern={"q_proj": 7})
    targets = {"mixtral": ALL[:4], "phi3": FUSED}.get(family, ALL)
    lora = dict(target_modules=targets, init_lora_weights=False, **lora)
    return get_peft_model(base_model(family), LoraConfig(**(lora if config is None else config)))


def hf_name(name: str) -> str:
    """A PeftModel's parameter name as TSP's full state dict names it (the base's own name)."""
    return name.replace(".base_layer.", ".")


def reference_run(ref, data, optimizer) -> dict:
    """The PeftModel on one process: losses, the adapters' first gradients, the final state."""
    opt = optimizer([p for p in ref.parameters() if p.requires_grad])
    losses, grads0 = [], None
    for ids, labels in data:
        loss = hf_models.reference_loss(ref, ids, labels)
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grads0=grads0,
                weights={hf_name(n): t.clone() for n, t in ref.state_dict().items()})


def tsp_run(model, mesh, data, optimizer, rows: int) -> dict:
    """The converted PeftModel on this rank's share of the same batches; also checks that no
    base weight got a gradient and that the optimizer keeps state for the adapters only."""
    dp_rank = mesh.device_mesh.get_coordinate()[0]
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    opt = optimizer(model.parameters())
    losses, grads0 = [], None
    for ids, labels in data:
        out = model(**tsp_core.shard_batch({"input_ids": ids[mine], "labels": labels[mine]},
                                           mesh))
        out.loss.backward()
        with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
        assert with_grad and all(".lora_" in n for n in with_grad), with_grad
        if grads0 is None:
            grads0 = gather.full_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    trainable = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert set(map(id, opt.state)) <= trainable, "optimizer state for a frozen weight"
    return dict(losses=losses, grads0=grads0, weights=tsp_core.full_state_dict(model))


def check_run(run: dict, ref: dict, init: dict, weights_tol: float, what: str) -> None:
    """``run`` against ``ref`` (losses 1e-10, adapters' first gradients 1e-10, adapters after the
    steps to ``weights_tol``) and every base weight bit for bit ``init``'s."""
    rank = dist.get_rank()
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= 1e-10 * abs(b), f"rank {rank} {what} step {step}: {a!r} vs {b!r}"
    assert set(run["grads0"]) == set(ref["grads0"]), (rank, what, sorted(run["grads0"]))
    for name, g in ref["grads0"].items():
        err = relative_error(run["grads0"][name], g)
        assert err <= 1e-10, f"rank {rank} {what}: gradient of {name} off by {err:.2e}"
    assert set(run["weights"]) == set(ref["weights"]), (rank, what)
    for name, w in ref["weights"].items():
        got = run["weights"][name]
        if ".lora_" in name:
            err = parity.weight_error(got, w)
            assert err <= weights_tol, f"rank {rank} {what}: {name} off by {err:.2e}"
        else:
            assert torch.equal(got, init[name]), f"rank {rank} {what}: base weight {name} moved"


def lora_parity(family: str, tsp: int, moe_schedule: str = "auto") -> dict:
    """Run on every rank: 3 SGD steps (losses, first gradients, adapters to 1e-10) and 3 AdamW
    steps (adapters to 1e-8) of the converted PeftModel against the reference's; each rank's
    losses (``losses``). ``moe_schedule``: Mixtral's experts' schedule."""
    mesh = dist_pool.mesh(tsp)
    rows = 2
    data = parity.batches(SMALL["vocab_size"], rows * mesh.dp_size, 24, 3, middle_ignored=True)
    losses = []
    for optimizer, tol in ((partial(torch.optim.SGD, lr=0.5), 1e-10),
                           (partial(torch.optim.AdamW, lr=1e-2), 1e-8)):
        ref = peft_model(family)
        init = {hf_name(n): t.clone() for n, t in ref.state_dict().items()}
        model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=moe_schedule)
        assert type(model) is type(ref) and tsp_core.get_mesh(model) is mesh
        run = tsp_run(model, mesh, data, optimizer, rows)
        check_run(run, reference_run(ref, data, optimizer), init, tol,
                  f"{family} tsp {tsp} {optimizer.func.__name__}")
        losses += run["losses"]
    return dict(losses=losses)


CONFIGS = [(1, 1), (2, 2), (4, 4), (4, 2)]  # (world size, tsp size); (4, 2): dp 2 x tsp 2


@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "phi3"])
def test_lora_parity_float64(pools, family, world, tsp):
    parity.assert_same_losses(pools.of(world).run(lora_parity, family, tsp))


def test_lora_parity_mixtral_ring_schedule(pools):
    # the experts on the other MoE schedule (at tsp 2 "auto" picks the expert schedule)
    parity.assert_same_losses(pools.of(2).run(lora_parity, "mixtral", 2, "ring"))


def test_lora_parity_qwen2_biases(pools):
    # q/k/v biases in the base projections beside the adapters, at dp 2 x tsp 2
    parity.assert_same_losses(pools.of(4).run(lora_parity, "qwen2", 2))


# ------------------------------------------------------------------------ collective bytes

def one_step(model, mesh) -> tsp_core.comm.CommStats:
    """The collectives of one forward and backward of ``model`` on 2 rows of 24 tokens."""
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    with tsp_core.comm.track() as stats:
        model(**batch).loss.backward()
    return stats


def removed_by_lora(family: str, D: int, e: int = 8) -> dict[str, tuple[int, float]]:
    """docs/design.md "LoRA": per collective kind, the calls and per-rank bytes of one step of
    full fine-tuning that a frozen base does not issue, for this file's ``family`` model at TSP
    degree D (e bytes an element), without the embedding's backward all-to-all (data-dependent:
    the forward's row exchange reversed) and before the adapters' own all-reduces."""
    h, F_, V, layers, nq = (SMALL[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                               "num_hidden_layers", "num_attention_heads"))
    nkv, d = (1, h // nq) if family == "llama" else (2, 16)
    sliced = nkv < D
    round_pack = (2 * nq * d * h if sliced else (2 * nq + 2 * nkv) * d * h) // D * e
    kv_slice = 2 * -(-nkv * d // D) * h * e  # one rank's key/value rows, padded (sliced)
    mlp_pack = 3 * F_ * h // D * e
    head_pack = -(-V // D) * h * e
    norms = [h, h] + ([d, d] if family == "qwen3" else [])  # per layer, then the final norm
    out = {"reduce": (layers * D, layers * (D - 1) * round_pack),  # owner reduces of rounds
           "ring_pass": (layers * D + D, layers * D * mlp_pack + D * head_pack),  # gradient hops
           "all_reduce": (layers * len(norms) + 1,
                          2 * (D - 1) / D * e * (layers * sum(norms) + h))}
    if sliced:  # the key/value slices' gradients, reduce-scattered once per layer
        out["reduce_scatter"] = (layers, layers * (D - 1) * kv_slice)
    return out


def adapter_all_reduces(family: str, D: int, e: int = 8) -> tuple[int, float]:
    """docs/design.md "LoRA": one all-reduce of each adapter matrix's gradient over the group
    (calls, per-rank bytes) per step, for :func:`peft_model`'s adapters."""
    h, F_, layers, nq = (SMALL[k] for k in ("hidden_size", "intermediate_size",
                                            "num_hidden_layers", "num_attention_heads"))
    nkv, d, r = (1, h // nq, 4) if family == "llama" else (2, 16, 3)
    shapes = {"q_proj": (h, nq * d), "k_proj": (h, nkv * d), "v_proj": (h, nkv * d),
              "o_proj": (nq * d, h), "gate_proj": (h, F_), "up_proj": (h, F_),
              "down_proj": (F_, h)}
    ranks = {n: 2 if family == "qwen3" and n == "down_proj" else r for n in shapes}
    elements = layers * sum(ranks[n] * (i + o) for n, (i, o) in shapes.items())
    return 2 * len(shapes) * layers, 2 * (D - 1) / D * elements * e


def lora_bytes(family: str, tsp: int) -> dict:
    """Run on every rank: one step of full fine-tuning (the base model, every weight trained) and
    one of LoRA, their collectives by kind, against :func:`removed_by_lora` and
    :func:`adapter_all_reduces`."""
    mesh = dist_pool.mesh(tsp)
    full = tsp_core.parallelize(base_model(family), mesh)  # every weight trained
    lora = tsp_core.parallelize(peft_model(family), mesh)
    f, lo = one_step(full, mesh), one_step(lora, mesh)
    removed = removed_by_lora(family, tsp)
    calls, nbytes = adapter_all_reduces(family, tsp)
    embed_rows = [b for k, b in lo.log if k == "all_to_all"][-1]  # the forward's row exchange
    removed["all_to_all"] = (1, embed_rows)
    added = {"all_reduce": (calls, nbytes)}
    for kind in set(f.calls) | set(lo.calls):
        want_calls = (f.calls[kind] - removed.get(kind, (0, 0))[0]
                      + added.get(kind, (0, 0))[0])
        want_bytes = (f.bytes[kind] - removed.get(kind, (0, 0))[1]
                      + added.get(kind, (0, 0))[1])
        assert lo.calls[kind] == want_calls, (kind, lo.calls[kind], want_calls, f.calls[kind])
        assert abs(lo.bytes[kind] - want_bytes) <= 1e-9 * max(1.0, want_bytes), \
            (kind, lo.bytes[kind], want_bytes, f.bytes[kind])
    return dict(full=f.total_bytes, lora=lo.total_bytes, full_calls=sum(f.calls.values()),
                lora_calls=sum(lo.calls.values()))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_step_moves_the_formula_bytes(pools, family):
    # Llama at tsp 2 has its one key/value head sliced (the slices' reduce-scatter goes too),
    # Qwen3 two heads, one a rank, and q/k norms
    # (LoRA issues more calls here: 2 small all-reduces per adapted projection, 14 a layer)
    figures = pools.of(2).run(lora_bytes, family, 2)
    assert all(f["lora"] < f["full"] for f in figures), figures


# ------------------------------------------------------------------------------- refusals

def refusals() -> list[str]:
    """Run on every rank: each unsupported PEFT setup raises on this rank, naming it, before any
    collective. The messages."""
    from peft import IA3Config, PromptTuningConfig, get_peft_model

    plain = partial(base_model, "llama")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    cases = [
        (peft_model("llama", dict(lora, use_dora=True)), "DoRA"),
        (get_peft_model(plain(), IA3Config(target_modules=["k_proj", "down_proj"],
                                           feedforward_modules=["down_proj"])), "PEFT type IA3"),
        (get_peft_model(plain(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
         "PEFT type PROMPT_TUNING"),
        (peft_model("llama", dict(lora, bias="lora_only")), "bias='lora_only'"),
        (peft_model("llama", dict(lora, modules_to_save=["lm_head"])), "modules_to_save"),
        (peft_model("llama", dict(lora, target_modules=["q_proj", "embed_tokens"])),
         "LoRA on model.embed_tokens"),
    ]
    messages = []
    for model, name in cases:
        with tsp_core.comm.track() as stats, pytest.raises(NotImplementedError) as err:
            tsp_core.parallelize(model, dist_pool.mesh(2))
        assert not dict(stats.calls), dict(stats.calls)  # before any collective
        assert name in str(err.value), (name, str(err.value))
        messages.append(str(err.value))
    dist.barrier()
    return messages


def test_unsupported_peft_setups_are_refused_by_name(pools):
    messages = pools.of(2).run(refusals)
    assert messages[0] == messages[1]


# -------------------------------------------------------------------- PeftModel behaviour

def peft_behaviour(path: str) -> None:
    """Run on every rank: the converted model prints PEFT's trainable-parameter line; its
    adapter saved by PEFT's ``save_pretrained`` with ``state_dict=tsp_core.full_state_dict``
    loads into the unmodified base with plain PEFT and
    gives the reference's logits; under ``disable_adapter()`` it gives the base model's loss (the
    reference's, adapter disabled), then the adapted one again; PEFT's per-row
    ``adapter_names=`` is refused by name before any collective (TSP's adapters would ignore
    it); ``unload()`` leaves the TSP base
    model; ``merge_and_unload()`` a TSP model with the adapted loss whose full state is the
    reference's ``merge_and_unload()`` one (1e-12)."""
    from peft import PeftModel

    mesh = dist_pool.mesh(2)
    ref = peft_model("llama")
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    state = tsp_core.full_state_dict(model)  # every rank gathers; rank 0 writes
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=state)
    dist.barrier()
    loaded = PeftModel.from_pretrained(base_model("llama"), path)
    probe = torch.randint(0, SMALL["vocab_size"], (1, 12),
                          generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = relative_error(loaded(input_ids=probe).logits, ref(input_ids=probe).logits)
    assert err <= 1e-10, f"rank {dist.get_rank()}: the saved adapter's logits off by {err:.2e}"
    lines = []
    for m in (ref, model):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            m.print_trainable_parameters()
        lines.append(out.getvalue())
    assert lines[0] == lines[1] and "trainable params" in lines[0], lines
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(4))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)

    def losses(m, tsp: bool) -> float:
        if tsp:
            return m(**batch).loss.item()
        logits = m(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    with torch.no_grad():
        adapted = losses(ref, False)
        with ref.disable_adapter():
            base = losses(ref, False)
        got = [losses(model, True)]
        with model.disable_adapter():
            got.append(losses(model, True))
            assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
        got.append(losses(model, True))
    assert abs(base - adapted) > 1e-3  # the adapters change the loss
    model.eval()  # PEFT takes adapter_names= in eval mode only (evaluation, generation)
    with tsp_core.comm.track() as stats, pytest.raises(
            NotImplementedError, match=r"adapter_names= \(PEFT's per-row adapter choice\) is not "
                                       r"supported under TSP: every row runs the active adapter"):
        model(**batch, adapter_names=["__base__", "__base__"])  # would give the adapted rows
    assert not dict(stats.calls), (dist.get_rank(), dict(stats.calls))
    model.train()
    for g, want in zip(got, [adapted, base, adapted]):
        assert abs(g - want) <= 1e-10 * abs(want), (got, adapted, base)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    plain = model.unload()  # the TSP base model, its projections as before the adapters
    with torch.no_grad():
        assert abs(plain(**batch).loss.item() - base) <= 1e-10 * base
    merged = tsp_core.parallelize(copy.deepcopy(ref), mesh).merge_and_unload()
    with torch.no_grad():
        assert abs(merged(**batch).loss.item() - adapted) <= 1e-10 * adapted
    want = ref.merge_and_unload().state_dict()
    got = tsp_core.full_state_dict(merged)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, w in want.items():
        assert parity.weight_error(got[name], w) <= 1e-12, name


def test_peft_model_behaviour(pools, tmp_path):
    pools.of(2).run(peft_behaviour, str(tmp_path))


def saved_adapter(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-process reference, plain PEFT and Hugging Face only (it runs in the test's own
    process and calls nothing of tsp_core): a random LoRA adapter (r 4 on every projection)
    saved with ``save_pretrained`` to ``path``, loaded back with ``PeftModel.from_pretrained``
    onto a fresh base; (probe ids, the loaded PeftModel's logits on them, the base's)."""
    from peft import PeftModel

    torch.manual_seed(1)
    peft_model("llama").save_pretrained(path)
    loaded = PeftModel.from_pretrained(base_model("llama"), path)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        return ids, loaded(input_ids=ids).logits, base_model("llama")(input_ids=ids).logits


def loaded_adapter_logits(path: str, ids: torch.Tensor, want: torch.Tensor) -> None:
    """Run on every rank: PEFT's ``PeftModel.from_pretrained(base, path)`` then
    ``tsp_core.parallelize`` at tsp 2 gives every token's logits (``full_logits``) of the
    one-process PeftModel (1e-10); loading onto an already parallelized model is refused by
    PEFT, on every rank before any collective, with TSP's advice (load first)."""
    from peft import PeftModel

    mesh, rank = dist_pool.mesh(2), dist.get_rank()
    model = tsp_core.parallelize(PeftModel.from_pretrained(base_model("llama"), path), mesh)
    with torch.no_grad():
        got = tsp_core.full_logits(model, {"input_ids": ids}).logits
    err = relative_error(got, want)
    assert err <= 1e-10, f"rank {rank}: the loaded adapter's logits off by {err:.2e}"
    converted = tsp_core.parallelize(base_model("llama"), mesh)
    with tsp_core.comm.track() as stats, pytest.raises(
            ValueError, match=r"load or create the adapters on the Hugging Face model first "
                              r"\(PeftModel.from_pretrained\(model, dir\)"):
        PeftModel.from_pretrained(converted, path)
    assert not dict(stats.calls), (rank, dict(stats.calls))
    dist.barrier()


def test_adapter_loaded_by_peft_then_parallelized(pools, tmp_path):
    ids, want, base = saved_adapter(str(tmp_path))
    assert relative_error(base, want) > 1e-3  # the adapter changes the logits
    pools.of(2).run(loaded_adapter_logits, str(tmp_path), ids, want)


def checkpointed_grads() -> None:
    """Run on every rank: the adapters' gradients under activation checkpointing (reentrant or
    not: TRL turns it on by default) equal those without, bit for bit."""
    mesh = dist_pool.mesh(2)
    ref = peft_model("qwen3")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    grads = []
    for reentrant in (None, False, True):
        model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
        if reentrant is not None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model(**batch).loss.backward()
        grads.append({n: p.grad.to_local() for n, p in model.named_parameters()
                      if p.grad is not None})
    for got in grads[1:]:
        assert got.keys() == grads[0].keys() and all(
            torch.equal(g, grads[0][n]) for n, g in got.items()), f"rank {dist.get_rank()}"


def test_activation_checkpointing_gives_the_same_adapter_gradients(pools):
    pools.of(2).run(checkpointed_grads)


# ------------------------------------------------------------ fused projections (Phi-3)

def fused_saved_and_merged(path: str) -> None:
    """Run on every rank, tsp 2: Phi-3 with LoRA on its fused ``qkv_proj`` and ``gate_up_proj``
    (and o, down) trained 2 SGD steps beside the same PeftModel on one process; the converted
    model's ``save_pretrained`` (every rank; rank 0 writes) loaded by plain PEFT onto the
    unmodified base gives the one-process PeftModel's logits (1e-10); ``merge_and_unload()``
    gives a TSP model whose full state is the reference's ``merge_and_unload()`` one (1e-12)
    and whose loss is the adapted one."""
    from peft import PeftModel

    mesh, rank = dist_pool.mesh(2), dist.get_rank()
    ref = peft_model("phi3")
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(4))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    for m, loss_of in ((ref, lambda: hf_models.reference_loss(ref, ids, ids)),
                       (model, lambda: model(**batch).loss)):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        for _ in range(2):
            loss_of().backward()
            opt.step()
            opt.zero_grad()
    model.save_pretrained(path)
    dist.barrier()
    loaded = PeftModel.from_pretrained(base_model("phi3"), path)
    with torch.no_grad():
        want, base = ref(input_ids=ids).logits, base_model("phi3")(input_ids=ids).logits
        err = relative_error(loaded(input_ids=ids).logits, want)
        adapted = hf_models.reference_loss(ref, ids, ids).item()
    assert relative_error(base, want) > 1e-3  # the adapters change the logits
    assert err <= 1e-10, f"rank {rank}: the saved fused adapter's logits off by {err:.2e}"
    merged = model.merge_and_unload()
    with torch.no_grad():
        loss = merged(**batch).loss.item()
    assert abs(loss - adapted) <= 1e-10 * adapted, (rank, loss, adapted)
    want = ref.merge_and_unload().state_dict()
    got = tsp_core.full_state_dict(merged)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, w in want.items():
        err = parity.weight_error(got[name], w)
        assert err <= 1e-12, f"rank {rank}: merged {name} off by {err:.2e}"
    dist.barrier()


def test_fused_adapter_saved_loaded_by_peft_and_merged(pools, tmp_path):
    pools.of(2).run(fused_saved_and_merged, str(tmp_path))


# --------------------------------------------------------------------- several adapters

def several_adapters(path: str, tsp: int) -> None:
    """Run on every rank at ``tsp`` (every data-parallel replica the same batch): a PeftModel
    with two named adapters ("default" on every projection, "b" added with ``add_adapter`` on
    q, v and down, rank 2), converted while "default" is active, against the same PeftModel on
    one process through the same calls: each adapter's loss after ``set_adapter`` (1e-10), 2
    SGD steps of "b" (losses and first gradients to 1e-10: "default" gets none; every weight
    after them to 1e-10), the ``requires_grad`` PEFT sets, ``disable_adapter()`` (the base's
    loss), back to "default"; ``save_pretrained`` writes both adapters, and plain PEFT loads "b"
    onto the unmodified base with the reference's logits (1e-10); two adapters active at once
    are refused at the forward."""
    from peft import LoraConfig, PeftModel

    mesh, rank = dist_pool.mesh(tsp), dist.get_rank()
    ref = peft_model("llama")
    torch.manual_seed(2)
    ref.add_adapter("b", LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                    target_modules=["q_proj", "v_proj", "down_proj"]))
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(4))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    losses = {id(ref): lambda: hf_models.reference_loss(ref, ids, ids),
              id(model): lambda: model(**batch).loss}

    def record(m) -> dict:
        """What one model does through the calls."""
        out = {"trainable": sorted(hf_name(n) for n, p in m.named_parameters()
                                   if p.requires_grad)}
        with torch.no_grad():
            out["default"] = losses[id(m)]().item()
        m.set_adapter("b")
        out["b trainable"] = sorted(hf_name(n) for n, p in m.named_parameters()
                                    if p.requires_grad)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        out["b"] = []
        for step in range(2):
            loss = losses[id(m)]()
            loss.backward()
            if step == 0:
                out["grads"] = (gather.full_grads(m) if m is model else
                                {n: p.grad.clone() for n, p in m.named_parameters()
                                 if p.grad is not None})
            opt.step()
            opt.zero_grad()
            out["b"].append(loss.item())
        with torch.no_grad(), m.disable_adapter():
            out["disabled"] = losses[id(m)]().item()
        m.set_adapter("default")
        with torch.no_grad():
            out["default again"] = losses[id(m)]().item()
        out["weights"] = (tsp_core.full_state_dict(m) if m is model else
                          {hf_name(n): t for n, t in m.state_dict().items()})
        return out

    want, got = record(ref), record(model)
    for key in ("trainable", "b trainable"):
        assert got[key] == want[key], (rank, key, got[key], want[key])
    assert all(".lora_A.b." in n or ".lora_B.b." in n for n in want["b trainable"])
    for key in ("default", "b", "disabled", "default again"):
        pairs = zip(got[key], want[key], strict=True) if key == "b" else [(got[key], want[key])]
        for a, b in pairs:
            assert abs(a - b) <= 1e-10 * abs(b), f"rank {rank} {key}: {a!r} vs {b!r}"
    assert len({want["default"], want["b"][0], want["disabled"]}) == 3  # each adapter acts
    assert set(got["grads"]) == set(want["grads"]), sorted(set(got["grads"]) ^ set(want["grads"]))
    for name, g in want["grads"].items():
        err = relative_error(got["grads"][name], g)
        assert err <= 1e-10, f"rank {rank}: gradient of {name} off by {err:.2e}"
    for name, w in want["weights"].items():
        err = parity.weight_error(got["weights"][name], w)
        assert err <= 1e-10, f"rank {rank}: {name} off by {err:.2e} after training b"
    model.save_pretrained(path)
    dist.barrier()
    loaded = PeftModel.from_pretrained(base_model("llama"), path)
    loaded.load_adapter(f"{path}/b", "b")
    loaded.set_adapter("b")
    ref.set_adapter("b")
    with torch.no_grad():
        err = relative_error(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert err <= 1e-10, f"rank {rank}: the saved adapter b's logits off by {err:.2e}"
    model.base_model.set_adapter(["default", "b"])  # PEFT sums them; TSP runs one
    with pytest.raises(NotImplementedError, match=r"2 active LoRA adapters \['default', 'b'\]"):
        model(**batch)
    dist.barrier()


@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 2)], ids=lambda v: str(v))
def test_several_adapters_switch_with_set_adapter(pools, tmp_path, world, tsp):
    pools.of(world).run(several_adapters, str(tmp_path), tsp)


# ------------------------------------------------------------------ every family of the zoo

# the families whose adapted modules TSP refuses (docs/lora.md "What is refused"), by the phrase
# each refusal names; every other family of the zoo, and Mixtral with its attention adapted,
# must train exactly
REFUSED = {"olmo2": "q/k norms span every head", "olmo3": "q/k norms span every head",
           "apertus": "TSPPlainMLP", "llama4_text": "adapt the decoder layers'",
           "gemma4": "shares K/V", "qwen3_next": "target_parameters",
           "qwen3_next-generate": "target_parameters"}


def zoo_base(family: str):
    """The zoo's ``family`` in float64, or a small Mixtral (its experts left to the MoE
    schedule: PEFT adapts only nn.Linear projections, and Mixtral's experts are fused tensors)."""
    if family != "mixtral":
        return hf_models.build(family, torch.float64)
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(**{**SMALL, "intermediate_size": 64}, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           experts_implementation="eager")
    return MixtralForCausalLM(config).double()


def zoo_step(families: list[str]) -> dict[str, str]:
    """Run on every rank: for each family, LoRA (r 4, random A and B) on every projection of
    :data:`ALL` and :data:`FUSED` it has (Phi-3's and GLM-4's fused ones), at tsp 2, against
    the same PeftModel on one process: the loss and every adapter's gradient to 1e-10, or a
    refusal by name before any collective. Each family's outcome ("exact" or the refusal's
    message)."""
    from peft import LoraConfig, get_peft_model

    mesh, out = dist_pool.mesh(2), {}
    for family in families:
        base = zoo_base(family)
        linears = {n.rpartition(".")[2] for n, m in base.named_modules()
                   if isinstance(m, torch.nn.Linear)}
        targets = [t for t in dict.fromkeys(ALL + FUSED) if t in linears]
        torch.manual_seed(1)
        ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                              target_modules=targets))
        with tsp_core.comm.track() as stats:
            try:
                model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
            except NotImplementedError as err:
                assert not dict(stats.calls), (family, dict(stats.calls))
                out[family] = str(err)
                continue
        vocab = base.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))
        want = hf_models.reference_loss(ref, ids, ids)
        want.backward()
        loss = model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
        loss.backward()
        got = gather.full_grads(model)
        rank = dist.get_rank()
        assert abs(loss.item() - want.item()) <= 1e-10 * abs(want.item()), \
            f"rank {rank} {family}: loss {loss.item()!r} vs {want.item()!r}"
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert set(got) == set(ref_grads), (family, sorted(set(got) ^ set(ref_grads)))
        for name, g in ref_grads.items():
            err = relative_error(got[name], g)
            assert err <= 1e-10, f"rank {rank} {family}: gradient of {name} off by {err:.2e}"
        out[family] = "exact"
    return out


def test_every_family_trains_exactly_or_is_refused_by_name(pools):
    families = [*hf_models.ZOO, "mixtral"]
    outcomes = pools.of(2).run(zoo_step, families)
    assert outcomes[0] == outcomes[1]
    for family, outcome in outcomes[0].items():
        if family in REFUSED:
            assert REFUSED[family] in outcome, (family, outcome)
        else:
            assert outcome == "exact", (family, outcome)


# --------------------------------------------------------------------------- LoRA dropout

DROP = 0.2


class RanksDropout(torch.nn.Module):
    """The reference's LoRA dropout: the masks TSP's ranks draw on their own tokens, put in
    place on the whole sequence. Per call one draw of the global generator; rank r's mask over
    its zigzag rows (layout of the sequence, [B, L, in] in row order) from a generator seeded
    with that draw made r's (rank_seed), kept where uniform >= p, the rest scaled by 1/(1-p)."""

    def __init__(self, p: float, size: int):
        super().__init__()
        self.p, self.size = p, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tsp_core.distributed.chunks import local_segments
        from tsp_core.layers.dropout import rank_seed

        if not self.training:
            return x
        draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())
        keep = torch.empty(x.shape, dtype=torch.bool)
        for r in range(self.size):
            rows = [t for a, b in local_segments(x.shape[1], r, self.size, "zigzag")
                    for t in range(a, b)]
            gen = torch.Generator().manual_seed(rank_seed(draw, r))
            noise = torch.rand((x.shape[0], len(rows), x.shape[2]), generator=gen)
            keep[:, rows] = noise >= self.p
        return x * keep.to(x.dtype) / (1 - self.p)


def dropout_parity(tsp: int) -> None:
    """Run on every rank: LoraConfig(lora_dropout=0.2) on every projection, training mode, 2 SGD
    steps from the same seed as the PeftModel on one process whose dropout draws the masks of
    TSP's ranks (:class:`RanksDropout`): losses and the adapters' first gradients to 1e-10 (the
    masks of the input-side and the output-side adapters, in the forward and in the backward);
    with the MLP in tiles of 16 tokens, so a tile's rows of the down adapter's mask are read."""
    mesh, rank = dist_pool.mesh(tsp), dist.get_rank()
    lora = dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=DROP,
                init_lora_weights=False)
    ref = peft_model("llama", lora)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, tile_tokens=16).train()
    for module in ref.modules():
        if hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = RanksDropout(DROP, tsp)
    ref.train()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    runs = []
    for m, loss_of in ((ref, lambda: hf_models.reference_loss(ref, ids, ids)),
                       (model, lambda: model(**batch).loss)):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        losses, grads = [], None
        for step in range(2):
            torch.manual_seed(10 + step)
            loss = loss_of()
            loss.backward()
            grads = grads or (gather.full_grads(m) if m is model else
                              {n: p.grad.clone() for n, p in m.named_parameters()
                               if p.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, grads))
    (want, want_grads), (got, got_grads) = runs
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-10 * abs(b), f"rank {rank} tsp {tsp} step {step}: {a!r} vs {b!r}"
    assert set(got_grads) == set(want_grads), sorted(set(got_grads) ^ set(want_grads))
    for name, g in want_grads.items():
        err = relative_error(got_grads[name], g)
        assert err <= 1e-10, f"rank {rank} tsp {tsp}: gradient of {name} off by {err:.2e}"


@pytest.mark.parametrize("world,tsp", [(1, 1), (2, 2), (4, 4)], ids=lambda v: str(v))
def test_lora_dropout_matches_peft_with_the_same_masks(pools, world, tsp):
    pools.of(world).run(dropout_parity, tsp)


def lora_dropout_behaviour() -> None:
    """Run on every rank, tsp 2: LoraConfig(lora_dropout=0.2) on every projection. In eval mode
    the loss is the PeftModel's on one process (1e-10); in training the input-side adapters'
    dropout zeroes about p of each rank's own inputs and scales the rest by 1/(1-p), and the
    output-side adapters' keep mask holds 0 and 1/(1-p); the adapters' gradients are the same
    under activation checkpointing (bit for bit: the masks are drawn again alike), and TRL's
    disable_dropout_in_model turns the dropout off (training loss = eval loss)."""
    from trl.trainer.utils import disable_dropout_in_model

    from tsp_core.distributed.params import local
    from tsp_core.layers.lora import TSPLoRA

    mesh, rank = dist_pool.mesh(2), dist.get_rank()
    ref = peft_model("llama", dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=DROP,
                                   init_lora_weights=False))
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)

    def seeded_loss() -> torch.Tensor:
        torch.manual_seed(7)
        return model(**batch).loss

    model.eval()
    with torch.no_grad():
        evaluated = seeded_loss().item()
        want = hf_models.reference_loss(ref.eval(), ids, ids).item()
    assert abs(evaluated - want) <= 1e-10 * abs(want), (rank, evaluated, want)

    model.train()
    layer = model.base_model.model.model.layers[0]
    seen = []
    hook = layer.self_attn.q_proj.lora_dropout["default"].register_forward_hook(
        lambda m, i, o: seen.append((i[0].detach(), o.detach())))
    train = seeded_loss()
    hook.remove()
    assert abs(train.item() - evaluated) > 1e-6, (rank, train.item(), evaluated)
    (x, y), = seen
    kept = y != 0
    rate, sigma = 1 - kept.double().mean().item(), (DROP * (1 - DROP) / x.numel()) ** 0.5
    assert abs(rate - DROP) < 5 * sigma, f"rank {rank}: input dropout rate {rate:.4f}"
    assert torch.allclose(y[kept], x[kept] / (1 - DROP), rtol=1e-15), f"rank {rank}: scale"
    adapter = layer.mlp.down_proj
    assert isinstance(adapter, TSPLoRA) and adapter.drops
    keep = adapter.schedule_tensors(x.new_zeros(2, 5, 64))[1]
    assert keep.shape == (10, adapter.in_features), keep.shape
    assert set(keep.unique().tolist()) == {0.0, 1 / (1 - DROP)}, f"rank {rank}: keep values"

    params = [p for n, p in model.named_parameters() if ".lora_" in n]
    train.backward()
    grads = [local(p.grad).clone() for p in params]
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seeded_loss().backward()
    assert all(torch.equal(local(p.grad), g) for p, g in zip(params, grads)), \
        f"rank {rank}: other gradients under activation checkpointing"
    disable_dropout_in_model(model)
    with torch.no_grad():
        assert seeded_loss().item() == evaluated, rank


def test_lora_dropout_in_eval_training_and_recompute(pools):
    pools.of(2).run(lora_dropout_behaviour)
