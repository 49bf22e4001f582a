"""Full state dicts in and out: full_state_dict -> save_pretrained -> from_pretrained reproduces the
model; a save_pretrained checkpoint loads into a TSP model with every rank reading exactly its
own slices plus the replicated norms (counted at the file handle) (the loaded model's logits and
gradients, each data-parallel replica on its own rows, equal one process on the global batch);
per-rank parameter bytes are total / D plus the replicated norms."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close, assert_same_state
from tsp_core.distributed.params import local
from tsp_core.sequence.layout import shard_sequence


def round_trip(family: str, tsp: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    ref = hf_models.build(family, torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    # the global batch: 4 rows; with data parallel (tsp 2 in the 4-process pool) each replica
    # takes its own rows, so a replica that saw another's rows, or a mean where a sum belongs,
    # shows in the logits or the gradients
    ids = torch.randint(0, ref.config.vocab_size, (4, 16),
                        generator=torch.Generator().manual_seed(3))
    dp, dp_rank = mesh.dp_size, dist.get_rank() // D
    with torch.no_grad():
        want = ref(input_ids=ids).logits

    full = tsp_core.full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        plain = hf_models.build(family, torch.float64, seed=99)
        plain.load_state_dict(full)
        plain.save_pretrained(path)
    else:
        assert full == {}
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf_models.float64_gemma_norms(loaded)  # the reference's numerics (a no-op for other families)
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, want, 1e-12, "logits after save/load")

    other = tsp_core.parallelize(hf_models.build(family, torch.float64, seed=99), mesh)
    read = tsp_core.load_full_state_dict(other, path)
    mine = ids.chunk(dp)[dp_rank]
    with torch.no_grad():
        logits = other(**tsp_core.shard_batch({"input_ids": mine}, mesh)).logits
    assert_close(logits, shard_sequence(want.chunk(dp)[dp_rank], p, D), 1e-12,
                 "logits after load_full_state_dict")
    hf_models.reference_loss(ref, ids, ids).backward()
    other(**tsp_core.shard_batch({"input_ids": mine, "labels": mine}, mesh)).loss.backward()
    got = gather.full_grads(other)
    for name, t in ref.named_parameters():
        assert_close(got[name], t.grad, 1e-10, f"grad of {name} after load_full_state_dict "
                                               f"(tsp {D}, dp {dp})")

    total = sum(t.numel() for t in ref.parameters())  # a tied weight counts once
    # replicated on every rank: the norms (Qwen3's per-head q/k norms too) and o_proj's bias
    replicated = sum(t.numel() for n, t in ref.named_parameters()
                     if "norm" in n or n.endswith("o_proj.bias"))
    local_params = sum(local(t).numel() for t in model.parameters())
    dist.barrier()
    return dict(read=read, total=total, replicated=replicated, local=local_params)


def counting_disk_reads(fn, *args) -> dict:
    """``fn(*args)`` (a dict) plus ``disk_elements``: every element tsp_core's loader took out of
    a safetensors file, counted here at the file handle (not by the loader's own counter)."""
    import safetensors
    import transformers.modeling_utils  # noqa: F401 - keeps its own safe_open, uncounted

    real, count = safetensors.safe_open, [0]

    def counted(t):
        count[0] += t.numel()
        return t

    class Slice:
        def __init__(self, s) -> None:
            self.s = s

        def get_shape(self):
            return self.s.get_shape()

        def get_dtype(self):
            return self.s.get_dtype()

        def __getitem__(self, index):
            return counted(self.s[index])

    class Handle:
        def __init__(self, h) -> None:
            self.h = h

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def __getattr__(self, name: str):
            return getattr(self.h, name)

        def get_tensor(self, name: str):
            return counted(self.h.get_tensor(name))

        def get_slice(self, name: str):
            return Slice(self.h.get_slice(name))

    safetensors.safe_open = lambda *a, **kw: Handle(real(*a, **kw))
    try:
        return {**fn(*args), "disk_elements": count[0]}
    finally:
        safetensors.safe_open = real


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2", "qwen3", "gemma3", "olmo2",
                                    "phi3"])
@pytest.mark.parametrize("tsp", [2, 4])
def test_round_trip_and_sliced_reads(pool, tmp_path, family, tsp):
    results = pool.run(counting_disk_reads, round_trip, family, tsp, str(tmp_path / "ckpt"))
    cfg = hf_models.build(family, torch.float32).config
    h = cfg.hidden_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    layers, nkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    kv_width = h + (1 if family in ("qwen2", "qwen3", "olmo2") else 0)  # weight columns + bias
    vocab_tables = 1 if cfg.tie_word_embeddings else 2

    def rows(n: int, p: int) -> int:
        """TSP rank p's rows of n (vocabulary; k/v rows when nkv < D): ceil(n / D) each, the
        last ranks' chunks shorter; stored padded to ceil(n / D), read without the padding."""
        per = -(-n // tsp)
        return max(0, min(per, n - p * per))

    kv_full, vocab_full = layers * 2 * nkv * d * kv_width, cfg.vocab_size * h * vocab_tables
    for rank, res in enumerate(results):  # every rank (tsp innermost: TSP rank = rank % tsp)
        p = rank % tsp
        sharded = res["total"] - res["replicated"] - kv_full - vocab_full
        # k and v: 1/D of the rows, also with nkv < D (a slice of a head, never a copy)
        stored = (sharded // tsp + res["replicated"] + layers * 2 * rows(nkv * d, 0) * kv_width
                  + rows(cfg.vocab_size, 0) * h * vocab_tables)
        assert res["local"] == stored, (rank, res, stored)
        # what each rank read from disk: its slices plus the replicated norms, never the whole file
        read = (sharded // tsp + res["replicated"] + layers * 2 * rows(nkv * d, p) * kv_width
                + rows(cfg.vocab_size, p) * h * vocab_tables)
        assert res["read"] == res["disk_elements"] == read, (rank, res, read)


def phi3_fused_tensors(tsp: int, root: str) -> None:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` (the TSP modules keep q/k/v and gate/up as
    separate parameters): every full state dict and checkpoint holds HF's own fused tensors, bit
    for bit, and every loader takes them."""
    import os

    from safetensors.torch import load_file

    from tsp_transformers import load_pretrained

    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("phi3", torch.float32)
    want = ref.state_dict()
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)

    def same(got: dict, what: str) -> None:
        assert_same_state(got, want, what)

    assert "model.layers.0.self_attn.qkv_proj.weight" in want
    same(tsp_core.full_state_dict(model), "full_state_dict")
    hf_dir, tsp_dir, dcp_dir = (os.path.join(root, n) for n in ("hf", "tsp", "dcp"))
    if dist.get_rank() == 0:
        ref.save_pretrained(hf_dir)
    model.save_pretrained(tsp_dir)
    dist.barrier()
    same(load_file(os.path.join(tsp_dir, "model.safetensors")), "save_pretrained")
    same(load_file(os.path.join(hf_dir, "model.safetensors")), "HF's own save_pretrained")

    # from HF's fused tensors: a dict, HF's checkpoint read slice by slice, tsp_transformers
    shards = {k: local(v).clone() for k, v in model.state_dict().items()}
    for source in (want, hf_dir):
        other = tsp_core.parallelize(hf_models.build("phi3", torch.float32, seed=5), mesh)
        tsp_core.load_full_state_dict(other, source)
        same(tsp_core.full_state_dict(other),
             f"after load_full_state_dict({type(source).__name__})")
        for k, v in other.state_dict().items():  # this rank's own shards of q, k, v, gate, up
            assert torch.equal(local(v), shards[k]), k
    same(tsp_core.full_state_dict(load_pretrained(hf_dir, mesh=mesh, dtype=torch.float32)),
         "tsp_transformers.load_pretrained")

    # a DCP checkpoint: one tensor per fused name, loadable into the plain model bit for bit
    tsp_core.save_checkpoint(dcp_dir, model)
    plain = hf_models.build("phi3", torch.float32, seed=5)
    tsp_core.load_checkpoint(dcp_dir, plain)
    same(plain.state_dict(), "a DCP checkpoint loaded into the plain model")

    # a fused tensor of the wrong shape is refused under its own name; the one-file optimizer
    # state (keyed by parameter index) is refused, pointing to save_checkpoint
    bad = {**want, "model.layers.0.mlp.gate_up_proj.weight": want[
        "model.layers.0.mlp.gate_up_proj.weight"][:-2]}
    with pytest.raises(ValueError, match=r"gate_up_proj\.weight has shape \(254, 64\) in the "
                                         r"state dict, \(256, 64\) in the model"):
        tsp_core.load_full_state_dict(other, bad)
    from tsp_core.state.resharding import full_optimizer_state_dict

    with pytest.raises(NotImplementedError, match=r"keeps each fused Hugging Face tensor "
                                                  r"\(gate_up_proj\.weight, qkv_proj\.weight\) "
                                                  r"as several parameters"):
        full_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    dist.barrier()


@pytest.mark.parametrize("tsp", [2, 4])
def test_phi3_fused_tensors_bit_identical(pool, tmp_path, tsp):
    pool.run(phi3_fused_tensors, tsp, str(tmp_path))


def same_config_files(tsp_dir: str, hf_dir: str, what: str) -> None:
    """``config.json`` and ``generation_config.json`` of ``tsp_dir`` are the ones Hugging Face's
    ``save_pretrained`` of the unmodified model wrote to ``hf_dir``, field by field."""
    import json
    import os

    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(tsp_dir, name)) as f:
            got = json.load(f)
        with open(os.path.join(hf_dir, name)) as f:
            want = json.load(f)
        assert sorted(got) == sorted(want), f"{what} {name}: fields {sorted(set(got) ^ set(want))}"
        for field in want:
            assert got[field] == want[field], \
                f"{what} {name}: {field} is {got[field]!r}, Hugging Face writes {want[field]!r}"


def families_bit_identical(tsp: int, root: str) -> None:
    """Every family: full_state_dict and save_pretrained of a parallelized model are the
    unmodified model's state dict bit for bit (names, dtypes, values), and load_full_state_dict
    of it into another parallelized model gives it back bit for bit. The config files are the
    ones Hugging Face's save_pretrained writes, field by field (``dtype`` and ``architectures``
    included), also for bfloat16 and float64 weights."""
    import os

    from safetensors.torch import load_file

    mesh = dist_pool.mesh(tsp)
    for family, dtype in (("qwen3", torch.bfloat16), ("llama-tied", torch.bfloat16),
                          ("phi3", torch.float64)):
        ref = hf_models.build(family, dtype)
        tsp_dir, hf_dir = (os.path.join(root, f"{family}-{dtype}-{n}") for n in ("tsp", "hf"))
        tsp_core.parallelize(copy.deepcopy(ref), mesh).save_pretrained(tsp_dir)
        if dist.get_rank() == 0:
            ref.save_pretrained(hf_dir)
        dist.barrier()
        same_config_files(tsp_dir, hf_dir, f"{family} {dtype}")
    for family in hf_models.FAMILIES:
        ref = hf_models.build(family, torch.float32)
        want = ref.state_dict()
        tied = {k for k in want if k.endswith("lm_head.weight")} if ref.config.tie_word_embeddings \
            else set()
        model = tsp_core.parallelize(copy.deepcopy(ref), mesh)

        def same(got: dict, what: str, skip: frozenset = frozenset(), *,
                 want: dict = want, family: str = family) -> None:
            assert_same_state(got, want, f"{family} {what}", skip)

        same(tsp_core.full_state_dict(model), "full_state_dict")
        path = os.path.join(root, family)
        model.save_pretrained(path)
        dist.barrier()
        # a tied LM head is stored once, under the embedding's name, as HF's save_pretrained does
        same(load_file(os.path.join(path, "model.safetensors")), "save_pretrained", tied)
        if dist.get_rank() == 0:
            ref.save_pretrained(path + "-hf")
        dist.barrier()
        same_config_files(path, path + "-hf", family)
        other = tsp_core.parallelize(hf_models.build(family, torch.float32, seed=5), mesh)
        tsp_core.load_full_state_dict(other, want)
        same(tsp_core.full_state_dict(other), "after load_full_state_dict")
    dist.barrier()


def test_every_family_round_trips_bit_identical(pool, tmp_path):
    pool.run(families_bit_identical, 4, str(tmp_path))


def load_never_half_applies(tsp: int, root: str) -> list[str]:
    """A load that does not fit (its last tensor the wrong shape, missing or of another kind of
    dtype, or a tensor the model does not have; from a dict or from a file) raises on every rank,
    naming the tensor (and both shapes), and leaves every rank's shards bit for bit as they
    were: nothing is copied before everything is checked. The good load then changes them."""
    import os

    from safetensors.torch import save_file

    from tsp_core.state.checkpoint import check_full_state_dict

    mesh = dist_pool.mesh(tsp)
    want = hf_models.build("llama", torch.float64).state_dict()
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64, seed=5), mesh)
    last = list(want)[-1]
    assert last == "lm_head.weight", last  # the last tensor a load reaches (the last module)
    bad_file = os.path.join(root, "bad")
    if dist.get_rank() == 0:
        os.makedirs(bad_file)
        save_file({**want, last: want[last][:-1]}, os.path.join(bad_file, "model.safetensors"))
    dist.barrier()
    cases = [
        ({**want, last: want[last][:-1]},
         r"lm_head\.weight has shape \(95, 64\) in the state dict, \(96, 64\) in the model"),
        (bad_file, r"lm_head\.weight has shape \(95, 64\) in the checkpoint .*bad, \(96, 64\) in "
                   r"the model"),
        ({k: v for k, v in want.items() if k != last},
         r"1 tensors missing from the state dict \(e.g. \['lm_head\.weight \(96, 64\)'\]\)"),
        ({**want, last: want[last].long()},
         r"lm_head\.weight holds integer values in the state dict, the model's lm_head\.weight "
         r"is torch.float64"),
        ({**want, "lm_head.bias": want[last][:, 0]},
         r"1 tensors this model does not have \(e.g. \['lm_head\.bias'\]\)"),
    ]
    def every_tensor() -> dict[str, torch.Tensor]:
        """Every parameter and buffer (non-persistent ones too) and the state dict's entries."""
        return {**dict(model.named_parameters()), **dict(model.named_buffers()),
                **model.state_dict()}

    before = {k: local(v).clone() for k, v in every_tensor().items()}
    assert any("inv_freq" in k for k in before), sorted(before)  # the rotary buffers are in
    msgs = []
    for source, pattern in cases:
        for load in (tsp_core.load_full_state_dict, check_full_state_dict):
            with pytest.raises(ValueError, match=pattern) as info:
                load(model, source)
            msgs.append(str(info.value))
            now = every_tensor()
            assert now.keys() == before.keys(), sorted(now.keys() ^ before.keys())
            for k, v in now.items():
                assert torch.equal(local(v), before[k]), \
                    f"{load.__name__} raised ({pattern}) after changing {k} " \
                    f"(rank {dist.get_rank()})"
    check_full_state_dict(model, want)
    # what from_pretrained ignores too: a rotary buffer older checkpoints saved per layer
    check_full_state_dict(model, {**want, "model.layers.0.self_attn.rotary_emb.inv_freq":
                                  torch.ones(12, dtype=torch.float64)})
    tsp_core.load_full_state_dict(model, want)  # the good one changes every shard but the norms
    changed = {k for k, v in model.state_dict().items() if not torch.equal(local(v), before[k])}
    assert changed == {k for k in model.state_dict() if "norm" not in k}, \
        sorted(set(model.state_dict()) - changed)
    got = tsp_core.full_state_dict(model)
    assert all(torch.equal(got[k], t) for k, t in want.items())
    dist.barrier()
    return msgs


def test_load_never_half_applies(pool, tmp_path):
    # tsp 2 x data parallel 2: every rank checks its own shards and raises the same error
    per_rank = pool.run(load_never_half_applies, 2, str(tmp_path))
    assert all(m == per_rank[0] for m in per_rank), per_rank
