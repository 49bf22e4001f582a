"""Per-rank memory of a whole model under any layout, measured on one CPU (docs/design.md "Memory
rules"): the real model code of rank 0 of a ``degree``-rank world runs one training step under
``FakeTensorMode`` with the ``fake`` process-group backend, and ``MemTracker`` records every tensor
it allocates.

The peak is split into parameters, gradients, optimizer states (AdamW's two moments, allocated
the way ``torch.optim.AdamW`` allocates them), activations (saved for backward) and temporaries.
``phases`` adds the same split at the moments that the memory rules (docs/design.md "Memory rules")
are about: what the forward leaves for backward, and what each decoder layer's attention and MLP add
while they run (a sparse layer's MLP phase is its mixture-of-experts block,
``tsp_core.layers.moe.TSPMoE`` or the baselines' ``TensorParallelMoE``, found where the family's
policy keeps the MLP; under fake tensors its routing is uniform).
The optimizer step's own transients are not simulated (a fake tensor has no value for AdamW's step
count). Every layout runs the same flash-piece attention kernels and the same recompute wrapper, so
the comparison is like for like.

With ``dp_shard`` N > 1 the world is ``degree x N`` ranks and FSDP2 shards the model state over
N of them (docs/design.md "FSDP2 on the data-parallel axis"): the real ``fully_shard`` runs,
measured by ``FSDPMemTracker``, which adds FSDP2's own buffers to the split (unsharded parameters
and gradients, all-gather and reduce-scatter buffers; :mod:`tsp_core.plan.fsdp_sim`).

With ``activation_offload`` every layout gets the same host offload of its checkpointed layer
inputs (:func:`tsp_core.models.offload.install_activation_offload` works on any Hugging Face
decoder): the offloaded copies land on the fake ``meta`` device (:data:`HOST`), so ``peak_bytes``
stays the simulated GPU's peak and ``host_bytes`` is the host's, apart. ``tile_tokens`` is TSP's
(its MLP, experts and loss run a tile of tokens at a time); the baselines' are not tiled.

With ``step="grpo"`` the step is one GRPO step (:mod:`tsp_core.plan.grpo_sim`): the policy's
training step through GRPO's per-token loss, plus a frozen reference model of the same shape laid
out like the policy, resident, and its no-grad forward giving per-token log-probabilities; the
record also carries the rollout's peak, computed (not simulated) from the measured resident state
and the KV cache. With ``lora`` r the model is PEFT's ``PeftModel`` with LoRA of rank r on the
seven projections, its base frozen (:mod:`tsp_core.plan.lora_sim`; TSP only); with ``qlora``
too, that base's projections are 4-bit NF4 shards, held, moved and dequantized per round as
QLoRA training does.

Each record owns the default process group of its process while it runs; :func:`simulate_many`
runs records in ``jobs`` worker processes, each worker taking one record after another: every
record builds its own process group, fake tensor mode and tracker, so a worker's second record
equals what a fresh process gives (tests/plan/test_memory.py checks), without a process start and
its imports (about 5 s of CPU) per record.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from multiprocessing import get_context

import torch
import torch.distributed as dist

GIB = 1024 ** 3
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "none")

# Model shapes (random weights, never downloaded; "model_type" defaults to llama). "7b" is the
# paper's dense model: h=4096, 32 layers, 32 heads, gated MLP with intermediate 16384. The others
# are the published configs' shapes (Mixtral-8x7B, Qwen3-30B-A3B: sparse MoE in every layer;
# Qwen3-30B-A3B's intermediate_size is that of dense layers it does not have).
MODELS = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936),
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360,
                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, vocab_size=262208, query_pre_attn_scalar=256,
                        sliding_window=1024),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, vocab_size=256000, query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0),
    "olmo-2-7b": dict(model_type="olmo2", hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      vocab_size=100352),
    # Llama-3.1-8B (untied, GQA with 8 key/value heads, Llama 3's rope scaling)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072,
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    # Llama-3.1-405B, its published sizes: h 16384, 126 layers, 128 heads and 8 key/value heads of
    # 128, intermediate 53248, vocabulary 128256, untied, Llama 3's rope scaling (theta 5e5)
    "llama-3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                           tie_word_embeddings=False, max_position_embeddings=131072,
                           rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0,
                                                original_max_position_embeddings=8192)),
    # Llama-2-70B (untied, RMSNorm, GQA with 8 key/value heads)
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                      tie_word_embeddings=False),
    # sparse mixture-of-experts (tsp_core.layers.moe, docs/moe.md): every layer's MLP is the experts
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                         sliding_window=None),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[]),
    # GLM-4.5-Air, the sizes of its published config.json (zai-org/GLM-4.5-Air): h 4096, 46
    # layers (the first dense: first_k_dense_replace 1, intermediate 10944), 96 query heads of
    # 128 (q width 12288) and 8 key/value heads, q/k/v biases, no q/k norms, partial rotary 0.5
    # (theta 1e6), 128 routed experts of 1408 channels, top 8 (sigmoid router, one group,
    # scaling 1.0, renormalised) plus 1 shared expert, vocabulary 151552, untied: 106.85e9
    # parameters (its next-token-prediction layer, num_nextn_predict_layers, is not trained by
    # Hugging Face's model and is left out)
    "glm-4.5-air": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944,
                        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                        head_dim=128, vocab_size=151552, attention_bias=True, use_qk_norm=False,
                        partial_rotary_factor=0.5, rope_theta=1000000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
                        num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                        routed_scaling_factor=1.0, norm_topk_prob=True),
    # DeepSeek-V3, the sizes of its published config.json (deepseek-ai/DeepSeek-V3): h 7168, 61
    # layers (the first 3 dense: first_k_dense_replace 3, intermediate 18432), multi-head latent
    # attention with 128 heads (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v
    # 128, interleaved rotary pairs), yarn rope (factor 40 over 4096, theta 1e4, mscale 1), 256
    # routed experts of 2048 channels, top 8 of the 4 best of 8 groups (sigmoid router with the
    # correction bias, scaling 2.5, renormalised) plus 1 shared expert, vocabulary 129280,
    # untied: 671.03e9 parameters (its next-token-prediction layer is not part of Hugging Face's
    # model and is left out)
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                        vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_interleave=True, rope_theta=10000.0, rope_scaling=dict(
                            rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                        max_position_embeddings=163840, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, moe_intermediate_size=2048,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        first_k_dense_replace=3, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    # gpt-oss-20b, the sizes of its published config.json (openai/gpt-oss-20b): h 2880, 24
    # layers alternating sliding (window 128) and full attention with sinks, 64 query heads of
    # 64 and 8 key/value heads, q/k/v/o biases, yarn rope (factor 32 over 4096, theta 150000),
    # 32 experts of 2880 channels with biases in every layer, top 4 (softmax over the top
    # logits), the clamped SwiGLU (limit 7.0), vocabulary 201088, untied: 20.91e9 parameters
    # (trained in bf16 here; the Hub's experts are MXFP4)
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, vocab_size=201088, attention_bias=True, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        rope_theta=150000.0, rope_scaling=dict(
                            rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                            original_max_position_embeddings=4096, truncate=False),
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, num_local_experts=32, num_experts_per_tok=4,
                        swiglu_limit=7.0),
    # Llama-4-Scout-17B-16E's text model, the sizes of its published config.json's text_config
    # (meta-llama/Llama-4-Scout-17B-16E): h 5120, 48 layers, every one sparse (16 experts of
    # 8192 channels, top 1 weighted by its sigmoid, plus a shared expert of 8192), 40 query
    # heads of 128 and 8 key/value heads, chunked attention (8192) on the RoPE layers and NoPE
    # every fourth layer with the attention temperature (floor_scale 8192, attn_scale 0.1), the
    # L2 q/k norm, llama3 rope (theta 5e5, factor 16 over 8192), vocabulary 202048, untied
    "llama-4-scout": dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                          intermediate_size_mlp=16384, num_hidden_layers=48,
                          num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                          vocab_size=202048, num_local_experts=16, num_experts_per_tok=1,
                          interleave_moe_layer_step=1, attention_chunk_size=8192,
                          use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
                          attn_scale=0.1, rope_theta=500000.0, rope_scaling=dict(
                              rope_type="llama3", factor=16.0, low_freq_factor=1.0,
                              high_freq_factor=1.0, original_max_position_embeddings=8192),
                          max_position_embeddings=10485760, rms_norm_eps=1e-5,
                          attention_bias=False, tie_word_embeddings=False),
    # Qwen3.5-9B's text model, the defaults of transformers 5.24's Qwen3_5TextConfig (its
    # docstring: "the Qwen3.5-9B style configuration"): h 4096, 32 layers, three Gated DeltaNet
    # (linear attention) layers to every full-attention one (full_attention_interval 4; linear
    # layers: 16 key heads and 32 value heads of 128, convolution kernel 4), full attention with
    # 16 query heads of 256 and 4 key/value heads, the output gate, per-head q/k norms, partial
    # rotary 0.25 (theta 1e4), MLP 12288, vocabulary 248320, untied
    "qwen3.5": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=256, vocab_size=248320, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=32, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                         partial_rotary_factor=0.25)),
    "7b": dict(hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=4096),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
}
# where the simulation stands in for host memory: activation offload (tsp_core.models.offload)
# moves a fake tensor's copy to "meta", which MemTracker counts apart from the simulated device
HOST = "meta"
CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer_states",
              "Activation": "activations", "Temp": "temporaries", "Buffer": "buffers",
              "Other": "other"}


@dataclass(frozen=True)
class SimulationRequest:
    layout: str          # a name from tsp_core.baselines.LAYOUTS
    tp: int
    cp: int
    seq: int
    model: str = "7b"
    layers: int | None = None  # override the model's layer count
    batch: int = 1
    recompute: str = "none"
    optimizer: str = "adamw"
    dtype: str = "bfloat16"
    dp_shard: int = 1    # FSDP2 ranks each rank's model state is sharded over (1: no FSDP2)
    tile_tokens: int | None = None  # TSP's MLP, experts and loss tile (None: from the sizes)
    activation_offload: bool = False  # each checkpointed layer's input kept on the host
    step: str = "train"  # "train" or "grpo" (tsp_core.plan.grpo_sim.STEPS)
    lora: int | None = None  # LoRA rank, seven projections, base frozen (plan.lora_sim)
    qlora: bool = False  # with lora: the base's projections 4-bit NF4 (QLoRA, plan.lora_sim)


@dataclass
class MemoryRecord:
    layout: str          # e.g. "tp+cp(4x2)"
    name: str
    tp: int
    cp: int
    degree: int
    seq: int
    batch: int
    model: str
    layers: int
    recompute: str
    optimizer: str
    dtype: str
    peak_bytes: int
    breakdown: dict[str, int]
    seconds: float
    # "kept": the breakdown when the forward (loss included) has returned, i.e. what is kept for
    # backward; "{attention,mlp}_{forward,backward}": what that module added, by category, from
    # its start to its own peak (the decoder layer where that is largest); "end": after backward
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    dp_shard: int = 1
    # the host's peak (activation offload: the offloaded layer inputs), apart from peak_bytes
    host_bytes: int = 0
    tile_tokens: int | None = None
    activation_offload: bool = False
    step: str = "train"
    # step "grpo": the reference model's parameter bytes on this rank (inside "parameters"), and
    # the rollout's peak on this rank, computed (tsp_core.plan.grpo_sim.rollout_bytes)
    reference_bytes: int = 0
    rollout_bytes: int = 0
    lora: int | None = None
    # the trainable parameters' bytes on this rank: the adapters under LoRA (inside "parameters")
    trainable_bytes: int = 0
    qlora: bool = False  # the base's projections NF4 shards (their bytes: "buffers")

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def host_gib(self) -> float:
        return self.host_bytes / GIB

    @property
    def gpus(self) -> int:
        """Ranks of the simulated world: ``degree x dp_shard``."""
        return self.degree * self.dp_shard


def model_config(name: str, layers: int | None = None, seq: int = 4096):
    """The config of a preset (:data:`MODELS`) or of a ``config.json`` (a file, or the folder
    holding one: any family ``tsp_core.parallelize`` supports); ``layers`` cuts the layer count
    (and ``layer_types``), and the context is at least ``seq``."""
    import os

    from transformers import AutoConfig

    if name in MODELS:
        kw = dict(MODELS[name])
        config = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw)
    elif os.path.isfile(name) or os.path.isfile(os.path.join(name, "config.json")):
        import json

        path = name if os.path.isfile(name) else os.path.join(name, "config.json")
        with open(path) as f:  # any file name: the folder need not hold a config.json
            kw = json.load(f)
        if "model_type" not in kw:
            raise ValueError(f"{path} has no model_type: not a Hugging Face config.json")
        config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)} or give the path "
                         f"of a config.json")
    config = getattr(config, "text_config", None) or config   # e.g. Gemma 3's multimodal config
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.max_position_embeddings = max(seq, getattr(config, "max_position_embeddings", 0) or 0)
    return config


def recompute_kwargs(recompute: str) -> dict | None:
    """``activation_checkpointing_kwargs`` for every decoder layer, the same for every layout:
    ``full`` keeps only each layer's input; ``selective`` (PyTorch's selective activation
    checkpointing) keeps matmul and attention-kernel outputs and recomputes the rest (norms,
    activations, RoPE, elementwise ops)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    if recompute == "none":
        return None
    if recompute == "full":
        return {"use_reentrant": False}
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default}

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return {"use_reentrant": False,
            "context_fn": partial(create_selective_checkpoint_contexts, policy)}


@contextlib.contextmanager
def _private_sharding_propagation() -> Iterator[None]:
    """DTensor computes each op's global output shape by running it on fake tensors, borrowing the
    ambient fake mode when there is one. On a device that allocates nothing; in the simulation the
    tracker would count those global-shape tensors as this rank's, so give DTensor its own mode."""
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


def _adamw_states(optimizer: torch.optim.Optimizer) -> None:
    """The state AdamW allocates on its first step: a step count and two moments per parameter."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def on_device(snapshot: dict) -> dict:
    """The simulated device's entry of a tracker's ``{device: {reftype: bytes, "Total": bytes}}``:
    every device but :data:`HOST` (which holds what activation offload moved to the host)."""
    (per_kind,) = [v for k, v in snapshot.items() if torch.device(k).type != HOST]
    return per_kind


def host_total(snapshot: dict) -> int:
    """Bytes on :data:`HOST` in a tracker's snapshot (0 when nothing was offloaded)."""
    return sum(int(v["Total"]) for k, v in snapshot.items() if torch.device(k).type == HOST)


def _categories(per_kind: dict) -> dict[str, int]:
    """One device's entry of MemTracker's ``{device: {reftype: bytes, "Total": bytes}}`` -> bytes
    by category."""
    return {CATEGORIES.get(str(getattr(k, "value", k)), str(k)): int(v)
            for k, v in per_kind.items() if str(k) != "Total"}


def _phases(tracker, model: torch.nn.Module, layers) -> dict[str, dict[str, int]]:
    """See :attr:`MemoryRecord.phases`."""
    from torch.distributed._tools.mem_tracker import _ModState

    from ..models.policies import find_policy

    stats = tracker.memory_tracking
    out = {"kept": _categories(on_device(stats[model].snapshots[_ModState.POST_FW][-1]))}
    names = find_policy(model).modules
    for role in ("attention", "mlp"):
        for phase, start, peak in (("forward", _ModState.PRE_FW, _ModState.PEAK_FW),
                                   ("backward", _ModState.PRE_BW, _ModState.PEAK_BW)):
            best: dict[str, int] | None = None
            for layer in layers:  # a layer without the role's module (Qwen3.5's linear-
                module = getattr(layer, getattr(names, role), None)  # attention ones): skipped
                if module is None:
                    continue
                snaps = stats[module].snapshots
                a, b = (_categories(on_device(snaps[m][0])) for m in (start, peak))
                added = {k: b[k] - a.get(k, 0) for k in b}
                if best is None or sum(added.values()) > sum(best.values()):
                    best = added
            out[f"{role}_{phase}"] = best or {}
    return out


def simulate(req: SimulationRequest) -> MemoryRecord:
    """Peak memory of rank 0 over one training step of ``req``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from ..baselines import build
    from ..baselines.layouts import LayoutSpec, ParallelModel, build_mesh
    from . import fsdp_sim, grpo_sim, lora_sim
    from .peak_tracker import IndexedMemTracker as MemTracker  # PyTorch's, faster: same numbers

    if req.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {req.optimizer!r} is not one of {OPTIMIZERS}")
    ckpt = recompute_kwargs(req.recompute)
    check_request(req)
    spec = LayoutSpec(req.layout, req.tp, req.cp)
    fsdp_sim.check_dp_shard(spec.name, spec.degree, req.dp_shard)
    fsdp = req.dp_shard > 1
    config = model_config(req.model, req.layers, req.seq)
    dtype = getattr(torch, req.dtype)
    grpo = req.step == "grpo"
    start = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=spec.degree * req.dp_shard,
                            store=FakeStore())
    try:
        mesh = fsdp_sim.build_mesh(spec, req.dp_shard) if fsdp else build_mesh(spec)
        mode = FakeTensorMode()
        with mode, _private_sharding_propagation():
            model = _new_model(AutoModelForCausalLM, config, dtype)
            if fsdp:  # FSDP2 takes one dtype per layer: what a model builds float32 (DeepSeek-V3's
                for p in model.parameters():  # router) is cast, as a user must cast it
                    if p.dtype != dtype:
                        p.data = p.data.to(dtype)
            if ckpt is not None:  # before build: activation offload needs it
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
            inner = model
            if req.lora is not None:  # PEFT first, as TSPSFTTrainer(peft_config=...) applies it
                model = lora_sim.wrap(model, req.lora)
            # TSP: parallelize applies FSDP2 on a dp_shard mesh
            pm = build(model, spec, mesh, tile_tokens=req.tile_tokens,
                       activation_offload=req.activation_offload)
            if req.qlora:  # the NF4 shards QLoRA's conversion holds, in the float shards' place
                lora_sim.quantize_base(model)
            ref = (grpo_sim.build_reference(_new_model(AutoModelForCausalLM, config, dtype), spec,
                                            mesh, req.tile_tokens) if grpo else None)
        if fsdp and spec.name != "tsp":
            fsdp_sim.shard_baseline(pm)
        with mode, _private_sharding_propagation():
            model.train()
        ids = torch.zeros(req.batch, req.seq, dtype=torch.long)
        local = pm.shard({"input_ids": ids, "labels": ids})  # real index tensors, then faked
        with mode, _private_sharding_propagation():
            local = {k: mode.from_tensor(v) for k, v in local.items()}
            optimizer = None
            if req.optimizer == "adamw":
                optimizer = torch.optim.AdamW(lora_sim.adapter_parameters(model))
                _adamw_states(optimizer)
            if fsdp:
                tracker, split = fsdp_sim.tracker(model, optimizer), fsdp_sim.categories
            else:
                tracker = (lora_sim.tracker_class() if req.lora else MemTracker)()
                split = _categories
                tracker.track_external(*([model] + ([optimizer] if optimizer else [])
                                         + ([ref.model] if grpo else [])))
            with tracker:
                if grpo:
                    grpo_sim.step_local(pm, ref, local)
                else:
                    pm.step_local(local)
                end = split(on_device(tracker.get_tracker_snapshot()))
            peak = tracker.get_tracker_snapshot("peak")
            # FSDPMemTracker keeps snapshots of the FSDP2 units only: no per-module phases
            layers = ParallelModel(inner, spec, mesh).layers  # a PeftModel's: its model's
            phases = {"end": end} if fsdp else _phases(tracker, model, layers) | {"end": end}
            trainable = grpo_sim.parameter_bytes(lora_sim.adapter_parameters(model))
            reference = grpo_sim.parameter_bytes(ref.model) if grpo else 0
            kv = (grpo_sim.kv_cache_bytes(config, spec, req.batch, req.seq, dtype.itemsize)
                  if grpo else 0)
    finally:
        dist.destroy_process_group()
    breakdown = split(on_device(peak))
    return MemoryRecord(spec.label, spec.name, spec.tp, spec.cp, spec.degree, req.seq, req.batch,
                        req.model, config.num_hidden_layers, req.recompute, req.optimizer,
                        req.dtype, int(on_device(peak)["Total"]), breakdown,
                        time.perf_counter() - start, phases, req.dp_shard, host_total(peak),
                        req.tile_tokens, req.activation_offload, req.step, reference,
                        grpo_sim.rollout_bytes(breakdown, kv) if grpo else 0, req.lora,
                        trainable, req.qlora)


def _new_model(auto, config, dtype: torch.dtype) -> torch.nn.Module:
    """``auto.from_config(config)`` built in ``dtype`` (``.to(dtype)`` fails under fake mode)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return auto.from_config(config)
    finally:
        torch.set_default_dtype(default)


def check_request(req: SimulationRequest) -> None:
    """Refuse what the long-context switches cannot do, naming the fix (before any process)."""
    from ..layers.tiles import check_tile_tokens
    from .grpo_sim import check_step
    from .lora_sim import check_lora

    check_tile_tokens(req.tile_tokens)  # and a baseline's is refused by baselines.build
    check_step(req.step, req.dp_shard)
    check_lora(req.lora, req.layout, req.dp_shard, req.qlora)
    if req.activation_offload and req.recompute == "none":
        raise ValueError("activation offload moves the checkpointed layer inputs to the host and "
                         "needs activation checkpointing: recompute 'full' or 'selective', not "
                         "'none'")


def _run_one(req: SimulationRequest) -> MemoryRecord:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    return simulate(req)


def simulate_many(requests: list[SimulationRequest], jobs: int = 2,
                  progress=None) -> list[MemoryRecord]:
    """Run every request in ``jobs`` spawned worker processes (module docstring); results in
    request order. ``progress(record)`` is called as each finishes."""
    ctx = get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        futures = [pool.submit(_run_one, r) for r in requests]
        out = []
        for f in futures:
            try:
                rec = f.result()
            except BaseException:  # a refused request: the rest are not waited for
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            if progress is not None:
                progress(rec)
            out.append(rec)
    return out


def record_dict(rec: MemoryRecord) -> dict:
    out = asdict(rec) | {"peak_gib": rec.peak_gib, "host_gib": rec.host_gib, "gpus": rec.gpus}
    return out | ({"rollout_gib": rec.rollout_bytes / GIB} if rec.step == "grpo" else {})
