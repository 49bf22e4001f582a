"""Dropout under TSP (tsp_core/layers/dropout.py), on Seed-OSS, whose config turns it on by
default: its ``residual_dropout`` on the attention's and MLP's outputs of each rank's own tokens
(the drop rate and the 1/(1-p) scaling measured on every rank, masks that differ between ranks
and repeat with the seed, an exact recompute under activation checkpointing; the same statistics
for Phi-3's ``resid_pdrop``, which Hugging Face applies with the layer's own ``nn.Dropout``), and
Seed-OSS's ``attention_dropout`` on the attention probabilities of each rank's queries (the
drop rate of the masks the attention applied, per rank, repeated with the seed, independent
between ranks; the pieces' exactness against plain math with those masks is
tests/layers/test_flash.py's). Exact parity at p = 0 and in eval mode with the shipped defaults
is the common family tests' (tests/support/hf_models.py "seed_oss" and "seed_oss-defaults").
TRL's ``disable_dropout_in_model`` turns off what it turns off on one process (Phi-3's modules),
and leaves on what it leaves on (Seed-OSS's functional dropout). All at dp 2 x tsp 2, so ranks
differ by TSP rank and by data-parallel rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tsp_core
from tests.support import dist_pool

P = 0.1  # SeedOssConfig()'s residual_dropout and attention_dropout
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             max_position_embeddings=256)


def seed_oss(**fields) -> nn.Module:
    """A small Seed-OSS in float64 with SeedOssConfig()'s dropouts unless ``fields`` say."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    torch.manual_seed(0)
    return SeedOssForCausalLM(SeedOssConfig(**{**SMALL, **fields})).double()


def phi3(**fields) -> nn.Module:
    """A small Phi-3 in float64 with ``resid_pdrop`` p."""
    from transformers import Phi3Config, Phi3ForCausalLM

    small = {k: v for k, v in SMALL.items() if k != "head_dim"}
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**small, pad_token_id=0, resid_pdrop=P, **fields)).double()


FAMILIES = {"seed_oss": lambda: seed_oss(attention_dropout=0.0), "phi3": phi3}


def parallel(model: nn.Module) -> nn.Module:
    return tsp_core.parallelize(copy.deepcopy(model), dist_pool.mesh(2))


def batch(model: nn.Module) -> dict:
    """This rank's share of two rows of 64 tokens (the same global batch on every rank)."""
    mesh = tsp_core.get_mesh(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (4, 64), generator=g)
    dp_rank = mesh.device_mesh.get_coordinate()[0]
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    return tsp_core.shard_batch({"input_ids": ids[mine], "labels": ids[mine]}, mesh)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def recorded(model: nn.Module, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One training forward from ``torch.manual_seed(seed)``: each attention's and MLP's output
    before and after its dropout: the layer's own dropout modules' input and output where it has
    them (Phi-3), else a hook before and one after the dropout's on the attention and MLP."""
    pairs, handles = [], []
    for layer in model.model.layers:
        own = [m for m in layer.children() if isinstance(m, nn.Dropout)]
        for module in own:
            handles.append(module.register_forward_hook(
                lambda m, i, o: pairs.append((i[0].detach(), o.detach()))))
        for module in () if own else (layer.self_attn, layer.mlp):
            raw: list[torch.Tensor] = []
            handles.append(module.register_forward_hook(
                lambda m, i, o, raw=raw: raw.append(first(o).detach()), prepend=True))
            handles.append(module.register_forward_hook(
                lambda m, i, o, raw=raw: pairs.append((raw.pop(), first(o).detach()))))
    torch.manual_seed(seed)
    model(**batch(model))
    for h in handles:
        h.remove()
    return pairs


def keep_masks(pairs) -> torch.Tensor:
    return torch.cat([(after != 0).flatten() for _, after in pairs])


def statistics_and_masks(family: str) -> None:
    model = parallel(FAMILIES[family]()).train()
    pairs = recorded(model, seed=5)
    assert len(pairs) == 2 * SMALL["num_hidden_layers"], len(pairs)
    rank = dist.get_rank()
    for before, after in pairs:
        assert before.ne(0).all()  # a zero after the dropout is a dropped element
        kept = after != 0
        want = before * kept / (1 - P)  # plain math: kept elements scaled by 1/(1-p)
        assert torch.allclose(after, want, rtol=1e-15, atol=0), f"rank {rank}: not 1/(1-p)"
    keep = keep_masks(pairs)
    sigma = (P * (1 - P) / keep.numel()) ** 0.5
    rate = 1 - keep.double().mean().item()
    assert abs(rate - P) < 5 * sigma, f"rank {rank}: drop rate {rate:.4f}, p {P} (sigma {sigma})"
    # the same seed gives the same masks; another seed other masks
    assert torch.equal(keep_masks(recorded(model, seed=5)), keep), f"rank {rank}: not repeated"
    assert not torch.equal(keep_masks(recorded(model, seed=6)), keep)
    # every rank (TSP and data-parallel) draws its own: both-dropped as often as independent
    # masks would (p^2), not as often as one shared mask would (p)
    every = [torch.empty_like(keep) for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, keep)
    for other in range(dist.get_world_size()):
        if other != rank:
            both = (~keep & ~every[other]).double().mean().item()
            assert abs(both - P * P) < 5 * (P * P / keep.numel()) ** 0.5, \
                f"ranks {rank} and {other}: both dropped {both:.4f}, independent {P * P}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_drop_rate_scaling_and_masks_per_rank(pools, family):
    pools.of(4).run(statistics_and_masks, family)


def grads(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model.zero_grad()
    loss = model(**batch(model)).loss
    loss.backward()
    assert torch.isfinite(loss)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def trains_and_recomputes_exactly() -> None:
    model = parallel(seed_oss(attention_dropout=0.0)).train()
    plain = grads(model, seed=3)
    assert any(not torch.equal(plain[n], g) for n, g in grads(model, seed=4).items())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    again = grads(model, seed=3)  # the recompute must draw the forward's masks
    for name, g in plain.items():
        assert torch.equal(again[name], g), f"rank {dist.get_rank()}: {name} under checkpointing"
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def disabled_like_trl(family: str) -> None:
    """TRL's ``disable_dropout_in_model`` (its DPO trainer's default) sets ``p = 0`` on every
    ``nn.Dropout``: on plain Phi-3 that turns its residual dropout off, so a training forward
    gives the eval loss; the TSP model must follow (Seed-OSS's functional dropout is not an
    ``nn.Dropout`` and stays on, as on one process)."""
    from trl.trainer.utils import disable_dropout_in_model

    plain = FAMILIES[family]()
    model = parallel(plain)
    disable_dropout_in_model(plain)
    disable_dropout_in_model(model)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    for m, kwargs in ((plain, {"input_ids": ids, "labels": ids}), (model, batch(model))):
        torch.manual_seed(3)
        train = m.train()(**kwargs).loss
        evaluated = m.eval()(**kwargs).loss
        off = torch.equal(train, evaluated)
        assert off == (family == "phi3"), \
            f"rank {dist.get_rank()}: {type(m).__name__} dropout off after TRL's disable: {off}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trl_disable_dropout_acts_as_on_one_process(pools, family):
    pools.of(4).run(disabled_like_trl, family)


def test_trains_with_residual_dropout_and_recomputes_exactly(pools):
    pools.of(4).run(trains_and_recomputes_exactly)


def attention_masks(model: nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training forward from ``torch.manual_seed(seed)``: its loss and the keep masks of the
    attention probabilities, every element the layers' calls asked for, in order (a spy on
    AttentionDropout.keep: the masks the pieces applied)."""
    from tsp_core.layers import dropout as dropout_module

    seen: list[torch.Tensor] = []
    keep = dropout_module.AttentionDropout.keep

    def spy(self, *args, **kwargs):
        mask = keep(self, *args, **kwargs)
        seen.append(mask.flatten())
        return mask

    dropout_module.AttentionDropout.keep = spy
    try:
        torch.manual_seed(seed)
        loss = model(**batch(model)).loss.detach()
    finally:
        dropout_module.AttentionDropout.keep = keep
    assert seen, f"rank {dist.get_rank()}: no attention dropout ran"
    return loss, torch.cat(seen)


def trains_with_attention_dropout() -> None:
    """SeedOssConfig()'s defaults (residual and attention dropout 0.1) train: finite gradients
    that repeat with the seed (recomputed exactly under activation checkpointing); the attention
    masks dropped at rate p on every rank, repeated with the seed, independent between ranks;
    eval mode runs no mask."""
    model = parallel(seed_oss()).train()
    plain = grads(model, seed=3)
    assert all(torch.isfinite(g).all() for g in plain.values())
    loss, keep = attention_masks(model, seed=3)
    rank = dist.get_rank()
    sigma = (P * (1 - P) / keep.numel()) ** 0.5
    rate = 1 - keep.double().mean().item()
    assert abs(rate - P) < 5 * sigma, f"rank {rank}: attention drop rate {rate:.4f}, p {P}"
    again, keep_again = attention_masks(model, seed=3)
    assert torch.equal(keep_again, keep) and torch.equal(again, loss), f"rank {rank}: not repeated"
    assert not torch.equal(attention_masks(model, seed=4)[1], keep)
    every = [torch.empty_like(keep) for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, keep)
    for other in range(dist.get_world_size()):
        if other != rank:
            n = min(keep.numel(), every[other].numel())
            both = (~keep[:n] & ~every[other][:n]).double().mean().item()
            assert abs(both - P * P) < 5 * (P * P / n) ** 0.5, \
                f"ranks {rank} and {other}: attention masks both dropped {both:.4f}"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed = grads(model, seed=3)
    for name, g in plain.items():
        assert torch.equal(recomputed[name], g), f"rank {rank}: {name} under checkpointing"
    model.gradient_checkpointing_disable()
    model.eval()
    with torch.no_grad():
        try:
            attention_masks(model, seed=3)
        except AssertionError as e:
            assert "no attention dropout ran" in str(e)
        else:
            raise AssertionError(f"rank {rank}: attention dropout ran in eval mode")
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_trains_with_seed_oss_default_dropouts(pools):
    pools.of(4).run(trains_with_attention_dropout)


def generation_with_dropout() -> None:
    """In training mode with dropout on, generation is refused on every rank before any
    collective, naming what drops (Hugging Face's generate would drop at every step, TSP's decode
    steps do not); in eval mode it gives the unmodified model's greedy tokens."""
    ids = torch.randint(3, SMALL["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(2))
    for make, named in ((seed_oss, "attention_dropout (0.1)"),
                        (phi3, "resid_attn_dropout (p=0.1)"),
                        (lambda: seed_oss(attention_dropout=0.0), "residual_dropout (0.1)")):
        plain = make()
        model = parallel(plain).train()
        with tsp_core.comm.track() as stats:
            try:
                tsp_core.generate(model, ids, 4)
            except NotImplementedError as err:
                assert named in str(err), (dist.get_rank(), str(err))
            else:
                raise AssertionError(f"rank {dist.get_rank()}: generated in training mode with "
                                     f"dropout on ({named})")
        assert not dict(stats.calls), dict(stats.calls)  # before any collective
        got = tsp_core.generate(model.eval(), ids, 4)
        want = plain.eval().generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), (dist.get_rank(), got, want)


def test_generation_in_training_mode_with_dropout_is_refused(pools):
    pools.of(2).run(generation_with_dropout)
