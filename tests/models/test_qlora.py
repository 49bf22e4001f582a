"""QLoRA under TSP (tsp_core/layers/nf4.py, tsp_core/models/qlora.py, docs/lora.md "QLoRA"): a
PeftModel over a tiny Llama (grouped-query attention) saved in float32 and loaded 4-bit NF4 by
bitsandbytes, parallelized, against the same PeftModel loaded the same way on one process
(unmodified PEFT, Hugging Face and bitsandbytes ``Linear4bit``), on every rank, at tsp 2 and 4:
every rank's dequantized NF4 shard equal to bitsandbytes' dequantized full weight's slice bit for
bit; the base's loss (``disable_adapter()``); losses of 3 AdamW steps, the adapters' first
gradients compared directly, the adapters after the steps; the packed base bytes unchanged; the
bytes each attention round broadcasts and each MLP ring hop carries in the first step: the packed
shards plus their absmax, by a formula written here. The same at dp 2 x tsp 2 (each replica its
own rows, the reference the whole batch: the adapters' gradients summed over the replicas).
Double quantization at tsp 2: the shards bit for bit, one step's loss and gradients. bf16
compute (a bf16 base, ``bnb_4bit_compute_dtype=torch.bfloat16``) at tsp 2: within bf16's
precision of the one-process bf16 model and computed in bf16. 8-bit, a shard that cuts a
quantization block, fewer key/value heads than ranks, a 4-bit model without adapters and
merging into the 4-bit base are refused by name on every rank before any collective."""

from __future__ import annotations

import contextlib
import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, parity, precision
from tests.support.reference import relative_error

pytest.importorskip("bitsandbytes")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# head_dim 32: every shard of every projection is whole blocks of 64 at tsp 2 (hidden 128) and,
# for WIDE, at tsp 4 (o_proj's 64 columns a rank)
SMALL = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
WIDE = dict(SMALL, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
            num_hidden_layers=1)
BLOCK = 64  # bitsandbytes' NF4 block: one float32 absmax per 64 weights
# the adapters after 3 AdamW steps at lr 1e-3, absolute. The shards dequantize bit for bit, but
# TSP sums in float32 in other orders (o's and down's products round by round, attention and the
# input gradients round by round, each adapter's weight gradient over each rank's tokens), so
# the first gradients agree to ~2e-6 of their largest element; AdamW's first update
# lr g / (|g| + eps) turns a difference dg at an element whose |g| is near eps (1e-8) into
# lr eps dg / (|g| + eps)^2. Measured at tsp 2: the worst element has g = 4.5e-8 and dg = 3e-9
# (1.0e-5 predicted, 9.2e-6 seen). The one-process reference against itself with TSP's chunked
# sums (o/down products and q/k/v/gate/up input gradients in 2 chunks, adapter weight gradients
# over each rank's zigzag tokens) moves by 1.7e-6 the same way (g = 2.6e-8 there), and TSP with
# the float32 base unquantized against plain PEFT by 1.6e-6 (the same element, g = 5.0e-8, dg =
# 6e-10; first gradients 1.7e-6, here 2.0e-6): float32 order alone; no order TSP can choose
# reproduces one GEMM's. A wrong shard or a missing term moves the adapters by lr or more.
ADAMW_TOL = 3e-5


def save_base(path: str, config: dict, dtype: torch.dtype = torch.float32) -> None:
    """A random-init Llama of ``config`` saved to ``path`` in ``dtype`` (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).to(dtype).save_pretrained(path)


def qlora_model(path: str, quant: dict | None = None, dtype: torch.dtype = torch.float32):
    """The saved Llama loaded in ``dtype`` 4-bit NF4 (float32 compute) with ``quant``
    BitsAndBytesConfig fields instead, r=4 LoRA on the seven projections, A and B random (PEFT
    keeps them float32 over a bf16 base); in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    config = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                  bnb_4bit_compute_dtype=torch.float32)
    base = LlamaForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=BitsAndBytesConfig(**(quant or config)))
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
    return get_peft_model(base, lora).train()


def adapters(model) -> dict[str, torch.Tensor]:
    """Every LoRA matrix by name (a TSP one is replicated: its local tensor is the whole)."""
    from tsp_core.distributed.params import local

    return {n: local(p).detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def grads(model) -> dict[str, torch.Tensor]:
    from tsp_core.distributed.params import local

    return {n: local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def replica_shard(mesh, rows: int = 2):
    """What this rank's TSP model takes of a global batch: its data-parallel replica's ``rows``
    rows, sharded over its TSP group (the one-process reference takes the whole batch)."""
    replica = mesh.device_mesh.get_coordinate()[0]
    mine = slice(replica * rows, (replica + 1) * rows)

    def shard(batch: dict) -> dict:
        return tsp_core.shard_batch({k: v[mine] for k, v in batch.items()}, mesh)
    return shard


def run(model, data, optimizer, shard=None) -> dict:
    """Losses, first gradients and final adapters of ``model`` over ``data`` (``shard``: the
    batch as a TSP model takes it; then also the first step's collectives, ``log``)."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses, first, log = [], None, None
    for ids, labels in data:
        batch = {"input_ids": ids, "labels": labels}
        with tsp_core.comm.track() if shard else contextlib.nullcontext() as stats:
            loss = model(**(shard(batch) if shard else batch)).loss
            loss.backward()
        log = stats.log if log is None and shard else log
        first = grads(model) if first is None else first
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grads=first, adapters=adapters(model), log=log)


def nf4_holders(model) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """Each NF4 weight holder of a converted model by its projection's path, with its TSP
    module (the host whose shard_spec cut it)."""
    from tsp_core.layers.nf4 import NF4Weight

    out = {}
    for path, m in model.named_modules():
        if isinstance(m, NF4Weight):  # behind its LoRA adapter: the adapter's base_layer
            place = path.removesuffix(".base_layer")
            host_path, _, name = place.rpartition(".")
            out[place] = (m, model.get_submodule(host_path), name)
    return out


def check_shards_exact(model, ref) -> int:
    """Every rank's dequantized shard equals bitsandbytes' dequantized full weight's slice, bit
    for bit; the number of quantized projections."""
    import bitsandbytes.functional as bnbf

    rank = tsp_core.get_mesh(model).rank
    holders = nf4_holders(model)
    assert len(holders) == 7 * model.config.num_hidden_layers, sorted(holders)
    for path, (holder, host, name) in holders.items():
        linear = ref.get_submodule(path)
        linear = getattr(linear, "base_layer", linear)
        full = bnbf.dequantize_4bit(linear.weight.data, linear.weight.quant_state)
        spec = host.shard_spec(f"{name}.weight", rank)
        want = full.narrow(spec.dim, spec.start, spec.length)
        assert torch.equal(holder.dequantized(), want), f"rank {rank}: {path} shard differs"
    return len(holders)


def qlora_parity(path: str, tsp: int, config: dict) -> dict:
    """Run on every rank: 3 AdamW steps of the converted QLoRA PeftModel against the
    one-process one (2 rows a data-parallel replica, the reference all of them): losses to
    1e-6, first adapter gradients to 1e-5 (relative), adapters after the steps to
    :data:`ADAMW_TOL`; the dequantized shards and the packed bytes; what was measured."""
    mesh, rank = dist_pool.mesh(tsp), dist.get_rank()
    data = parity.batches(SMALL["vocab_size"], 2 * mesh.dp_size, 32, 3, middle_ignored=True)
    shard = replica_shard(mesh)
    worst = dict(loss=0.0, grad=0.0, adapter=0.0)
    losses = []
    for optimizer in (partial(torch.optim.AdamW, lr=1e-3),):
        ref = qlora_model(path)
        model = tsp_core.parallelize(qlora_model(path), mesh)
        check_shards_exact(model, ref)
        ids, labels = data[0]
        with ref.disable_adapter(), model.disable_adapter():  # the 4-bit base alone
            a = model(**shard({"input_ids": ids, "labels": labels})).loss
            b = ref(input_ids=ids, labels=labels).loss
        assert abs(a.item() - b.item()) <= 1e-6, f"rank {rank}: base loss {a.item()} vs {b.item()}"
        packed = {p: (h.weight.clone(), h.weight_absmax.clone())
                  for p, (h, _, _) in nf4_holders(model).items()}
        want = run(ref, data, optimizer)
        got = run(model, data, optimizer, shard)
        traffic = check_packed_traffic(got["log"], config, tsp)
        what = f"rank {rank}, dp {mesh.dp_size} x tsp {tsp}, {optimizer.func.__name__}"
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            worst["loss"] = max(worst["loss"], abs(a - b))
            assert abs(a - b) <= 1e-6, f"{what}, step {step}: loss {a!r} vs {b!r}"
        assert set(got["grads"]) == set(want["grads"]), (what, sorted(got["grads"]))
        for name, g in want["grads"].items():
            err = relative_error(got["grads"][name], g)
            worst["grad"] = max(worst["grad"], err)
            assert err <= 1e-5, f"{what}: gradient of {name} off by {err:.2e}"
        for name, w in want["adapters"].items():
            err = (got["adapters"][name] - w).abs().max().item()
            worst["adapter"] = max(worst["adapter"], err)
            assert err <= ADAMW_TOL, f"{what}: {name} off by {err:.2e} after 3 steps"
        for p, (h, _, _) in nf4_holders(model).items():
            assert torch.equal(h.weight, packed[p][0]) and torch.equal(
                h.weight_absmax, packed[p][1]), f"{what}: base bytes of {p} changed"
        losses += got["losses"]
    return dict(losses=losses, worst=worst, traffic=traffic)


# (world size, tsp size, model): (4, 2) is dp 2 x tsp 2
@pytest.mark.parametrize("world,tsp,config", [(2, 2, SMALL), (4, 4, WIDE), (4, 2, SMALL)],
                         ids=["tsp2", "tsp4", "dp2xtsp2"])
def test_qlora_matches_bitsandbytes_on_one_process(pools, tmp_path, world, tsp, config):
    save_base(str(tmp_path), config)
    figures = pools.of(world).run(qlora_parity, str(tmp_path), tsp, config)
    parity.assert_same_losses(figures)
    print("worst", figures[0]["worst"], "bytes", figures[0]["traffic"])


# ------------------------------------------------------------------------ collective bytes

def nf4_bytes(elements: int) -> int:
    """Bytes of an NF4 shard of ``elements`` weights: two codes a byte, a float32 per block."""
    return elements // 2 + 4 * (elements // BLOCK)


def check_packed_traffic(log: list[tuple[str, float]], config: dict, D: int) -> dict:
    """One step's collectives (``log``) at tsp ``D``: each attention round broadcasts its
    owner's packed q, k, v, o shards plus their absmax, each MLP ring hop carries the packed
    gate, up, down shards plus theirs, and no float shard of them travels (docs/design.md
    "QLoRA"). The per-round and per-hop bytes."""
    h, F_, nq, nkv, layers = (config[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "num_hidden_layers"))
    d = h // nq
    round_bytes = sum(nf4_bytes(n // D) for n in (nq * d * h, 2 * nkv * d * h, h * nq * d))
    hop_bytes = nf4_bytes(3 * F_ * h // D)  # three projections of F/D rows or columns
    broadcasts = [b for k, b in log if k == "broadcast"]
    assert broadcasts == [(D - 1) / D * round_bytes] * (2 * D * layers), broadcasts
    hops = [b for k, b in log if k == "ring_pass"]
    assert hops.count(hop_bytes) == 2 * (D - 1) * layers, hops  # forward, backward; no grads
    assert 4 * 3 * F_ * h // D not in hops, hops
    return dict(round=round_bytes, hop=hop_bytes, float_round=4 * (2 * nq + 2 * nkv) * d * h // D)


# ------------------------------------------------------------------- double quantization

DOUBLE = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
              bnb_4bit_use_double_quant=True)


def double_quant_step(path: str) -> dict:
    """Run on every rank: a base loaded with double quantization (the absmax 8-bit in blocks of
    256) at tsp 2 against the same on one process: the dequantized shards bit for bit (TSP keeps
    the absmax as bitsandbytes dequantizes them), one SGD step's loss (1e-6) and adapter
    gradients (1e-5); each round moves float32 absmax."""
    mesh, rank = dist_pool.mesh(2), dist.get_rank()
    ref, model = qlora_model(path, DOUBLE), qlora_model(path, DOUBLE)
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.quant_state \
        .nested
    model = tsp_core.parallelize(model, mesh)
    check_shards_exact(model, ref)
    data = parity.batches(SMALL["vocab_size"], 2, 32, 1, middle_ignored=True)
    sgd = partial(torch.optim.SGD, lr=0.5)
    want = run(ref, data, sgd)
    got = run(model, data, sgd, partial(tsp_core.shard_batch, mesh=mesh))
    assert abs(got["losses"][0] - want["losses"][0]) <= 1e-6, (rank, got["losses"], want["losses"])
    for name, g in want["grads"].items():
        err = relative_error(got["grads"][name], g)
        assert err <= 1e-5, f"rank {rank}: gradient of {name} off by {err:.2e}"
    return check_packed_traffic(got["log"], SMALL, 2)


def test_double_quantization_dequantizes_exactly(pools, tmp_path):
    save_base(str(tmp_path), SMALL)
    pools.of(2).run(double_quant_step, str(tmp_path))


# ------------------------------------------------------------------------------ bf16 compute

BF16 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def lora_state(model) -> dict[str, torch.Tensor]:
    """A PeftModel's adapters as its state dict names them (copies)."""
    return {n: t.clone() for n, t in model.state_dict().items() if ".lora_" in n}


def same_adapters(model, lora: dict[str, torch.Tensor]):
    """``model`` with the adapters ``lora``: PEFT rounds them into bf16 (keeping float32) when
    the compute dtype is bf16, so a float32-compute model's differ from the start."""
    missing = set(lora) - set(model.state_dict())
    assert not missing, sorted(missing)
    model.load_state_dict(lora, strict=False)
    return model


def bf16_step(path: str) -> dict:
    """Run on every rank: the base saved in bf16 and loaded 4-bit in bf16 with bf16 compute
    (what QLoRA users run; PEFT keeps the adapters float32) at tsp 2 against the same on one
    process, and the same codes and adapters computed in float32 (loaded in float32: the same
    bf16 values): the shards bit for bit; two SGD steps' losses within 2 G and the adapters'
    first gradients within G of bf16 one process's (tests/support/precision.py: two bf16 runs
    rounding in different places differ by ~6 u), and at least 0.1 u from float32's (it
    computed in bf16). The base loaded in float32 with bf16 compute: TSP warns that it computes
    in float32, and does (first gradients within 1e-5 of float32's). The figures, in u."""
    mesh, rank = dist_pool.mesh(2), dist.get_rank()
    data = parity.batches(SMALL["vocab_size"], 2, 32, 2, middle_ignored=True)
    sgd = partial(torch.optim.SGD, lr=0.5)
    ref = qlora_model(path, BF16, torch.bfloat16)
    lora = lora_state(ref)
    exact = run(same_adapters(qlora_model(path), lora), data, sgd)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = tsp_core.parallelize(qlora_model(path, BF16, torch.bfloat16), mesh)
    assert not [w for w in seen if "bnb_4bit_compute_dtype" in str(w.message)], seen
    check_shards_exact(model, ref)
    want = run(ref, data, sgd)
    got = run(model, data, sgd, replica_shard(mesh))
    assert sorted(got["grads"]) == sorted(want["grads"]), (rank, sorted(got["grads"]))
    grads = precision.relative_error(got["grads"], want["grads"])
    off = precision.relative_error(got["grads"], exact["grads"])
    assert grads <= precision.G, f"rank {rank}: first gradients {grads / precision.U:.2f} u off"
    assert off >= 0.1 * precision.U, f"rank {rank}: gradients {off:.1e} from float32's: not bf16"
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], want["losses"], strict=True))
    assert worst <= 2 * precision.G, f"rank {rank}: losses {got['losses']} vs {want['losses']}"
    # loaded in float32 with bf16 compute: TSP computes in float32 (the model's dtype), says so
    with pytest.warns(UserWarning, match=r"bnb_4bit_compute_dtype=torch.bfloat16 differs from "
                                         r"the dtype the base was loaded in \(torch.float32\)"):
        model = tsp_core.parallelize(same_adapters(qlora_model(path, BF16), lora), mesh)
    f32 = precision.relative_error(run(model, data[:1], sgd, replica_shard(mesh))["grads"],
                                   exact["grads"])
    assert f32 <= 1e-5, f"rank {rank}: float32-loaded, bf16 compute: {f32:.1e} from float32's"
    return dict(grads=grads / precision.U, from_float32=off / precision.U,
                losses=worst / precision.U, float32_loaded=f32)


def test_bf16_compute_within_bf16_precision(pools, tmp_path):
    save_base(str(tmp_path), SMALL, torch.bfloat16)
    figures = pools.of(2).run(bf16_step, str(tmp_path))
    print("u:", figures)


# ------------------------------------------------------------------------------- refusals

def refusals(path: str, narrow: str, mqa: str) -> list[str]:
    """Run on every rank: each unsupported quantized setup raises on this rank, naming it,
    before any collective. The messages."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    nf4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    cases = [
        (lambda: qlora_model(path, dict(load_in_8bit=True)), "8-bit"),
        (lambda: qlora_model(narrow), "does not hold whole NF4 blocks of 64"),
        (lambda: qlora_model(mqa), "fewer key/value heads (1) than ranks (2)"),
        (lambda: LlamaForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=BitsAndBytesConfig(**nf4)),
         "has no LoRA adapters"),
    ]
    cases.append((lambda: tsp_core.parallelize(qlora_model(path), dist_pool.mesh(2))
                  .merge_and_unload, "merging into a torch.uint8 base (4-bit NF4)"))
    messages = []
    for build, name in cases:
        model = build()
        with tsp_core.comm.track() as stats, pytest.raises(NotImplementedError) as err:
            model() if callable(model) and not isinstance(model, torch.nn.Module) else \
                tsp_core.parallelize(model, dist_pool.mesh(2))
        assert not dict(stats.calls), dict(stats.calls)  # before any collective
        assert name in str(err.value), (name, str(err.value))
        messages.append(str(err.value))
    dist.barrier()
    return messages


def test_unsupported_quantized_setups_are_refused_by_name(pools, tmp_path):
    save_base(str(tmp_path / "small"), SMALL)
    # hidden 64: o_proj's 32 columns a rank at tsp 2 cut its blocks of 64
    save_base(str(tmp_path / "narrow"), dict(SMALL, hidden_size=64, num_attention_heads=2))
    save_base(str(tmp_path / "mqa"), dict(SMALL, num_key_value_heads=1))  # sliced K/V rows
    messages = pools.of(2).run(refusals, *(str(tmp_path / n) for n in ("small", "narrow", "mqa")))
    assert messages[0] == messages[1]
    print("\n".join(messages[0]))
