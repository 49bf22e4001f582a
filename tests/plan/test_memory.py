"""The memory rules (docs/design.md "Memory rules") proven by measurement: the 7B shape (1 of its
layers) simulated for rank 0 under FakeTensorMode with the fake process group and MemTracker (``tsp
simulate``), one training step with AdamW state. Every component of the measurement is held to a
floor computed here from the shapes and the schedule (one formula excepted, below):

- parameters, optimizer states: exactly this rank's shards (and AdamW's two moments of them);
- gradients: none before backward, exactly this rank's shards after it, never more in between;
- activations kept for backward: exactly the local activations of this rank's own tokens;
- what each attention / MLP adds while it runs: its shard buffers, one head group's K/V, and a
  named working set of local tensors. The attention backward's activation terms are
  ``tsp_core.layers.attention.backward_floor_bytes`` (each named in docs/memory.md "The attention
  backward's floor"; tests/layers/test_attention_floor.py measures its growth with S), its weight
  buffers are counted here from the round schedule; the MLP's tile size is
  ``tiles.mlp_tile_tokens``'s choice, the bytes of a tile are counted here.

A monkeypatched run that keeps the gathered K/V, or one remote weight shard, for backward must
break the floors: the test shows it does."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tsp_core.layers.attention import backward_floor_bytes
from tsp_core.layers.tiles import mlp_tile_tokens, token_tiles

# the 7B shape of tsp_core.plan.simulate.MODELS["7b"], cut to 1 layer, at 131072 tokens
H, NQ, NKV, F, V, LAYERS, SEQ = 4096, 32, 32, 16384, 32000, 1, 131072
HEAD = H // NQ
# slack on every floor: 64 bytes per local token (1/128 of one local hidden state in bf16). It
# covers the int64 index tensors of the step (token ids, positions, labels, the embedding
# exchange's order; 5 x 8 bytes per token measured) and vectors of a few KiB (the attention's
# bias gradients, computed also without biases), and nothing the size of a weight shard (16 MiB
# at D=8, 16 times the slack) or of a head group's K/V (256 MiB)
SLACK_PER_TOKEN = 64


def simulate(tmp_path, *args: str) -> list[dict]:
    # `tsp simulate` as users run it: its own process and workers, the records as JSON
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, "-m", "tsp_core.tools.cli", "simulate", "--json", str(out),
                    *args], check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------- floors from the shapes

def attention_backward_shards(D: int) -> int:
    """The most packed [q|k|v|o] weight shards (W each) rank 0's attention backward holds while a
    round attends (tsp_core/layers/attention/per_group.py): its own, packed once (round 0's), the
    previous round's (its key/value tail runs after this round's attention), this round's and the
    next one's arriving; and the weight gradients reduced to owners so far: its own sum (round 0's,
    sent at the end of round 1) and at most one other owner's in flight. At D=4: 5, at D>=5: 6."""
    most = 0
    for r in range(D):
        shards = len({0, r - 1, r, r + 1} & set(range(D)))
        reduces = (r >= 2) + (r >= 3)  # round r-1's tail is sent after round r's attention
        most = max(most, shards + reduces)
    return most


def floors(D: int) -> dict[str, tuple[int, int]]:
    """(floor, allowance) in bytes per measured quantity of one bf16 training step at degree D.
    The floor is what the schedule cannot do without (docs/design.md "Memory rules"); the allowance
    is the named working set of local tensors the implementation adds on top (kernel inputs and
    outputs, gradients of one head group). The measurement must lie in [floor, floor + allowance +
    slack]."""
    assert NKV % D == 0 and NQ % D == 0 and F % D == 0
    T = SEQ // D                                 # this rank's tokens
    bf16, fp32 = 2, 4
    X = T * H * bf16                             # one local hidden state [S/D, h]
    G = T * (NQ // D) * HEAD * bf16              # one head group's Q (or O) of own tokens
    KV = 2 * SEQ * (NKV // D) * HEAD * bf16      # one head group's K/V, gathered: whole sequence
    W = (2 * NQ + 2 * NKV) * HEAD * H // D * bf16  # one attention weight shard [q|k|v|o]
    M = 3 * F * H // D * bf16                    # one MLP weight shard [gate|up|down]
    tile = min(T, mlp_tile_tokens(F // D, torch.bfloat16))
    It = tile * (F // D) * bf16                  # one tile's intermediate slice [tile, F/D]
    # the shard's weight gradient, summed over the tiles in float32 when there is more than one
    acc = M * fp32 // bf16 if len(token_tiles(T, tile)) > 1 else M
    lse = T * (NQ // D) * fp32                   # one head group's log-sum-exp

    own = 2 * (V // D) * H + LAYERS * (W + M) // bf16 + (2 * LAYERS + 1) * H  # elements
    steps = 4 * (3 + 9 * LAYERS)  # AdamW's float32 step count per parameter tensor
    # an RMSNorm keeps only its input (tsp_core/layers/norm.py: its backward reruns it a tile at
    # a time); its output is the next op's saved input
    norm = T * H * (bf16 + bf16)
    # TSP attention keeps local Q, K, V of all heads, the output and the LSE (docs/design.md "Memory
    # rules")
    attention = T * (NQ + 2 * NKV + NQ) * HEAD * bf16 + T * NQ * fp32
    kept = (LAYERS * (2 * norm + attention) + norm  # the final norm
            + 2 * T * HEAD * bf16                   # RoPE cos, sin of own positions
            + T * fp32)                             # the loss's log-sum-exp per token
    return {
        "parameters": (own * bf16, 0),
        "optimizer_states": (2 * own * bf16 + steps, 0),
        "kept activations": (kept, 0),
        # forward of one attention: what it keeps, its output, three shard buffers (round r's
        # output projection in use, round r+1's projections, round r+2's broadcast in flight)
        # and its own shard packed for its broadcast; K/V: one head group's in use (sequence
        # order), the next one's arriving (rank order) and put in order; working set: that
        # group's output and LSE
        "attention forward": (attention + X + 4 * W + 3 * KV, G + lse),
        # backward of one attention: the whole-sequence part (one head group's K/V in use, one
        # more K/V-sized buffer, the float32 dK/dV), the own tokens' part (dX, dQ, dO, the
        # previous group's dK/dV of own tokens) and one kernel call's slices, as
        # backward_floor_bytes names them, and the weight buffers of the round schedule;
        # working set: the previous round's query and output weight gradients, waiting for its
        # tail (its key/value ones are computed there)
        "attention backward": (backward_floor_bytes(SEQ, D, HEAD, NKV // D, NQ // D, H)
                               + attention_backward_shards(D) * W,
                               2 * NQ * HEAD * H // D * bf16),
        # forward of one MLP: its output, two shard buffers and its own shard packed, one
        # tile's gate and up; working set: act(gate)
        "mlp forward": (X + 3 * M + 2 * It, It),
        # backward of one MLP: dX, three shard buffers (its own packed, the one in use, the next
        # arriving), the previous shard's gradient in flight and the one arriving, this shard's
        # gradient summed over the tiles (acc), one tile's gate and up recomputed and act(gate);
        # working set: two more tile tensors (act(gate) x up for dWd, then dM and dUp; the
        # previous tile's dM is still bound at the next tile's first product) and one
        # weight-gradient block
        "mlp backward": (X + 3 * M + 2 * M + acc + 3 * It, 2 * It + M // 3),
        "slack": (SEQ // D * SLACK_PER_TOKEN, 0),
    }


def violations(rec: dict) -> list[str]:
    """Every component of ``rec`` (a simulate record) outside its floor's range, by name."""
    f = floors(rec["degree"])
    slack = f["slack"][0]
    ph, peak = rec["phases"], rec["breakdown"]
    measured = {
        "parameters": peak["parameters"],
        "optimizer_states": peak["optimizer_states"],
        "kept activations": ph["kept"]["activations"],
        "attention forward": ph["attention_forward"]["activations"],
        "attention backward": ph["attention_backward"]["temporaries"],
        "mlp forward": ph["mlp_forward"]["activations"],
        "mlp backward": ph["mlp_backward"]["temporaries"],
    }
    bad = [f"{k}: {v} bytes, not in [{f[k][0]}, {f[k][0] + f[k][1] + slack}] (floor, + working "
           f"set {f[k][1]}, + slack {slack})" for k, v in measured.items()
           if not f[k][0] <= v <= f[k][0] + f[k][1] + slack]
    own = f["parameters"][0]  # the gradients of this rank's shards, in bf16
    for where, got, lo, hi in (("kept gradients", ph["kept"]["gradients"], 0, 0),
                               ("gradients at the peak", peak["gradients"], 0, own),
                               ("gradients at the end", ph["end"]["gradients"], own, own),
                               ("parameters kept", ph["kept"]["parameters"], own, own)):
        if not lo <= got <= hi:
            bad.append(f"{where}: {got} bytes, not in [{lo}, {hi}]")
    for phase in ("attention_forward", "attention_backward", "mlp_forward", "mlp_backward"):
        if ph[phase].get("gradients", 0) > own:
            bad.append(f"{phase} gradients: {ph[phase]['gradients']} > own {own}")
    return bad


# ------------------------------------------------------------- deliberately broken schedules

_KEPT: list = []  # what a broken variant keeps alive until the step ends


@contextlib.contextmanager
def breaking_the_rule(variant: str | None) -> Iterator[None]:
    """Run TSP attention with a bug against docs/design.md "Memory rules" made on purpose:
    ``"keep_kv"`` keeps every head group's gathered K/V until the step ends (what plain autograd
    over the rounds would save); ``"keep_shard"`` keeps one remote attention weight shard per pass
    of each layer (the round after this rank's own) until the step ends. ``None`` changes
    nothing."""
    from tsp_core import comm
    from tsp_core.layers.attention import rounds

    gather, start = comm.start_all_gather_sequence, rounds.Rounds._start

    def gather_kept(*args, **kwargs):
        pending = gather(*args, **kwargs)
        wait = pending.wait

        def wait_kept():
            out = wait()
            _KEPT.append(out)
            return out

        pending.wait = wait_kept
        return pending

    def start_kept(self, r: int):
        buf, handle = start(self, r)
        if r == (self.me + 1) % self.size:
            _KEPT.append(buf)
        return buf, handle

    if variant == "keep_kv":
        comm.start_all_gather_sequence = gather_kept
    elif variant == "keep_shard":
        rounds.Rounds._start = start_kept
    elif variant is not None:
        raise ValueError(variant)
    try:
        yield
    finally:
        comm.start_all_gather_sequence, rounds.Rounds._start = gather, start
        _KEPT.clear()


def simulate_variant(degree: int, variant: str | None, model: str = "7b", seq: int = SEQ,
                     tile_tokens: int | None = None, layers: int = LAYERS) -> dict:
    """One simulate record (as ``tsp simulate --json`` writes it) of ``layers`` layers of
    ``model`` (a preset), run in a worker process of its own process group, with the rule broken
    as ``variant`` says (``tile_tokens``: as ``parallelize`` takes it)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from tsp_core.plan.simulate import SimulationRequest, record_dict
    from tsp_core.plan.simulate import simulate as run

    torch.set_num_threads(1)
    req = SimulationRequest("tsp", degree, 1, seq, model, layers, recompute="none",
                            tile_tokens=tile_tokens)
    with breaking_the_rule(variant):
        return record_dict(run(req))


def test_each_component_at_its_floor_and_broken_rules_fail(simulations):
    """D=4 and D=8 meet every floor; at D=8, keeping the gathered K/V or one remote weight shard
    breaks the activations kept for backward and what the attention's backward adds (the
    smallest such bug, one attention shard, is 16 times the slack)."""
    runs = [(4, None), (8, None), (8, "keep_kv"), (8, "keep_shard")]
    recs = list(simulations.map(simulate_variant, *zip(*runs)))
    for (d, variant), rec in zip(runs, recs):
        assert rec["degree"] == d and rec["layers"] == LAYERS
        assert rec["peak_bytes"] == sum(rec["breakdown"].values()), rec
        bad = violations(rec)
        if variant is None:
            assert bad == [], f"D={d}: " + "\n".join(bad)
            continue
        broken = {b.split(":")[0] for b in bad}
        assert {"kept activations", "attention backward"} <= broken, (d, variant, bad)
        excess = rec["phases"]["kept"]["activations"] - floors(d)["kept activations"][0]
        T, shard = SEQ // d, 4 * H * H // d * 2
        # what the forward kept: every head group's K/V of each layer, or one shard per layer
        want = LAYERS * d * 2 * SEQ * H // d * 2 if variant == "keep_kv" else LAYERS * shard
        assert abs(excess - want) <= T * SLACK_PER_TOKEN, (variant, excess, want)


def test_every_layout_keeps_its_share_of_the_model(tmp_path):
    recs = simulate(tmp_path, "--model", "tiny", "--seq", "512", "--degree", "4",
                    "--layouts", "tsp,tp,tp-sp,cp,tp+cp,tp-sp+cp", "--recompute", "none")
    by = {r["layout"]: r for r in recs}
    assert list(by) == ["tsp", "tp", "tp-sp", "cp", "tp+cp(2x2)", "tp-sp+cp(2x2)"]
    params = {k: r["breakdown"]["parameters"] for k, r in by.items()}
    # tiny: h=64, intermediate 256, 2 layers, vocab 512; 1/D of every matrix, norms replicated
    h, f, v, layers = 64, 256, 512, 2
    matrices, norms = 2 * v * h + layers * (4 * h * h + 3 * f * h), (2 * layers + 1) * h
    for name, t in (("tsp", 4), ("tp", 4), ("tp-sp", 4), ("cp", 1), ("tp+cp(2x2)", 2),
                    ("tp-sp+cp(2x2)", 2)):
        assert params[name] == (matrices // t + norms) * 2, (name, params)
    for r in recs:  # the peak is the sum of what was alive at that moment, by category
        assert r["peak_bytes"] == sum(r["breakdown"].values()), r


def test_a_reused_worker_gives_what_a_fresh_process_gives():
    """``simulate_many`` runs its records one after another in each worker: in one worker, tp's
    record taken after tp's and tsp's equals its first one, taken by the new process, in every
    field but the seconds."""
    from tsp_core.plan.simulate import SimulationRequest, record_dict, simulate_many

    tsp, tp = (SimulationRequest(name, 4, 1, 512, "tiny", recompute="none")
               for name in ("tsp", "tp"))
    first, _, again = (record_dict(r) for r in simulate_many([tp, tsp, tp], jobs=1))
    for rec in (first, again):
        rec.pop("seconds")
    assert again == first


@pytest.mark.parametrize("bad,message", [(["--layouts", "tp+cp", "--degree", "3"], "3 has none"),
                                         (["--model", "13b"], "unknown model")])
def test_simulate_rejects_bad_requests(tmp_path, bad, message):
    out = subprocess.run([sys.executable, "-m", "tsp_core.tools.cli", "simulate", "--seq", "64",
                          *bad], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


# ------------------------------------------------------------------ the rule in every family

FAMILY_BLOCKS = ("qwen3-8b", "gemma-2-9b", "olmo-2-7b")  # q/k norms, sandwich + soft-caps, phased
# a block is one layer, or the layers up to a preset's first sparse one (GLM-4.5-Air's first is
# dense: first_k_dense_replace)
BLOCK_LAYERS = {"glm-4.5-air": 2}
FAMILY_SEQ = 16384
WORKING_SETS = (("attention_forward", "activations"), ("attention_backward", "temporaries"),
                ("mlp_forward", "activations"), ("mlp_backward", "temporaries"))


def scaling_violations(runs: dict[tuple[int, int], dict]) -> list[str]:
    """The memory rules without per-family floors, from one layer at (S, D=4), (S, D=8) and (2S,
    D=8): what the forward keeps for backward is local activations only, a linear function of this
    rank's token count S/D (so (S, 4) and (2S, 8) keep the same, twice (S, 8)): a kept weight
    shard (a 1/D term) or a kept K/V of the whole sequence (an S term) breaks it. What each
    attention and MLP adds while it runs, and the parameters, shrink at least as 1/D (run with
    one token tile of all local tokens: a tile's working set is bounded by the tile, not by D)."""
    s4, s8, l8 = runs[(FAMILY_SEQ, 4)], runs[(FAMILY_SEQ, 8)], runs[(2 * FAMILY_SEQ, 8)]
    slack = FAMILY_SEQ // 8 * SLACK_PER_TOKEN
    kept = {k: r["phases"]["kept"]["activations"] for k, r in
            (("(S, 4)", s4), ("2 x (S, 8)", s8), ("(2S, 8)", l8))}
    kept["2 x (S, 8)"] *= 2
    bad = []
    if max(kept.values()) - min(kept.values()) > 2 * slack:
        bad.append(f"kept activations not linear in S/D: {kept} (slack {2 * slack})")
    for phase, kind in WORKING_SETS:
        a, b = s4["phases"][phase][kind], s8["phases"][phase][kind]
        if b > a / 2 + slack:
            bad.append(f"{phase} {kind}: {b} bytes at D=8 > half of {a} at D=4 + slack {slack}")
    pa, pb = s4["breakdown"]["parameters"], s8["breakdown"]["parameters"]
    if pb > pa / 2 + slack:
        bad.append(f"parameters: {pb} bytes at D=8 > half of {pa} at D=4 + slack {slack}")
    return bad


def family_runs(simulations: ProcessPoolExecutor, models: tuple[str, ...],
                variants: tuple[str | None, ...], tile_tokens: int | None = None) -> dict:
    """Each model's block (its first BLOCK_LAYERS layers) at (S, 4), (S, 8), (2S, 8), run in
    the session's ``simulations`` workers."""
    points = [(FAMILY_SEQ, 4), (FAMILY_SEQ, 8), (2 * FAMILY_SEQ, 8)]
    keys = [(m, v, p) for m in models for v in variants for p in points]
    layers = [BLOCK_LAYERS.get(m, LAYERS) for m, _, _ in keys]
    recs = simulations.map(simulate_variant, [p[1] for _, _, p in keys],
                           [v for _, v, _ in keys], [m for m, _, _ in keys],
                           [p[0] for _, _, p in keys], [tile_tokens] * len(keys), layers)
    out: dict = {}
    for (m, v, p), n, rec in zip(keys, layers, recs):
        assert rec["layers"] == n and rec["seq"] == p[0] and rec["degree"] == p[1]
        out.setdefault((m, v), {})[p] = rec
    return out


def test_the_rule_holds_in_every_family_and_its_breaks_show(simulations):
    """One block of Qwen3 (per-head q/k norms), Gemma 2 (sandwich norms, soft-capped attention
    and logits) and OLMo 2 (whole-width q/k norms: the phased schedule) keeps and adds what the
    rule allows; in OLMo 2's schedule, keeping the gathered K/V or a remote weight shard for
    backward is seen."""
    # one tile of all local tokens at every point (4096 tokens): the input norm's backward, in
    # the attention_backward window (docs/memory.md "Reading tsp simulate's phases"), then halves
    # with D as the rule says; the chosen tile (2048 tokens at h=4096) would not
    one = FAMILY_SEQ // 4
    runs = family_runs(simulations, FAMILY_BLOCKS, (None,), one) | \
        family_runs(simulations, ("olmo-2-7b",), ("keep_kv", "keep_shard"), one)
    for model in FAMILY_BLOCKS:
        bad = scaling_violations(runs[(model, None)])
        assert bad == [], f"{model}: " + "\n".join(bad)
    for variant in ("keep_kv", "keep_shard"):
        bad = scaling_violations(runs[("olmo-2-7b", variant)])
        assert any(b.startswith("kept activations") for b in bad), (variant, bad)


# ------------------------------------------------------------------ mixture of experts

def test_the_rule_holds_for_moe_blocks(simulations):
    """One block of Mixtral-8x7B (8 experts, top 2), of Qwen3-30B-A3B (128 experts, top 8,
    per-head q/k norms), of GLM-4.5-Air (its dense first layer and first sparse one: 128
    experts, top 8 by the sigmoid router, a shared expert on the dense ring, 96 query heads of
    128), of gpt-oss-20b (its first layer: sliding attention with sinks, 32 experts with
    biases, top 4) and of Llama-4-Scout (its first layer: chunked attention, the L2 q/k norm, 16
    experts, top 1 weighting the input, a shared expert on the dense ring) under TSP's
    expert-parallel schedule (tsp_core.layers.moe, uniform routing under fake tensors). What
    the forward keeps is linear in this rank's tokens; the MoE block's working sets and the
    parameters shrink at least as 1/D, up to what expert parallelism keeps constant: the
    replicated router (and gpt-oss's experts' down biases, [E, h], which every token's chosen
    experts add), and the expert running backward (its k S / E rows and its gate/up gradient
    slice do not depend on D). Attention is the dense rule's
    (Qwen3-30B-A3B has 4 key/value heads: below D = 8 they are not cut further)."""
    # h, F per expert, E, top k, replicated [E, h] tensors per sparse layer, sparse layers
    shapes = {"mixtral-8x7b": (4096, 14336, 8, 2, 1, 1), "qwen3-30b-a3b": (2048, 768, 128, 8, 1, 1),
              "glm-4.5-air": (4096, 1408, 128, 8, 1, 1), "gpt-oss-20b": (2880, 2880, 32, 4, 2, 1),
              "llama-4-scout": (5120, 8192, 16, 1, 1, 1)}
    models = tuple(shapes)
    runs = family_runs(simulations, models, (None,))
    for model in models:
        h, f, e, k, replicated, sparse = shapes[model]
        s4, s8, l8 = (runs[(model, None)][p] for p in
                      ((FAMILY_SEQ, 4), (FAMILY_SEQ, 8), (2 * FAMILY_SEQ, 8)))
        slack = FAMILY_SEQ // 8 * SLACK_PER_TOKEN
        kept = [s4["phases"]["kept"]["activations"], 2 * s8["phases"]["kept"]["activations"],
                l8["phases"]["kept"]["activations"]]
        assert max(kept) - min(kept) <= 2 * slack, (model, kept)
        router = e * h * 2
        one_expert = (k * FAMILY_SEQ // e) * 3 * f * 2 + 2 * f * h * 2  # its rows' F, its slice
        for what, allowed in ((("breakdown", "parameters"), replicated * sparse * router),
                              (("phases", "mlp_forward", "activations"), 0),
                              (("phases", "mlp_backward", "temporaries"), router + one_expert)):
            a, b = s4, s8
            for key in what:
                a, b = a[key], b[key]
            assert b <= a / 2 + allowed + slack, (model, what, a, b, allowed)


def simulate_recompute(layout: str, model: str, layers: int, seq: int) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from tsp_core.plan.simulate import SimulationRequest, record_dict
    from tsp_core.plan.simulate import simulate as run

    torch.set_num_threads(1)
    return record_dict(run(SimulationRequest(layout, 8, 1, seq, model, layers,
                                             recompute="full")))


def test_moe_leaves_nothing_after_the_step_under_recompute(simulations):
    """Under full recompute (what `tsp simulate` and `tsp plan` assume), once the step is done
    no activation of an MoE block is alive, as for the dense blocks, under TSP and the tensor-
    parallel baseline: the recompute in backward must not keep its router logits (and with them
    its graph, the routed rows and the expert activations; 42 GiB at Mixtral's 32 layers and
    128K before tsp_core.layers.moe.recomputing)."""
    recs = list(simulations.map(simulate_recompute, ["tsp", "tp"], ["mixtral-8x7b"] * 2,
                                [2, 2], [4096, 4096]))
    for rec in recs:  # the slack: the batch's int64 tensors of the tokens the rank sees
        slack = (4096 if rec["layout"] == "tp" else 4096 // 8) * SLACK_PER_TOKEN
        assert rec["phases"]["end"]["activations"] <= slack, (rec["layout"], rec["phases"]["end"])
