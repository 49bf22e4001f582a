"""TSP x pipeline parallelism (tsp_core.pipeline) against the unmodified Hugging Face Llama on one
process, float64: pp 2 x tsp 2 under 1F1B, Interleaved1F1B and InterleavedZeroBubble (2 stages
per rank), an explicit uneven layer_split (its layers on the ranks it names), the default cut of
a 4-layer Llama whose 6 units do not divide into Interleaved1F1B's 4 stages, Qwen3 (q/k norms)
and Mistral (sliding window) at pp 2 x tsp 2 with plain SGD, and pp 2 x dp 2 x tsp 1 (FSDP2 over
dp_shard 2, and plain replicas; why not with tsp 2 is written above that test), 4
micro-batches whose labelled-token counts differ (so a mean of micro-batch means would be
wrong). Each step's loss to 1e-10, the first step's gradients (before clipping) to 1e-10, the
gradient norm the clipping sees and the weights after 3 AdamW steps with clipping active (Qwen3,
Mistral: 3 unclipped plain SGD steps) to 1e-8, on every rank; the point-to-point counts of a step
are those of docs/pipeline.md; a checkpoint saved at pp 2 x tsp 2 resumes elsewhere exactly; bad
configurations are refused on every rank before any collective. A Llama with tied embeddings (the
embedding on the first stage, a copy as the head on the last, their gradients summed) is held to
the same tolerances, and its checkpoints move between pp 2 and pp 1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support import dist_pool
from tests.support.reference import assert_close

STEPS, LR, CLIP, M = 3, 1e-3, 0.05, 4
SGD_LR = 0.5
ROWS, SEQ = 8, 16
_MESHES: dict[tuple, object] = {}


def tiny_llama(seed: int = 0, layers: int = 6, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.float64)


def batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches; each micro-batch (2 rows) has its own number of labelled tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        for row in range(ROWS):
            labels[row, : 2 * row] = -100  # rows 0..7 lose 0..14 labels
        out.append({"input_ids": ids, "labels": labels})
    return out


def family_model(family: str, seed: int = 0, layers: int = 6):
    """``tiny_llama`` of ``layers`` decoder layers, or the zoo's Qwen3 or Mistral
    (tests/support/hf_models.py, float64, 2 decoder layers, h 64, vocabulary 96): Qwen3 with
    per-head q/k norms (weights spread off their ones, so a norm gradient summed over the wrong
    ranks changes the update), q/k/v biases, head_dim 24 and a sliding window of 9 on layer 1
    (the second stage's); Mistral with a sliding window of 7 on both layers. SEQ 16 is longer
    than both windows (:func:`window_acts` checks that they change the loss)."""
    if family in ("llama", "llama-tied"):
        return tiny_llama(seed, layers, tied=family == "llama-tied")
    assert layers == 6, f"{family}: the zoo's model has its own layers"
    from tests.support.hf_models import build

    return build(family, torch.float64, seed)


def training(family: str, params) -> tuple[torch.optim.Optimizer, float]:
    """(optimizer, clipping threshold): Llama AdamW clipped at CLIP; Qwen3 and Mistral plain SGD
    unclipped (the norm still measured), so the update is SGD_LR times the gradient and a
    gradient of the wrong scale shows in the weights (AdamW's update would hide it)."""
    if family in ("llama", "llama-tied"):
        return torch.optim.AdamW(params, lr=LR), CLIP
    return torch.optim.SGD(params, lr=SGD_LR), float("inf")


def reference_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 cross-entropy from the unmodified model's logits (HF's own loss casts to float32)."""
    logits = model(input_ids=batch["input_ids"]).logits
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def window_acts(family: str) -> None:
    """The first batch's loss changes when the sliding windows are widened past SEQ: the
    sequence is long enough that a pipeline ignoring the window would not match."""
    model = family_model(family)
    windowed = reference_loss(model, batches()[0]).item()
    model.config.sliding_window = 4 * SEQ
    for layer in model.model.layers:  # Qwen3's layers keep their own (Mistral's read config's)
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 4 * SEQ
    wide = reference_loss(model, batches()[0]).item()
    assert abs(wide - windowed) > 1e-6 * abs(windowed), \
        f"{family}: the window does not act at SEQ {SEQ}: loss {windowed} vs {wide} unwindowed"


def reference(family: str = "llama", layers: int = 6) -> dict:
    """One process: loss (float64 cross-entropy from HF's logits), gradients, clip, the
    optimizer of :func:`training`."""
    model = family_model(family, layers=layers)
    opt, clip = training(family, model.parameters())
    losses, norms, grads0 = [], [], None
    for batch in batches():
        loss = reference_loss(model, batch)
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, norms=norms, grads0=grads0,
                weights={n: p.detach().clone() for n, p in model.named_parameters()})


def _mesh(tsp: int, pp: int, dp_shard: int | None = None):
    import tsp_core

    key = (tsp, pp, dp_shard)
    if key not in _MESHES:
        _MESHES[key] = tsp_core.init_mesh(tsp, pp_size=pp, dp_shard=dp_shard)
    return _MESHES[key]


def _full(pipe, grads: bool) -> dict[str, torch.Tensor]:
    """Full tensors by the unmodified model's names: this rank's stages' gradients, or the whole
    model's weights (full_state_dict gathers the other stages over the pipeline group)."""
    from tests.support.gather import full_grads
    from tsp_core import full_state_dict

    return full_grads(pipe) if grads else full_state_dict(pipe)


def pipeline_run(schedule: str, tsp: int, dp_shard: int | None, family: str = "llama",
                 layer_split: list[int] | None = None, layers: int = 6, pp: int = 2) -> dict:
    """:func:`reference`'s training on a pp ``pp`` pipeline; also the names of the parameters this
    rank holds (``owned``), its pipeline rank and the ``[tsp] pipeline:`` lines it printed on
    stderr while the pipeline was built (``said``)."""
    import contextlib
    import io

    import tsp_core
    from tsp_core import comm

    mesh = _mesh(tsp, pp, dp_shard)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pipe = tsp_core.pipeline(family_model(family, layers=layers), mesh, microbatches=M,
                                 schedule=schedule, layer_split=layer_split)
    said = [line for line in err.getvalue().splitlines() if line.startswith("[tsp] pipeline:")]
    opt, clip = training(family, pipe.parameters())
    losses, norms, grads0, counts, reduces = [], [], None, None, None
    for step, batch in enumerate(batches()):
        with comm.track() as stats:
            loss = pipe.step(batch)
        if step == 1:  # the first step also runs torch's one-time warm-up handshake
            counts = {k: (stats.calls[k], stats.bytes[k]) for k in ("send", "recv")}
            reduces = (stats.calls["all_reduce"], stats.bytes["all_reduce"])
        if grads0 is None:
            grads0 = _full(pipe, grads=True)
        norms.append(float(pipe.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return dict(losses=losses, norms=norms, grads0=grads0, weights=_full(pipe, grads=False),
                counts=counts, reduces=reduces, stages=pipe.stage_indices,
                split=[list(r) for r in pipe.layer_split],
                owned=sorted(n for n, _ in pipe.named_parameters()), pp_rank=mesh.pp_rank,
                said=said)


@pytest.fixture(scope="module")
def ref():
    return reference()


def _check(per_rank: list[dict], ref: dict, what: str) -> None:
    seen: set[str] = set()
    for rank, run in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= 1e-10 * abs(b), f"{what} rank {rank} loss, step {step}: {a} vs {b}"
        for step, (a, b) in enumerate(zip(run["norms"], ref["norms"], strict=True)):
            assert abs(a - b) <= 1e-10 * abs(b), f"{what} rank {rank} norm, step {step}: {a} vs {b}"
        for key, tol in (("grads0", 1e-10), ("weights", 1e-8)):
            for name, t in run[key].items():
                assert_close(t, ref[key][name], tol, f"{what} rank {rank} {key} {name}")
        seen |= set(run["grads0"])
        missing = sorted(set(ref["weights"]) ^ set(run["weights"]))
        assert not missing, f"{what} rank {rank} full_state_dict names {missing}"
    assert seen == set(ref["grads0"]), f"{what}: grads {sorted(set(ref['grads0']) ^ seen)}"


def _check_sends(per_rank: list[dict], stages: int) -> None:
    """Each rank's sends and receives of a step (pp 2 x tsp 2), as docs/pipeline.md counts them."""
    shard = (ROWS // M) * (SEQ // 2) * 32 * 8  # [b, S/D, h] float64 bytes of one micro-batch
    for rank, run in enumerate(per_rank):
        # docs/pipeline.md: each stage but the last sends M shards forward, each but the first
        # M gradients back; each TSP rank of a stage to the same TSP rank of the next
        sends = sum(M * ((s < stages - 1) + (s > 0)) for s in run["stages"])
        assert run["counts"] == {"send": (sends, sends * shard), "recv": (sends, sends * shard)}, \
            (rank, run["counts"])
    total = sum(run["counts"]["send"][0] for run in per_rank)
    assert total == 2 * (stages - 1) * M * 2  # 2 x (stages - 1) x M per TSP position, 2 of them


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_pp2_tsp2_matches_one_process(pool, ref, schedule):
    per_rank = pool.run(pipeline_run, schedule, 2, None)
    _check(per_rank, ref, f"pp2 x tsp2 {schedule}")
    _check_sends(per_rank, 2 if schedule == "1F1B" else 4)
    # 6 layers + 2 = 8 units divide into 2 stages and into 4: the even cut, and nothing said
    assert [run["said"] for run in per_rank] == [[]] * 4, [run["said"] for run in per_rank]


# Data parallelism is checked at tsp 1 (pp 2 x dp 2 on the pool of 4), TSP inside stages at dp 1
# (pp 2 x tsp 2 above), not pp 2 x dp 2 x tsp 2 together: that takes 8 processes, a pool no
# other test uses. Measured on the suite's 2 cores (other jobs running): starting the pool of 8
# and its first pp 2 x dp 2 x tsp 2 step of this test took 62 s, against 2 to 6 s for a
# pp 2 x tsp 2 run on the shared pool of 4, and the suite is within about 3 minutes of its
# 25-minute bound.
@pytest.mark.parametrize("dp_shard", [2, None])
def test_pp2_dp2_matches_one_process(pool, ref, dp_shard):
    # dp_shard 2: FSDP2 over each stage; None: two replicas whose gradients are summed
    _check(pool.run(pipeline_run, "1F1B", 1, dp_shard), ref, f"pp2 x dp2 (dp_shard {dp_shard})")


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_pp2_tsp2_qwen3_and_mistral_match_one_process(pool, family):
    """Qwen3's q/k norm weights are replicated over each stage's TSP group, their gradients
    summed over it; Mistral's and Qwen3's sliding windows act on the 16-token rows. Plain SGD:
    every rank's losses, first gradients and weights after 3 steps against HF's."""
    window_acts(family)
    per_rank = pool.run(pipeline_run, "1F1B", 2, None, family)
    _check(per_rank, reference(family), f"{family} pp2 x tsp2")


# layer_split [1, 5] of the 6 decoder layers, not the default cut [3, 3] ((6 + 2) / 2 = 4 units a
# stage, the embedding one of stage 0's and the head one of stage 1's): pipeline rank 0 holds
# the embedding and layer 0, rank 1 layers 1 to 5, the final norm and the head
SPLIT, HELD = [1, 5], {0: {0}, 1: {1, 2, 3, 4, 5}}


def held_by(pp_rank: int, names: list[str], held: dict[int, set[int]] = HELD) -> list[str]:
    """The names of ``names`` (the unmodified model's) that ``held`` (the decoder layers of each
    pipeline rank) places on ``pp_rank``: pp 2, the embedding on rank 0, the head on rank 1."""
    ends = ("model.embed_tokens.",) if pp_rank == 0 else ("model.norm.", "lm_head.")
    return sorted(n for n in names if n.startswith(ends) or (
        n.startswith("model.layers.") and int(n.split(".")[2]) in held[pp_rank]))


def test_explicit_uneven_layer_split_trains_and_places_its_layers(pool, ref):
    per_rank = pool.run(pipeline_run, "1F1B", 2, None, layer_split=SPLIT)
    names = list(ref["grads0"])
    assert sorted(run["pp_rank"] for run in per_rank) == [0, 0, 1, 1]
    for rank, run in enumerate(per_rank):
        want = held_by(run["pp_rank"], names)
        assert run["owned"] == want, \
            f"rank {rank} (pp {run['pp_rank']}) holds {sorted(set(run['owned']) ^ set(want))} " \
            f"unlike layer_split {SPLIT}"
        assert sorted(run["grads0"]) == want, (rank, sorted(set(run["grads0"]) ^ set(want)))
        assert run["split"] == [[0], [1, 2, 3, 4, 5]], (rank, run["split"])
    _check(per_rank, ref, f"pp2 x tsp2 layer_split {SPLIT}")
    assert [run["said"] for run in per_rank] == [[]] * 4  # a cut of one's own goes unsaid


# A 4-layer Llama under Interleaved1F1B at pp 2 (4 stages) and no layer_split: 4 decoder layers +
# the embedding + the head = 6 units, which do not divide into 4 stages. The default cut
# (tsp_core.pipeline.balanced_split) is one decoder layer a stage, [1, 1, 1, 1], units
# 2, 1, 1, 2 (every stage holds a decoder layer, so no cut's busiest stage holds fewer than 2);
# stages 0 and 2 are pipeline rank 0's (the embedding, layers 0 and 2), 1 and 3 rank 1's
# (layers 1 and 3, the final norm and the head). Global rank 0 alone says the cut, one line.
UNEVEN_HELD = {0: {0, 2}, 1: {1, 3}}
UNEVEN_SAID = ("[tsp] pipeline: 4 decoder layers + the embedding + the head = 6 units do not "
               "divide into 4 stages; the most balanced cut is layer_split=[1, 1, 1, 1] (units "
               "per stage [2, 1, 1, 2]); pass layer_split for another")


def test_uneven_default_cut_interleaved_matches_one_process(pool):
    per_rank = pool.run(pipeline_run, "Interleaved1F1B", 2, None, layers=4)
    four = reference(layers=4)
    names = list(four["grads0"])
    for rank, run in enumerate(per_rank):
        assert run["split"] == [[0], [1], [2], [3]], (rank, run["split"])
        assert run["stages"] == [run["pp_rank"], run["pp_rank"] + 2], (rank, run["stages"])
        want = held_by(run["pp_rank"], names, UNEVEN_HELD)
        assert run["owned"] == want, \
            f"rank {rank} (pp {run['pp_rank']}) holds {sorted(set(run['owned']) ^ set(want))}"
        assert sorted(run["grads0"]) == want, (rank, sorted(set(run["grads0"]) ^ set(want)))
    assert [run["said"] for run in per_rank] == [[UNEVEN_SAID], [], [], []], \
        [run["said"] for run in per_rank]
    _check(per_rank, four, "pp2 x tsp2 Interleaved1F1B, 4 layers, default cut")
    _check_sends(per_rank, 4)


def tied_reference(layers: int = 4) -> dict:
    """:func:`reference` of the tied Llama, the one tied weight (``named_parameters`` names it
    ``model.embed_tokens.weight`` only) also under ``lm_head.weight``, the name the pipeline's
    last stage holds its copy by and ``state_dict`` gives it."""
    model = family_model("llama-tied", layers=layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the reference is not tied"
    ref = reference("llama-tied", layers)
    for key in ("grads0", "weights"):
        ref[key]["lm_head.weight"] = ref[key]["model.embed_tokens.weight"]
    return ref


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_tied_embedding_matches_one_process(pool, schedule):
    """The first stage holds the embedding, the last the head, a copy of the same weight; their
    gradients are summed (each copy's gradient alone is off), the norm counts the weight once."""
    per_rank = pool.run(pipeline_run, schedule, 2, None, family="llama-tied", layers=4)
    untied = pool.run(pipeline_run, schedule, 2, None, layers=4)
    ref = tied_reference()
    # docs/pipeline.md: one all-reduce more per step on every rank (each holds a copy at pp 2),
    # of its vocabulary rows of the gradient over the pair, 2 (2 - 1) / 2 x V/D x h x 8 bytes
    shard = 96 // 2 * 32 * 8
    for rank, (run, plain) in enumerate(zip(per_rank, untied, strict=True)):
        calls, sent = plain["reduces"]
        assert run["reduces"] == (calls + 1, sent + shard), (rank, run["reduces"], plain["reduces"])
    for rank, run in enumerate(per_rank):
        holds = {n for n in run["owned"] if n in ("model.embed_tokens.weight", "lm_head.weight")}
        want = {0: {"model.embed_tokens.weight"}, 1: {"lm_head.weight"}}[run["pp_rank"]]
        assert holds == want, (rank, run["pp_rank"], holds)
    _check(per_rank, ref, f"tied pp2 x tsp2 {schedule}")


def _refused(fn, pattern: str) -> str:
    from tsp_core import comm

    with comm.track() as stats:
        with pytest.raises(ValueError, match=pattern) as info:
            fn()
    assert not stats.calls, f"collectives before the error: {dict(stats.calls)}"
    return str(info.value)


def refusals() -> list[str]:
    import tsp_core
    from tsp_core import comm

    mesh, model = _mesh(2, 2), tiny_llama()

    def build(**kw):
        return lambda: tsp_core.pipeline(model, mesh, **{"microbatches": M, **kw})

    msgs = [
        _refused(build(schedule="Interleaved1F1B", stages_per_rank=4, microbatches=8),
                 r"the model has 6 decoder layers, fewer than the 8 pipeline stages asked for"),
        _refused(build(layer_split=[2, 3]), r"layer_split \[2, 3\] must give 2 stages of at "
                                            r"least one decoder layer each, 6 layers in all"),
        _refused(build(microbatches=1), r"microbatches \(1\) is fewer than the 2 pipeline stages"),
        _refused(build(schedule="ZBVZeroBubble"), r"schedule 'ZBVZeroBubble' is not one of"),
        _refused(build(schedule="1F1B", stages_per_rank=2), r"schedule '1F1B' runs 1 stage per "
                                                            r"pipeline rank"),
        _refused(lambda: tsp_core.pipeline(model, dist_pool.mesh(2), microbatches=M),
                 r"the mesh has no pipeline dim"),
    ]
    # 8 units do not divide into 6 stages: no longer refused, the default cut is one layer each
    from tsp_core.pipeline.pipeline import check_pipeline_args

    with comm.track() as stats:
        cut = check_pipeline_args(model, mesh, 6, "Interleaved1F1B", 3, None)
    assert not stats.calls and cut == (6, [range(i, i + 1) for i in range(6)]), cut
    pipe = tsp_core.pipeline(model, mesh, microbatches=M, layer_split=[2, 4])
    assert [list(r) for r in pipe.layer_split] == [[0, 1], [2, 3, 4, 5]]
    bad = batches()[0]
    msgs.append(_refused(lambda: pipe.step({k: v[:6] for k, v in bad.items()}),
                         r"the batch's 6 rows do not divide into 1 data-parallel replicas x 4 "
                         r"micro-batches; pass a multiple of 4 rows"))
    msgs.append(_refused(lambda: pipe.step({"input_ids": bad["input_ids"] + 96,
                                            "labels": bad["labels"]}),
                         r"input_ids hold values from \d+ to \d+, outside the vocabulary "
                         r"\[0, 96\)"))
    with comm.track() as stats, pytest.raises(NotImplementedError, match=r"a tsp_core.pipeline "
                                               r"holds only some stages of the model on each "
                                               r"rank and does not generate"):
        tsp_core.generate(pipe, bad["input_ids"][:1, :8], 2)
    assert not stats.calls
    dist.barrier()
    return msgs


def test_bad_configurations_are_refused_on_every_rank_before_any_collective(pool):
    per_rank = pool.run(refusals)
    assert all(msgs == per_rank[0] for msgs in per_rank)


def train(model, opt, steps, mesh=None) -> list[float]:
    """Steps of the global batches on a pipeline (``mesh`` None) or a TSP model on ``mesh`` (this
    data-parallel replica's rows); clipping at CLIP, AdamW."""
    import tsp_core

    losses = []
    for step in steps:
        batch = batches()[step]
        if mesh is None:
            loss = model.step(batch)
            model.clip_grad_norm_(CLIP)
        else:
            rank = dist.get_rank() // mesh.size
            mine = {k: v.chunk(mesh.dp_size)[rank] for k, v in batch.items()}
            loss = model(**tsp_core.shard_batch(mine, mesh)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def checkpoint_run(root: str) -> dict:
    """Saved at pp 2 x tsp 2 after step 1; the pipeline goes on for steps 2 and 3; an interleaved
    pipeline, a TSP model at tsp 2 (dp 2) and at tsp 4, each with another seed's weights until the
    load, resume from the save."""
    import tsp_core

    pipe = tsp_core.pipeline(tiny_llama(), _mesh(2, 2), microbatches=M)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    train(pipe, opt, range(1))
    path = os.path.join(root, "pp2_tsp2_step1")
    tsp_core.save_checkpoint(path, pipe, opt, step=1)
    assert tsp_core.state.resharding.read_marker(path)["model_class"] == "LlamaForCausalLM"
    losses = train(pipe, opt, range(1, STEPS))
    final = tsp_core.full_state_dict(pipe)  # the whole model on every rank
    only = tsp_core.full_state_dict(pipe, rank0_only=True)  # checked by the test (every rank)
    # into a pipeline again, Interleaved1F1B: other stages on each rank
    again = tsp_core.pipeline(tiny_llama(seed=7), _mesh(2, 2), microbatches=M,
                              schedule="Interleaved1F1B")
    again_opt = torch.optim.AdamW(again.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(path, again, again_opt) == {"step": 1}
    resumed = train(again, again_opt, range(1, STEPS))
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(resumed, losses, strict=True)), \
        f"pipeline resumed losses {resumed} vs {losses}"
    for tsp in (2, 4):
        mesh = dist_pool.mesh(tsp)
        model = tsp_core.parallelize(tiny_llama(seed=7), mesh)
        model_opt = torch.optim.AdamW(model.parameters(), lr=LR)
        assert tsp_core.load_checkpoint(path, model, model_opt) == {"step": 1}
        resumed = train(model, model_opt, range(1, STEPS), mesh)
        for step, (a, b) in enumerate(zip(resumed, losses, strict=True)):
            assert abs(a - b) <= 1e-10 * abs(b), \
                f"tsp {tsp} resumed loss, step {step + 1}: {a} vs {b}"
        got = tsp_core.full_state_dict(model)
        for name, t in final.items():
            assert_close(got[name], t, 1e-10, f"tsp {tsp} resumed: {name} after step {STEPS}")
    dist.barrier()
    return dict(losses=losses, final=final, only=only)


def test_saved_at_pp2_tsp2_resumes_interleaved_at_tsp2_tsp4_and_one_process(pool, tmp_path):
    per_rank = pool.run(checkpoint_run, str(tmp_path))
    # one process: the plain model and optimizer from the same checkpoint
    import tsp_core

    model = tiny_llama(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(str(tmp_path / "pp2_tsp2_step1"), model, opt) == {"step": 1}
    losses = []
    for batch in batches()[1:]:
        logits = model(input_ids=batch["input_ids"]).logits
        shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for step, (a, b) in enumerate(zip(losses, per_rank[0]["losses"], strict=True)):
        assert abs(a - b) <= 1e-10 * abs(b), \
            f"one process resumed loss, step {step + 1}: {a} vs {b}"
    want = model.state_dict()
    only, final0 = per_rank[0]["only"], per_rank[0]["final"]  # rank0_only: rank 0 all, others {}
    assert only.keys() == final0.keys(), sorted(only.keys() ^ final0.keys())
    assert all(torch.equal(t, final0[k]) for k, t in only.items())
    assert [run["only"] for run in per_rank[1:]] == [{}, {}, {}], \
        [sorted(run["only"]) for run in per_rank]
    for rank, run in enumerate(per_rank):  # every rank's full_state_dict(pipe): the whole model
        assert run["final"].keys() == want.keys(), \
            f"rank {rank} full_state_dict names {sorted(run['final'].keys() ^ want.keys())}"
        for name, t in want.items():
            assert_close(run["final"][name], t, 1e-10, f"rank {rank} full_state_dict: {name}")


def test_tied_embedding_fsdp2_matches_one_process(pool):
    """pp 2 x dp_shard 2 x tsp 1: each copy's gradient is FSDP2-sharded alike; the pair sums
    its data-parallel slice."""
    per_rank = pool.run(pipeline_run, "1F1B", 1, 2, family="llama-tied", layers=4)
    _check(per_rank, tied_reference(), "tied pp2 x dp_shard2 1F1B")


def test_tied_embedding_pp4_matches_one_process(pool):
    """pp 4 x tsp 1: the copies on pipeline ranks 0 and 3 sum their gradients on a group of the
    two (ranks 1 and 2, holding neither, take no part)."""
    per_rank = pool.run(pipeline_run, "1F1B", 1, None, family="llama-tied", layers=4, pp=4)
    _check(per_rank, tied_reference(), "tied pp4 x tsp1 1F1B")


def tied_checkpoint_run(root: str) -> dict:
    """A tied Llama saved at pp 2 x tsp 2 after step 1, then resumed at pp 1 (tsp 2, dp 2) from
    another seed's weights: its losses and weights follow the uninterrupted pipeline's."""
    import tsp_core

    pipe = tsp_core.pipeline(tiny_llama(layers=4, tied=True), _mesh(2, 2), microbatches=M)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    train(pipe, opt, range(1))
    path = os.path.join(root, "tied_pp2_tsp2_step1")
    tsp_core.save_checkpoint(path, pipe, opt, step=1)
    losses = train(pipe, opt, range(1, STEPS))
    final = tsp_core.full_state_dict(pipe)
    # into a pipeline again, Interleaved1F1B (the head's optimizer state read back by its name)
    again = tsp_core.pipeline(tiny_llama(seed=7, layers=4, tied=True), _mesh(2, 2),
                              microbatches=M, schedule="Interleaved1F1B")
    again_opt = torch.optim.AdamW(again.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(path, again, again_opt) == {"step": 1}
    resumed = train(again, again_opt, range(1, STEPS))
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(resumed, losses, strict=True)), \
        f"pipeline resumed losses {resumed} vs {losses}"
    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(tiny_llama(seed=7, layers=4, tied=True), mesh)
    model_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(path, model, model_opt) == {"step": 1}
    resumed = train(model, model_opt, range(1, STEPS), mesh)
    for step, (a, b) in enumerate(zip(resumed, losses, strict=True)):
        assert abs(a - b) <= 1e-10 * abs(b), f"pp 1 resumed loss, step {step + 1}: {a} vs {b}"
    got = tsp_core.full_state_dict(model)
    assert got.keys() == final.keys(), sorted(got.keys() ^ final.keys())
    for name, t in final.items():
        assert_close(got[name], t, 1e-10, f"pp 1 resumed: {name} after step {STEPS}")
    # and back: saved at pp 1, loaded into a pipeline (its head's optimizer state by its name)
    back = os.path.join(root, "tied_pp1_tsp2_step3")
    tsp_core.save_checkpoint(back, model, model_opt, step=STEPS)
    pipe = tsp_core.pipeline(tiny_llama(seed=7, layers=4, tied=True), _mesh(2, 2), microbatches=M)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(back, pipe, opt) == {"step": STEPS}
    # one more step on both (batch 0 again): the same weights, optimizer state included
    assert train(pipe, opt, range(1)) == pytest.approx(train(model, model_opt, range(1), mesh),
                                                       rel=1e-10)
    got, want = tsp_core.full_state_dict(pipe), tsp_core.full_state_dict(model)
    for name, t in want.items():
        assert_close(got[name], t, 1e-10, f"loaded from pp 1, one step on: {name}")
    dist.barrier()
    return dict(losses=losses, final=final)


def test_tied_saved_at_pp2_resumes_at_pp1_and_one_process(pool, tmp_path):
    """The checkpoint holds the model under a plain Hugging Face state dict's names (the tied
    weight under both, as ``state_dict()`` gives it) and resumes at pp 1 and in one process."""
    import torch.distributed.checkpoint as dcp

    import tsp_core

    per_rank = pool.run(tied_checkpoint_run, str(tmp_path))
    path = str(tmp_path / "tied_pp2_tsp2_step1")
    model = tiny_llama(seed=7, layers=4, tied=True)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = {k[len("model."):] for k in saved if k.startswith("model.")}
    assert names == set(model.state_dict()), sorted(names ^ set(model.state_dict()))
    # the optimizer state of the tied weight once, under the embedding's name, as one process's
    states = {k.split(".weight.")[0] + ".weight" for k in saved if k.startswith("optimizer.state.")}
    want = {f"optimizer.state.{n}" for n, _ in model.named_parameters()}
    assert states == want, sorted(states ^ want)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert tsp_core.load_checkpoint(path, model, opt) == {"step": 1}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    losses = []
    for batch in batches()[1:]:
        loss = reference_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for rank, run in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(losses, run["losses"], strict=True)):
            assert abs(a - b) <= 1e-10 * abs(b), \
                f"rank {rank}: one process resumed loss, step {step + 1}: {a} vs {b}"
        for name, t in model.state_dict().items():
            assert_close(run["final"][name], t, 1e-10, f"rank {rank} one process: {name}")
