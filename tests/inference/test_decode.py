"""Generation on a TSP model (tsp_core.inference.decode, tsp_core.inference.generation) against the
unmodified Hugging Face model in one process: greedy tokens identical to HF ``generate`` and every
step's logits equal to HF's float64 logits to 1e-8 (left-padded batches of prompts of 7, 33 and 100
tokens; Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3, Granite, OLMo 2, Phi-3, OLMo 3, Seed-OSS,
EXAONE 4, SmolLM3 and GLM-4, each family's features switched on (tests/support/hf_models.py); world
sizes 2 and 4); sampling draws the same tokens as HF with the same random state; every rank's KV
cache, measured by MemTracker, is 1/D of HF's cache measured the same way; decode issues only the
small per-layer activation collectives, no weight collective. A PEFT PeftModel with LoRA adapters
against the same PeftModel on one process (float64, tsp 2 and 4: tokens, step logits to 1e-10,
``disable_adapter()``, ``set_adapter``), and a QLoRA one (NF4 base, tsp 2, 1e-6)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, hf_models, reference
from tests.support.reference import assert_close
from tsp_core import comm
from tsp_core.inference.decode import decode_step, prefill


def left_padded(vocab: int, lengths: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random prompts of the given lengths, left-padded with token 0 (mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, S - n:] = 1
    return ids, mask


def reference_logits(ref, seqs: torch.Tensor, mask: torch.Tensor, prompt: int) -> torch.Tensor:
    """HF's float64 logits of every generation step [steps, B, V], teacher-forced on the generated
    sequences (one forward; generate itself returns float32 logits)."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], seqs.shape[1] - prompt)], dim=1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    logits = ref(input_ids=seqs, attention_mask=full_mask, position_ids=pos).logits
    return logits[:, prompt - 1:-1].transpose(0, 1)


def hf_greedy(ref, ids: torch.Tensor, mask: torch.Tensor,
              new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's greedy tokens and their float64 step logits (:func:`reference_logits`), computed on
    rank 0 alone and sent to every rank: one process's numbers, the same on each, without the
    other ranks repeating the work on the same cores."""
    out = [None]
    if dist.get_rank() == 0:
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        out = [(want, reference_logits(ref, want, mask, ids.shape[1]).detach())]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def greedy_parity(family: str, tsp: int, lengths: list[int], new: int) -> list[list[int]]:
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build(family, torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = left_padded(ref.config.vocab_size, lengths)
    want, ref_logits = hf_greedy(ref, ids, mask, new)
    got, steps = tsp_core.generate(model, ids, new, attention_mask=mask, return_logits=True)
    assert torch.equal(got, want), f"{family} D={tsp}: tokens differ\n{got}\n{want}"
    assert len(steps) == want.shape[1] - ids.shape[1]
    for t, step in enumerate(steps):
        assert_close(step, ref_logits[t], 1e-8, f"{family} D={tsp} step {t} logits")
    if family == "llama":  # the Hugging Face API on the parallelized model gives the same
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=new), want)
    return got.tolist()


@pytest.mark.parametrize("tsp", [2, 4])
def test_greedy_matches_hf(pools, tsp):
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite",
                   "olmo2", "phi3", "olmo3", "seed_oss", "exaone4", "smollm3", "glm4",
                   "ernie4_5", "apertus", "hunyuan_v1_dense", "gemma4"):
        outs = pools.of(tsp).run(greedy_parity, family, tsp, [7, 33, 100], 32)
        assert all(o == outs[0] for o in outs), f"{family}: ranks generated different tokens"
    # Hugging Face's Llama 4 scales queries by the position in the left-padded row (13 pad tokens
    # move this model's logits by 8.7e-4 from the prompt's alone); TSP by the prompt's own
    # position, as the prompt alone: prompts of one length, no padding
    outs = pools.of(tsp).run(greedy_parity, "llama4_text", tsp, [33, 33], 32)
    assert all(o == outs[0] for o in outs), "llama4_text: ranks generated different tokens"


def held_bytes(make) -> tuple[int, int]:
    """Bytes held by the object ``make()`` returns, two ways, never by the object's own count:
    MemTracker's bytes alive with it minus those alive once it is dropped (cyclic garbage
    collected before both readings), and the bytes of the distinct tensor storages reachable from
    it (a view into a larger buffer counts the whole buffer)."""
    import gc

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        obj = make()
        gc.collect()  # garbage from building it (reference cycles) is not the object's
        with_it = sum(s["Total"] for s in tracker.get_tracker_snapshot().values())
        reachable = reachable_bytes(obj)
        del obj
        gc.collect()
        without = sum(s["Total"] for s in tracker.get_tracker_snapshot().values())
    return with_it - without, reachable


def reachable_bytes(obj) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (a view into a larger buffer
    counts the whole buffer; modules and classes are not followed)."""
    import gc

    storages, seen, todo = {}, set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (torch.nn.Module, type)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        else:
            todo += gc.get_referents(o)
    return sum(storages.values())


def kv_cache_bytes(tsp: int) -> dict:
    """Bytes this rank's cache holds after a 1,000-token prefill (measured by MemTracker, beside
    HF's whole cache measured the same way); then decoding keeps the ranks' slot counts within
    one of each other. A 7-token prompt at D=4 (shorter than 2D: padded to 8, the pad slot
    dropped) still generates HF's tokens."""
    from transformers import DynamicCache

    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("llama", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, _ = left_padded(ref.config.vocab_size, [1000])

    def hf_cache() -> DynamicCache:
        cache = DynamicCache(config=ref.config)
        with torch.no_grad():
            ref(input_ids=ids, past_key_values=cache, use_cache=True)
        return cache

    full, mine = held_bytes(hf_cache), held_bytes(lambda: prefill(model, ids)[1])
    _, cache = prefill(model, ids)
    tok = torch.tensor([5])
    for step in range(2 * tsp + 1):
        decode_step(model, cache, tok, cache.lengths + step)
        assert max(cache.counts) - min(cache.counts) <= 1, cache.counts
    assert cache.counts[mesh.rank] == cache.length and sum(cache.counts) == 1000 + 2 * tsp + 1
    short, _ = left_padded(ref.config.vocab_size, [7], seed=5)
    assert torch.equal(model.generate(short, max_new_tokens=12),
                       ref.generate(short, max_new_tokens=12, do_sample=False))
    return {"rank_bytes": mine[1], "rank_tracked": mine[0], "hf_bytes": full[1],
            "hf_tracked": full[0]}


@pytest.mark.parametrize("tsp", [2, 4])
def test_kv_cache_is_one_dth_per_rank(pools, tsp):
    out = pools.of(tsp).run(kv_cache_bytes, tsp)
    c = hf_models.build("llama", torch.float64).config
    # float64 K and V of every layer and key/value head: HF's 1000 tokens, each rank's 1000 / D
    # (1000 splits evenly) plus its slot table (an int64 position per slot, a length per row)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 8
    # MemTracker may also see a few hundred bytes that gloo releases between its two readings
    # (seen twice in full-suite runs: 960 and 1152 bytes on rank 1, never reachable from the
    # cache): it is held to the exact figure within 2 KiB, the storages reachable from the cache
    # exactly; a cache of views into buffers twice their size is off by ~500 KiB in both
    for rank, o in enumerate(out):  # every rank
        want = 1000 // tsp * (kv + 8) + 8
        assert o["hf_bytes"] == 1000 * kv and 0 <= o["hf_tracked"] - 1000 * kv < 2048, (rank, o)
        assert o["rank_bytes"] == want and 0 <= o["rank_tracked"] - want < 2048, (rank, o)


def decode_collectives(tsp: int) -> list:
    """Per decoded token exactly: an all-reduce of the embedded rows, per layer an all-gather of
    the new token's q/k/v, an all-to-all of the partial attention (output + LSE), two all-reduces
    of [B, hidden]; then an all-gather of the vocabulary logits. No broadcast or ring pass (no
    weight moves), and the bytes are those of [B, ...] activations."""
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("qwen2", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    c = ref.config
    B, h, d = 2, c.hidden_size, c.hidden_size // c.num_attention_heads
    nq = c.num_attention_heads // tsp
    # key/value rows per rank: its heads, or (fewer heads than ranks) its 1/D slice of them
    kv_rows = -(-c.num_key_value_heads * d // tsp)
    ids, mask = left_padded(c.vocab_size, [9, 20])
    with comm.track() as pre:
        _, cache = prefill(model, ids, mask)
    assert pre.calls["broadcast"] == tsp * c.num_hidden_layers  # prefill is the TSP forward
    frac = (tsp - 1) / tsp
    per_layer = [("all_gather", tsp * B * (nq * d + 2 * kv_rows) * 8 * frac),
                 ("all_to_all", B * c.num_attention_heads * (d + 1) * 8 * frac),
                 ("all_reduce", 2 * B * h * 8 * frac), ("all_reduce", 2 * B * h * 8 * frac)]
    vocab = -(-c.vocab_size // tsp) * tsp
    want = ([("all_reduce", 2 * B * h * 8 * frac)] + per_layer * c.num_hidden_layers
            + [("all_gather", B * vocab * 8 * frac)])
    weight_bytes = sum(p.to_local().numel() * 8 for p in model.model.layers[0].parameters())
    tok = torch.tensor([4, 7])
    for step in range(3):
        with comm.track() as s:
            decode_step(model, cache, tok, cache.lengths + step)
        assert s.log == want, f"step {step}: {s.log}\nexpected {want}"
        assert s.total_bytes < weight_bytes / 4
    return s.log


@pytest.mark.parametrize("tsp", [2, 4])
def test_decode_moves_no_weights(pools, tsp):
    pools.of(tsp).run(decode_collectives, tsp)


def sampling_and_stops(tsp: int) -> list:
    """Sampling (temperature, top-k, top-p) draws HF's tokens from the same random state: with a
    seed, and through model.generate from the global generator even when the ranks' global states
    differ (rank 0's is used). EOS stops rows like HF (finished rows padded), stop tokens too."""
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("mistral", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = left_padded(ref.config.vocab_size, [5, 12])
    opts = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(11)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, **opts)
    got = tsp_core.generate(model, ids, 16, attention_mask=mask, seed=11, **opts)
    assert torch.equal(got, want), (got, want)
    greedy = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert not torch.equal(want, greedy)  # sampling did sample
    # min-p, after top-p as Hugging Face orders its warpers (TRL's GRPO passes it)
    min_p = dict(opts, temperature=0.3, min_p=0.3)
    torch.manual_seed(11)
    want_min_p = ref.generate(ids, attention_mask=mask, max_new_tokens=16, **min_p)
    got = tsp_core.generate(model, ids, 16, attention_mask=mask, seed=11, **min_p)
    assert torch.equal(got, want_min_p), (got, want_min_p)
    torch.manual_seed(11)  # the cut mattered: without it HF draws other tokens
    assert not torch.equal(want_min_p, ref.generate(ids, attention_mask=mask, max_new_tokens=16,
                                                    **dict(min_p, min_p=None)))
    torch.manual_seed(100 + mesh.rank)  # different global random state on every rank
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, **opts)
    torch.manual_seed(100)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, max_new_tokens=16, **opts))
    # stop tokens: the greedy token of row 0 at step 3 ends row 0 there (padded with pad id 1
    # afterwards); generation stops once every row has produced one of them
    S = ids.shape[1]
    stops = [int(greedy[0, S + 3]), int(greedy[1, S + 5])]
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                        eos_token_id=stops, pad_token_id=1)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=stops,
                         pad_token_id=1)
    assert torch.equal(got, want) and want.shape[1] < S + 16 and int(want[0, -1]) == 1, (got, want)
    assert torch.equal(tsp_core.generate(model, ids, 16, attention_mask=mask, eos_token_id=stops,
                                         pad_token_id=1), want)
    return got.tolist()


def test_sampling_and_stop_tokens(pools):
    outs = pools.of(2).run(sampling_and_stops, 2)
    assert outs[0] == outs[1]


def bad_calls(tsp: int) -> None:
    """Unsupported arguments raise, naming them, before any collective; bad prompts after one
    all-gather of a few integers (so a rank whose input alone is bad cannot leave the others
    waiting), before any schedule collective; ranks called with different arguments raise on
    every rank instead of hanging."""
    mesh = dist_pool.mesh(tsp)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64), mesh)
    ids, mask = left_padded(96, [4, 9])
    cases = [
        (dict(num_beams=2), "num_beams=2"),
        (dict(streamer=object()), "streamer"),
        (dict(repetition_penalty=1.3), "repetition_penalty"),
        (dict(attention_mask=mask.flip(1)), "right padding"),
        (dict(use_cache=False), "use_cache=False"),
    ]
    for kwargs, needle in cases:
        kwargs = {"attention_mask": mask, **kwargs}
        with comm.track() as s:
            with pytest.raises(ValueError, match=needle):
                model.generate(ids, max_new_tokens=4, **kwargs)
        allowed = {"all_gather": 1} if needle == "right padding" else {}
        assert dict(s.calls) == allowed, f"{needle}: collectives before the error: {dict(s.calls)}"
    bad = mask.flip(1) if mesh.rank == 1 else mask          # only rank 1's prompts are bad
    with pytest.raises(ValueError, match="right padding" if mesh.rank == 1 else r"rank\(s\) \[1\]"):
        tsp_core.generate(model, ids, 4, attention_mask=bad)
    with pytest.raises(ValueError, match=r"different \['max_new_tokens'\]"):
        tsp_core.generate(model, ids, 4 + mesh.rank, attention_mask=mask)
    with pytest.raises(ValueError, match="parallelized with tsp_core.parallelize"):
        tsp_core.generate(hf_models.build("llama", torch.float64), ids, 4)
    dist.barrier()


def test_errors_raise_on_every_rank(pools):
    pools.of(2).run(bad_calls, 2)


def attention_decode_steps(tsp: int, cases: list[tuple[bool, int | None, int | None]]) -> None:
    """For each (sinks, chunk, window): one TSPAttention layer (4 query, 2 key/value heads)
    prefills 16 tokens with its TSP schedule, handing its own tokens' K/V to a cache as prefill
    does, then decodes 6 more through decode's own attention step (the cache's turn-taking,
    visible_slots, the all-to-all and the owner's merge with its heads' sinks); each new token's
    output equals the float64 math over the whole sequence. No family policy has sinks or
    chunks yet (gpt-oss, Llama 4), so the step runs on the layer alone."""
    from types import SimpleNamespace

    from tsp_core import TSPAttention
    from tsp_core.inference.decode import ShardedKVCache, _attention_step, visible_slots
    from tsp_core.layers import rope
    from tsp_core.layers.attention import AttentionParts, AttentionShape, Mask
    from tsp_core.sequence import layout

    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    h, nq, nkv, d, S, new = 16, 4, 2, 8, 16, 6
    for sinks, chunk, window in cases:
        gen = torch.Generator().manual_seed(4)

        def r(*s: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3

        w = {"q_proj.weight": r(nq * d, h), "k_proj.weight": r(nkv * d, h),
             "v_proj.weight": r(nkv * d, h), "o_proj.weight": r(h, nq * d)}
        if sinks:  # logits of a few units: the sink takes a large share of each row
            w["sinks"] = 2 * torch.randn(nq, generator=gen, dtype=torch.float64)
        parts = AttentionParts(mask=Mask(sliding_window=window, chunk_size=chunk, sinks=sinks))
        layer = TSPAttention(mesh, AttentionShape(h, nq, nkv, d), parts, dtype=torch.float64)
        layer.load_full(w)
        x = torch.randn(1, S + new, h, generator=gen, dtype=torch.float64)
        want = reference.attention(x, w, nq, nkv, d, window=window, chunk=chunk)
        own = layout.position_ids(S, p, D, mesh.layout)
        kv: list[torch.Tensor] = []
        with torch.no_grad():
            layer(layout.shard_sequence(x[:, :S], p, D, 1, mesh.layout), own, kv_sink=kv.append)
        g, _, B, n, L, _ = kv[0].shape
        both = kv[0].permute(1, 2, 0, 3, 4, 5).reshape(2, B, g * n, L, d)
        cache = ShardedKVCache([both[0].clone()], [both[1].clone()], own[None].clone(), L,
                               [L] * D, p)
        cache.reserve(new)
        for t in range(S, S + new):
            owner = cache.next_owner()
            cache.counts[owner] += 1
            slot = None
            if owner == p:
                slot = cache.length
                cache.positions[:, slot] = t
                cache.length += 1
            positions = torch.tensor([t])
            used = cache.positions[:, :cache.length]
            visible = visible_slots(layer.spec, used >= 0, used, positions)
            cos, sin = rope.cos_sin(positions[:, None], layer.inv_freq, 1.0, torch.float64)
            with torch.no_grad():
                y = _attention_step(SimpleNamespace(mesh=mesh), 0, layer, x[:, t], cos, sin,
                                    cache, slot, visible)
            what = f"sinks {sinks}, chunk {chunk}, window {window}: token {t}"
            assert_close(y, want[:, t], 1e-10, what)


@pytest.mark.parametrize("tsp", [2, 4])
def test_decode_with_sinks_and_chunks(pools, tsp):
    """gpt-oss's sinks (with its sliding window) and Llama 4's chunks (the new tokens cross the
    chunk boundary at 18) in decode: the sinks once per head after the merge of every rank's
    slots, the chunk hiding the slots of earlier chunks."""
    pools.of(tsp).run(attention_decode_steps, tsp, [(True, None, 5), (False, 6, None),
                                                    (True, 6, None)])


def kv_shared_cache_bytes(tsp: int, steps: int) -> list[int]:
    """hf_models' Gemma 4 (4 layers, the last 2 KV-shared: layer 2 reuses sliding layer 0's K/V,
    layer 3 full layer 1's) after a prefill of two left-padded prompts of 64 and 40 tokens and
    ``steps`` decode steps (room reserved first, as generate does): the bytes this rank's cache
    holds, as the cache counts them (``nbytes``) and as the distinct tensor storages reachable
    from it (positions and row lengths included); each step's logits are HF's float64 ones to
    1e-8 (the reused K/V are still read)."""
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("gemma4", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = left_padded(ref.config.vocab_size, [64, 40])
    new = torch.randint(3, ref.config.vocab_size, (2, steps + 1),
                        generator=torch.Generator().manual_seed(7))
    want = [None]
    if dist.get_rank() == 0:  # one process's reference, sent to every rank
        want = [reference_logits(ref, torch.cat([ids, new], 1), mask, ids.shape[1]).detach()]
    dist.broadcast_object_list(want, src=0)

    logits, cache = prefill(model, ids, mask)
    out = [cache.nbytes(), reachable_bytes(cache)]
    assert_close(logits, want[0][0], 1e-8, f"tsp {tsp} prefill logits")
    cache.reserve(steps)
    for t in range(steps):
        logits = decode_step(model, cache, new[:, t], cache.lengths + t)
        assert_close(logits, want[0][t + 1], 1e-8, f"tsp {tsp} step {t} logits")
    return out + [cache.nbytes(), reachable_bytes(cache)]


@pytest.mark.parametrize("tsp", [2, 4])
def test_kv_shared_layers_hold_no_cache(pools, tsp):
    """A layer that reuses another's K/V (KVSharing "reuse": Gemma 4's num_kv_shared_layers)
    keeps nothing in the decode cache: decode reads the storing layer's entry, so every rank's
    cache is the storing layers' K/V of its own slots, and no more."""
    steps = 5
    out = pools.of(tsp).run(kv_shared_cache_bytes, tsp, steps)
    c = hf_models.build("gemma4", torch.float64).config
    # the zoo's Gemma 4, written out: layers 0, 1 store (sliding: 2 key/value heads of 24
    # channels; full: 1 of 32, attention_k_eq_v), layers 2, 3 reuse them
    assert (c.num_hidden_layers, c.num_kv_shared_layers, c.layer_types) == (
        4, 2, ["sliding_attention", "full_attention"] * 2)
    layers = [(c.per_layer_config[i].num_key_value_heads, c.per_layer_config[i].head_dim)
              for i in range(4)]
    assert layers == [(2, 24), (1, 32)] * 2 and c.attention_k_eq_v, layers
    # the decode cache is split by tokens (prefill leaves each rank its own tokens' K/V of every
    # key/value head; each decoded token goes to the rank with the fewest slots, lowest first),
    # not by heads. Per slot of a row: K and V, float64, of the storing layers only, every slot
    # kept (the sliding layer's window hides old slots, it frees none); the 64-slot prompt
    # (rows padded to the longest) gives each rank 64 / D slots, step t goes to rank t mod D
    B, prompt = 2, 64
    per_slot = 2 * 8 * (2 * 24 + 1 * 32)        # K and V x float64 x (layer 0 + layer 1)
    for rank, (pre, pre_held, post, post_held) in enumerate(out):
        slots = prompt // tsp
        mine = slots + len(range(rank, steps, tsp))
        assert pre == B * slots * per_slot, (rank, pre, B * slots * per_slot)
        # reachable storages: the K/V above, an int64 position per slot, a length per row
        assert pre_held == pre + B * slots * 8 + B * 8, (rank, pre_held)
        assert post == B * mine * per_slot, (rank, post, B * mine * per_slot)
        assert post_held == post + B * mine * 8 + B * 8, (rank, post_held)


# --------------------------------------------------------------------------- LoRA adapters

def lora_generation(tsp: int, new: int = 8) -> list[list[int]]:
    """A PeftModel (tests/models/test_lora.py's Llama with one key/value head, r 4 on all seven
    projections, A and B random) with a second adapter "b" (r 2 on q, v and down), parallelized,
    against the same PeftModel on one process (unmodified PEFT and Hugging Face): greedy tokens
    of PEFT's generate and every step's float64 logits to 1e-10 with the default adapter. At tsp
    2 also (what does not depend on the degree, checked once): the same under
    ``disable_adapter()`` (the base's) and after ``set_adapter("b")``, ``PeftModel.generate``
    and seeded sampling give PEFT's tokens, and a decode step moves the bytes it moves without
    adapters. Returns every greedy case's tokens (the same on every rank)."""
    from peft import LoraConfig

    from tests.models.test_lora import peft_model

    mesh = dist_pool.mesh(tsp)
    ref = peft_model("llama")
    torch.manual_seed(2)
    ref.add_adapter("b", LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                    target_modules=["q_proj", "v_proj", "down_proj"]))
    ref.eval()
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = left_padded(ref.config.vocab_size, [7, 20])
    seen = {}

    def greedy(what: str) -> None:
        seen[what] = peft_greedy(ref, model, ids, mask, new, f"{what} D={tsp}")

    greedy("default")
    if tsp > 2:  # at tsp 4: one query head and a quarter of the key/value head per rank
        return [seen["default"][0]]
    with ref.disable_adapter(), model.disable_adapter():
        greedy("disabled")
    same_traffic(model, ids, mask)
    ref.set_adapter("b")
    model.set_adapter("b")
    greedy("b")
    firsts = [logits for _, logits in seen.values()]  # each adapter changed the logits
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(firsts, firsts[1:] + firsts[:1]))
    lora_generation_api(ref, model, ids, mask, new, seen["b"][0])
    return [tokens for tokens, _ in seen.values()]


def peft_greedy(ref, model, ids: torch.Tensor, mask: torch.Tensor, new: int,
                what: str) -> tuple[list[list[int]], torch.Tensor]:
    """TSP's greedy tokens equal PEFT's ``generate`` on one process and every step's logits its
    float64 ones to 1e-10; (the tokens, the first step's logits)."""
    want, ref_logits = hf_greedy(ref, ids, mask, new)
    got, steps = tsp_core.generate(model, ids, new, attention_mask=mask, return_logits=True)
    assert torch.equal(got, want), f"{what}: tokens differ\n{got}\n{want}"
    for t, step in enumerate(steps):
        assert_close(step, ref_logits[t], 1e-10, f"{what} step {t} logits")
    return want.tolist(), ref_logits[0]


def same_traffic(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One decode step with the active adapter (on all seven projections) issues the collectives
    of a step with it disabled, kinds and bytes: o's and down's shares ride their all-reduce."""
    _, cache = prefill(model, ids, mask)
    logs = []
    for step, off in enumerate((False, True)):
        with comm.track() as s, (model.disable_adapter() if off else contextlib.nullcontext()):
            decode_step(model, cache, torch.tensor([4, 7]), cache.lengths + step)
        logs.append(s.log)
    assert logs[0] == logs[1], f"the adapter changed decode's traffic: {logs}"


def lora_generation_api(ref, model, ids: torch.Tensor, mask: torch.Tensor, new: int,
                        greedy_b: list[list[int]]) -> None:
    """With adapter "b" active: ``PeftModel.generate`` gives its greedy tokens and seeded
    sampling PEFT's tokens."""
    got = model.generate(ids, attention_mask=mask, max_new_tokens=new)  # PeftModel.generate
    assert torch.equal(got, torch.tensor(greedy_b)), (got, greedy_b)
    opts = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    want = [None]
    if dist.get_rank() == 0:  # one process's draw, sent to every rank
        torch.manual_seed(11)
        want = [ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **opts)]
    dist.broadcast_object_list(want, src=0)
    got = tsp_core.generate(model, ids, new, attention_mask=mask, seed=11, **opts)
    assert torch.equal(got, want[0]) and got.tolist() != greedy_b, (got, want[0])


@pytest.mark.parametrize("tsp", [2, 4])
def test_lora_generation_matches_peft(pools, tsp):
    outs = pools.of(tsp).run(lora_generation, tsp)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"
    assert len({str(tokens) for tokens in outs[0]}) == len(outs[0])  # each adapter acts


def fused_lora_generation(tsp: int, new: int = 8) -> list[list[int]]:
    """tests/models/test_lora.py's Phi-3 PeftModel (one key/value head; adapters on its fused
    ``qkv_proj`` and ``gate_up_proj``, on o and down) against the same PeftModel on one process:
    greedy tokens and step logits (1e-10), and the base's under ``disable_adapter()``."""
    from tests.models.test_lora import peft_model

    ref = peft_model("phi3").eval()
    model = tsp_core.parallelize(copy.deepcopy(ref), dist_pool.mesh(tsp))
    ids, mask = left_padded(ref.config.vocab_size, [7, 20])
    adapted, _ = peft_greedy(ref, model, ids, mask, new, f"phi3 D={tsp}")
    with ref.disable_adapter(), model.disable_adapter():
        base, _ = peft_greedy(ref, model, ids, mask, new, f"phi3 disabled D={tsp}")
    return [adapted, base]


def test_fused_lora_generation_matches_peft(pools):
    outs = pools.of(2).run(fused_lora_generation, 2)
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1], outs[0]


def greedy_by_hand(ref, ids: torch.Tensor, mask: torch.Tensor,
                   new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their step logits [new, B, V] from the reference's full forward on the
    sequence so far, step by step, with autograd on: bitsandbytes' ``Linear4bit`` then
    dequantizes its weight and multiplies (the path of its training forward, the one QLoRA's
    parity holds to). Under ``no_grad`` in eval (Hugging Face's ``generate``) it runs its CPU
    inference kernel instead, whose logits differ from that path's by up to 8e-3 relative
    here, more than the margin between this model's top tokens."""
    seqs, steps = ids, []
    with torch.enable_grad():
        for _ in range(new):
            full = torch.cat([mask, mask.new_ones(mask.shape[0], seqs.shape[1] - ids.shape[1])], 1)
            pos = (full.cumsum(1) - 1).clamp(min=0)
            logits = ref(input_ids=seqs, attention_mask=full, position_ids=pos).logits[:, -1]
            steps.append(logits.detach())
            seqs = torch.cat([seqs, steps[-1].argmax(-1, keepdim=True)], dim=1)
    return seqs, torch.stack(steps)


def qlora_generation(path: str, new: int = 8) -> list[list[int]]:
    """A QLoRA PeftModel (tests/models/test_qlora.py's: a Llama loaded 4-bit NF4, float32
    compute, r 4 on all seven projections, A and B random) at tsp 2 against the same PeftModel
    on one process (unmodified PEFT, Hugging Face, bitsandbytes): greedy tokens equal and every
    step's logits to 1e-6, with the adapter and under ``disable_adapter()``."""
    from tests.models.test_qlora import SMALL, qlora_model, save_base

    mesh = dist_pool.mesh(2)
    ids, mask = left_padded(SMALL["vocab_size"], [7, 20])
    want = [None]
    if dist.get_rank() == 0:  # one process's reference, sent to every rank
        save_base(path, SMALL)
        ref = qlora_model(path)
        with ref.disable_adapter():
            base = greedy_by_hand(ref, ids, mask, new)
        want = [(greedy_by_hand(ref, ids, mask, new), base)]
    dist.broadcast_object_list(want, src=0)  # and the saved base is there for every rank
    model = tsp_core.parallelize(qlora_model(path).eval(), mesh)
    out = []
    for (tokens, logits), off in zip(want[0], (False, True)):
        with model.disable_adapter() if off else contextlib.nullcontext():
            got, steps = tsp_core.generate(model, ids, new, attention_mask=mask,
                                           return_logits=True, eos_token_id=[])  # as by hand
        what = "disabled" if off else "adapted"
        assert torch.equal(got, tokens), f"QLoRA {what}: tokens differ\n{got}\n{tokens}"
        for t, step in enumerate(steps):
            assert_close(step, logits[t], 1e-6, f"QLoRA {what} step {t} logits")
        out.append(got.tolist())
    return out


def test_qlora_generation_matches_bitsandbytes(pools, tmp_path):
    pytest.importorskip("bitsandbytes")
    outs = pools.of(2).run(qlora_generation, str(tmp_path))
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1], outs[0]
