"""``tsp_core.generate``: greedy or sampled decoding on a TSP model, the same tokens on every rank,
with Hugging Face's semantics (left-padded batches, logits processed in float32, temperature ->
top-k -> top-p -> min-p, EOS handling and padding of finished rows), so that
``model.generate(...)`` on a parallelized model gives what the unmodified model gives.

Every rank computes the same logits (they are all-gathered), so the ranks pick the same token as
long as their random state is the same: with ``seed`` each rank seeds a private generator; without,
rank 0's global random state is broadcast once per call and the global generator is used, exactly
as Hugging Face's sampling uses it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed import comm
from ..distributed.fsdp import root_unsharded
from ..distributed.model_state import find_model_state, model_state
from ..layers.attention import TSPAttention
from .decode import check_prompts, decode_parts, decode_step, prefill

# Hugging Face's defaults when neither the call nor the model's generation_config sets a value
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_length": 20}


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None

    def __post_init__(self) -> None:
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature ({self.temperature}) must be > 0 for sampling; use "
                                 f"do_sample=False for greedy decoding")
            if self.top_k is not None and self.top_k < 0:
                raise ValueError(f"top_k ({self.top_k}) must be >= 0 (0 or None: no top-k)")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")
            if self.min_p is not None and not 0 <= self.min_p <= 1:
                raise ValueError(f"min_p ({self.min_p}) must be in [0, 1] (None: no min-p)")

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """Hugging Face's warpers, in its order: temperature, top-k, top-p, min-p (float32
        scores)."""
        if not self.do_sample:
            return scores
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            k = min(self.top_k, scores.shape[-1])
            scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None],
                                        float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            drop = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        if self.min_p is not None:
            scores = _min_p(scores, self.min_p)
        return scores

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        scores = self.process(logits.to(copy=True, dtype=torch.float32))
        if not self.do_sample:
            return torch.argmax(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Hugging Face's ``MinPLogitsWarper`` (one token kept at least): tokens whose probability
    is below ``min_p`` x the most likely token's are dropped."""
    probs = torch.softmax(scores, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(drop, float("-inf"))


def resolve_sampling(config: Any, do_sample: bool | None, temperature: float | None,
                     top_k: int | None, top_p: float | None,
                     min_p: float | None = None) -> Sampling:
    """Explicit arguments, else the model's generation_config, else Hugging Face's defaults.
    ``do_sample=None`` samples when any of temperature, top_k, top_p, min_p is given."""
    def pick(name: str, value: Any) -> Any:
        if value is not None:
            return value
        got = getattr(config, name, None)
        return got if got is not None else HF_DEFAULTS[name]

    if do_sample is None:
        do_sample = (any(v is not None for v in (temperature, top_k, top_p, min_p))
                     or bool(getattr(config, "do_sample", False)))
    if min_p is None:
        min_p = getattr(config, "min_p", None)
    return Sampling(bool(do_sample), float(pick("temperature", temperature)),
                    pick("top_k", top_k), float(pick("top_p", top_p)),
                    None if min_p is None else float(min_p))


def _token_list(value: Any) -> list[int]:
    if value is None:
        return []
    if torch.is_tensor(value):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _agree(model: nn.Module, values: dict[str, int], error: ValueError | None = None) -> None:
    """Raise on every rank if any rank's input was bad (``error``: this rank's) or the ranks of
    the group were called with different inputs, which would make them run different numbers of
    collectives and hang. One all-gather of a few integers."""
    mesh = decode_parts(model).mesh
    mine = torch.tensor([int(error is not None)] + list(values.values()), dtype=torch.int64,
                        device=next(model.parameters()).device)
    every = mine.new_empty(mesh.size, mine.numel())
    comm.all_gather(every, mine, mesh.group)
    table = every.tolist()
    bad = [r for r, row in enumerate(table) if row[0]]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"bad generate input on TSP rank(s) {bad} (see the error there)")
    differ = [name for j, name in enumerate(values, 1) if len({row[j] for row in table}) > 1]
    if differ:
        raise ValueError(f"ranks of the TSP group called generate with different {differ} "
                         f"({', '.join(f'rank {r}: {row[1:]}' for r, row in enumerate(table))}); "
                         f"every rank of a TSP group must pass the same prompts and arguments")


def _checksum(t: torch.Tensor) -> int:
    """Python's hash of a tuple of ints: the same in every process (only str/bytes are salted)."""
    return hash((tuple(t.shape), tuple(t.reshape(-1).tolist()))) & 0x7FFFFFFFFFFF


def _sync_global_rng(model: nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's global random state (one broadcast), so that sampling with the
    global generator draws the same tokens on every rank."""
    mesh = decode_parts(model).mesh
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    for i, state in enumerate(states):
        buf = state.to(device)
        comm.broadcast(buf, 0, mesh.group)
        if i == 0:
            torch.set_rng_state(buf.cpu())
        else:
            torch.cuda.set_rng_state(buf.cpu(), device)


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int | None = None,
             return_logits: bool = False, min_p: float | None = None):
    """Generate up to ``max_new_tokens`` tokens after left-padded prompts ``input_ids`` [B, S]
    (identical on every rank of the TSP group) on a model from :func:`tsp_core.parallelize` (a
    converted PEFT PeftModel too: its active adapter, as ``PeftModel.generate``).

    Returns the LongTensor [B, S + new] (prompts, then the new tokens; rows that stopped are
    padded with ``pad_token_id``), the same on every rank; with ``return_logits`` also the list
    of each step's logits [B, V] (the model's dtype). Greedy unless sampling is asked for
    (``do_sample=True`` or any of temperature, top_k, top_p, min_p); unset values come from
    ``model.generation_config``, then Hugging Face's defaults (top_k 50 when sampling). Stops
    when every row produced an EOS token (``eos_token_id``, default the generation config's;
    ``[]`` for none)."""
    with root_unsharded(model):
        return _generate(model, input_ids, max_new_tokens, attention_mask, do_sample, temperature,
                         top_k, top_p, eos_token_id, pad_token_id, seed, return_logits, min_p)


def active_dropouts(model: nn.Module, state: Any) -> list[str]:
    """What drops elements in a training forward of the TSP ``model``: ``nn.Dropout`` modules
    with p > 0 (RankDropoutModule among them), attention dropout, the policy's output dropout."""
    found = [f"{n} (p={m.p})" for n, m in model.named_modules()
             if isinstance(m, nn.Dropout) and m.p > 0]
    found += [f"{n}.attention_dropout ({m.attention_dropout})" for n, m in model.named_modules()
              if isinstance(m, TSPAttention) and m.attention_dropout]
    field = state.policy.output_dropout if state is not None else None
    if field and getattr(model.config, field, 0):
        found.append(f"config.{field} ({getattr(model.config, field)})")
    return found


def refuse_training_dropout(model: nn.Module, state: Any) -> None:
    """Generation in training mode with dropout on is refused (every rank alike, before any
    collective): Hugging Face's generate drops elements at every step then, while TSP's decode
    steps apply no dropout and must give every rank the same token."""
    found = active_dropouts(model, state) if model.training else []
    if found:
        raise NotImplementedError(
            f"generation of a model in training mode with dropout on ({len(found)}: "
            f"{', '.join(found[:3])}): Hugging Face's generate would drop elements at every "
            f"step, TSP's decode steps apply no dropout; call model.eval() before generating "
            f"(and model.train() after), or set the dropout to 0")


def _generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
              attention_mask: torch.Tensor | None, do_sample: bool | None,
              temperature: float | None, top_k: int | None, top_p: float | None,
              eos_token_id: int | Sequence[int] | None, pad_token_id: int | None,
              seed: int | None, return_logits: bool, min_p: float | None):
    state = find_model_state(model)
    if state is not None and state.partial:  # tsp_core.pipeline: some stages per rank
        raise NotImplementedError(
            "a tsp_core.pipeline holds only some stages of the model on each rank and does not "
            "generate; save_checkpoint it and load the checkpoint into "
            "tsp_core.parallelize(model, tsp_core.init_mesh(tsp_size)) to generate")
    refuse_training_dropout(model, state)
    config = getattr(model, "generation_config", None)
    sampling = resolve_sampling(config, do_sample, temperature, top_k, top_p, min_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    eos = _token_list(eos_token_id if eos_token_id is not None
                      else getattr(config, "eos_token_id", None))
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]       # as Hugging Face does
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    error = None
    try:  # this rank's input; every rank learns of a bad one before the first schedule collective
        check_prompts(input_ids, attention_mask, model.config.vocab_size)
    except ValueError as e:
        error = e
    _agree(model, {"prompts": _checksum(input_ids), "attention_mask": _checksum(mask),
                   "max_new_tokens": max_new_tokens, "do_sample": int(sampling.do_sample),
                   "seed": -1 if seed is None else int(seed)}, error)
    logits, cache = prefill(model, input_ids, attention_mask)
    generator = None
    if sampling.do_sample:
        if seed is not None:
            generator = torch.Generator(device=logits.device).manual_seed(int(seed))
        else:
            _sync_global_rng(model, logits.device)
    cache.reserve(max(0, max_new_tokens - 1))
    policy = model_state(model).policy  # Phi-3: HF's generate recomputes its cache once
    recompute = getattr(policy, "recompute_cache_at", None)
    recompute_at = None if recompute is None else recompute(model.config)
    decoded = 0  # tokens decoded since the cache was filled
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    tokens, steps = [], []
    for step in range(max_new_tokens):
        if return_logits:
            steps.append(logits)
        nxt = sampling.pick(logits, generator).to(input_ids.device)
        if eos:
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad_token_id))
            unfinished &= ~torch.isin(nxt, eos_t)
        tokens.append(nxt)
        if eos and not bool(unfinished.any()):
            break
        if step + 1 < max_new_tokens:
            if recompute_at is not None and input_ids.shape[1] + step + 1 == recompute_at + 1:
                # as Hugging Face's generate does for this family: the whole sequence again (a
                # length-dependent rope switches here, e.g. longrope's short to long factors)
                so_far = torch.cat([input_ids] + [t[:, None] for t in tokens], dim=1)
                logits, cache = prefill(model, so_far, torch.cat(
                    [mask, mask.new_ones(mask.shape[0], step + 1)], dim=1))
                cache.reserve(max(0, max_new_tokens - step - 2))
                decoded = 0
            else:
                logits = decode_step(model, cache, nxt, cache.lengths + decoded)
                decoded += 1
    out = torch.cat([input_ids] + [t[:, None] for t in tokens], dim=1) if tokens else input_ids
    return (out, steps) if return_logits else out


# ------------------------------------------------------------------- Hugging Face's generate

# generation_config fields TSP generate does not implement, with the values that mean "off"
_OFF = {
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "num_beam_groups": (None, 1),
    "penalty_alpha": (None,), "repetition_penalty": (None, 1.0), "encoder_repetition_penalty":
    (None, 1.0), "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "bad_words_ids": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "top_h": (None,), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "diversity_penalty": (None, 0.0),
    "exponential_decay_length_penalty": (None,), "sequence_bias": (None,),
    "guidance_scale": (None, 1.0), "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False), "output_scores": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False),
    "stop_strings": (None,), "max_time": (None,), "watermarking_config": (None,),
    "dola_layers": (None,), "prompt_lookup_num_tokens": (None,), "use_cache": (None, True),
    "low_memory": (None, False), "token_healing": (None, False),
}
_CALL_ARGS = {"input_ids", "attention_mask", "max_new_tokens", "max_length", "do_sample",
              "temperature", "top_k", "top_p", "min_p", "eos_token_id", "pad_token_id",
              "return_dict_in_generate", "output_logits", "seed"} | set(_OFF)
SUPPORTED_ARGS = ("inputs/input_ids", "attention_mask", "max_new_tokens", "max_length",
                  "do_sample", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
                  "pad_token_id", "generation_config", "return_dict_in_generate",
                  "output_logits", "seed")


def hf_generate(model: nn.Module, inputs: torch.Tensor | None = None, generation_config: Any = None,
                **kwargs: Any):
    """``model.generate(...)`` of a parallelized model: the arguments Hugging Face's generate takes
    that TSP supports (``SUPPORTED_ARGS``) are routed to :func:`generate`; anything else raises
    a ``ValueError`` naming it, before any collective."""
    given = {k for k, v in kwargs.items() if v is not None}
    unknown = sorted(given - _CALL_ARGS)
    if unknown:
        raise ValueError(f"TSP generate does not support {unknown}; supported: "
                         f"{', '.join(SUPPORTED_ARGS)} (greedy or multinomial sampling)")
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("pass the prompts as model.generate(input_ids, ...)")
    attention_mask, seed = kwargs.pop("attention_mask", None), kwargs.pop("seed", None)
    return_dict = kwargs.pop("return_dict_in_generate", None)
    output_logits = kwargs.pop("output_logits", None)
    config = copy.deepcopy(generation_config or model.generation_config)
    for k, v in kwargs.items():
        if v is not None:
            setattr(config, k, v)
    bad = sorted(f"{k}={getattr(config, k)!r}" for k, ok in _OFF.items()
                 if getattr(config, k, None) not in ok)
    if bad:
        raise ValueError(f"TSP generate does not support {bad} (from the call or the model's "
                         f"generation_config); supported: {', '.join(SUPPORTED_ARGS)}")
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = (config.max_length or HF_DEFAULTS["max_length"]) - input_ids.shape[1]
        if max_new <= 0:
            raise ValueError(f"max_length ({config.max_length}) leaves no room after a prompt of "
                             f"{input_ids.shape[1]} tokens; set max_new_tokens")
    eos = _token_list(config.eos_token_id)
    if attention_mask is None and config.pad_token_id is not None and \
            config.pad_token_id not in eos and bool((input_ids == config.pad_token_id).any()):
        attention_mask = (input_ids != config.pad_token_id).long()   # Hugging Face's inference
    sampling = {k: getattr(config, k, None) for k in ("temperature", "top_k", "top_p", "min_p")}
    out, steps = generate(model, input_ids, max_new, attention_mask=attention_mask,
                          do_sample=bool(config.do_sample), eos_token_id=eos,
                          pad_token_id=config.pad_token_id, seed=seed, return_logits=True,
                          **sampling)
    if not (return_dict or config.return_dict_in_generate):
        return out
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    logits = tuple(s.to(dtype=torch.float32) for s in steps) if (
        output_logits or config.output_logits) else None
    return GenerateDecoderOnlyOutput(sequences=out, logits=logits)
