"""``parallelize`` leaves the caller's config object as it was: the converted model runs on a copy
(tsp_core.models.wrap.own_config) that says attn_implementation="tsp", and a plain model that
shares the original object (transformers does not copy the config it is given) keeps running
its own attention, with the same logits as before the conversion."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma3Config, LlamaConfig, LlamaForCausalLM, PretrainedConfig

import tsp_core
from tests.support import dist_pool, hf_models
from tsp_core.models.wrap import own_config


def configs_held(model: nn.Module) -> dict[str, PretrainedConfig]:
    """Each config a module of ``model`` holds as an attribute, by dotted name."""
    return {f"{n}.{k}".lstrip("."): v for n, m in model.named_modules()
            for k, v in vars(m).items() if isinstance(v, PretrainedConfig)}


def a_shared_config_survives() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, **hf_models.COMMON)
    model = LlamaForCausalLM(config).double()
    plain = LlamaForCausalLM(config).double()  # the same config object, the same weights
    plain.load_state_dict(model.state_dict())
    assert plain.config is config and model.config is config
    before_config = config.to_dict()
    impl = config._attn_implementation
    assert impl != "tsp"
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        before = plain(input_ids=ids).logits
    held = configs_held(model)
    assert set(map(id, held.values())) == {id(config)}, held  # the modules the copy must reach

    mesh = dist_pool.mesh(1)
    tsp_core.parallelize(model, mesh)
    # the caller's config: as it was, and still the plain model's
    assert config._attn_implementation == impl
    assert config.to_dict() == before_config
    assert plain.config is config and all(c is config for c in configs_held(plain).values())
    # the converted model's: a copy, saying "tsp", held by every module that held the original
    assert model.config is not config and model.config._attn_implementation == "tsp"
    after = configs_held(model)
    # (the attention and MLP modules were replaced: what is left is the models' and the rotary's)
    assert {"config", "model.config", "model.rotary_emb.config"} <= set(after) <= set(held)
    assert all(c is model.config for c in after.values()), after
    assert not any(c is config for c in after.values())
    # the plain model runs its own attention, with the same logits; so does one built now
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, before)
        LlamaForCausalLM(config)(input_ids=ids)
    # and the converted model runs on its copy: the plain model's loss
    labels = ids.clone()
    labels[:, 5] = -100
    want = hf_models.reference_loss(plain, ids, labels)
    got = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)).loss
    assert torch.allclose(got, want, rtol=1e-10, atol=0), (got, want)


def test_parallelize_leaves_a_shared_config_as_it_was(pools):
    pools.of(1).run(a_shared_config_survives)


def test_own_config_reaches_sub_configs():
    # a composite config: a module holding a sub-config (a language model's text_config) gets
    # the copy's sub-config, not a second copy
    config = Gemma3Config()
    root, text, other = nn.Module(), nn.Module(), nn.Module()
    root.config, text.config, other.config = config, config.text_config, LlamaConfig()
    root.text, root.other = text, other
    unrelated = other.config
    own_config(root)
    assert root.config is not config and text.config is not config.text_config
    assert text.config is root.config.text_config
    assert root.config.to_dict() == config.to_dict()
    assert other.config is unrelated  # a config that is not the model's is left alone
