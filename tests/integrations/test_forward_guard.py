"""TSPTrainer's forward guard (integrations/tsp_transformers/forward_guard.py), in one process with
no collectives: it accepts the forward Accelerate's mixed precision sets on the model (autocast
inside ``convert_outputs_to_fp32``, set by the real ``Accelerator.prepare_model``, once or twice,
by either of its two branches), and refuses a forward that does not end in the model's own: TRL's
``add_fused_lm_head`` (alone, and inside mixed precision's wrappers), a Liger-style fused loss
bound to the model, a ``functools.wraps`` copy that names the model's forward but never calls it,
and a forward bound to another model."""

from __future__ import annotations

import functools
from types import MethodType

import pytest
import torch

from tests.support import hf_models
from tsp_transformers.forward_guard import describe, forward_that_runs, refuse_bypassed_forward


class Trainer:
    """Stands for the trainer whose class name the refusal names."""


def model():
    return hf_models.build("llama", torch.float32)


def prepare_bf16(m, times: int = 1, bound: bool = True):
    """Accelerate's own mixed-precision preparation, ``times`` over: a real ``Accelerator(
    mixed_precision="bf16")`` on the CPU, one process. ``bound=False`` takes its other branch
    (a forward with no ``__func__``, as under MS-AMP or a forward already replaced by a plain
    function)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    try:
        if not bound:
            m.forward = functools.partial(type(m).forward, m)
        for _ in range(times):
            m = accelerator.prepare_model(m)
    finally:
        AcceleratorState._reset_state(True)
    return m


def test_mixed_precision_wrappers_are_seen_through():
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    plain = model()
    assert forward_that_runs(plain) is None
    m = prepare_bf16(model())
    assert "forward" in vars(m), "Accelerate's mixed precision sets forward on the instance"
    assert forward_that_runs(m) is None
    refuse_bypassed_forward(Trainer(), m)
    # the wrapped forward really runs the model's own under bf16 autocast: logits off float32's
    # by bf16's rounding, returned in float32
    with torch.no_grad():
        got, want = m(input_ids=ids).logits, plain(input_ids=ids).logits
    assert got.dtype == torch.float32
    err = float((got - want).norm() / want.norm())
    assert 2.0 ** -12 < err < 9 * 2.0 ** -8, err
    twice = prepare_bf16(model(), times=2)
    assert forward_that_runs(twice) is None


def test_a_partial_is_not_taken_for_the_models_forward():
    # Accelerate's other branch wraps whatever model.forward is; a functools.partial is not one
    # of the known pass-through wrappers, so it is refused by its type, not followed
    m = prepare_bf16(model(), bound=False)
    assert isinstance(forward_that_runs(m), functools.partial)


def fused_forward(m):
    """TRL's ``add_fused_lm_head`` on ``m``: its ``_fused_forward`` bound to the model."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(m)
    return m


def lce_forward(self, input_ids=None, labels=None, **kwargs):
    """Stands for Liger's fused linear cross-entropy forward: the backbone, then its own loss
    from the head's weight."""
    return self.model(input_ids=input_ids).last_hidden_state @ self.lm_head.weight.T


def refusal(m) -> str:
    with pytest.raises(ValueError) as err:
        refuse_bypassed_forward(Trainer(), m)
    return str(err.value)


def test_trls_fused_head_is_refused_alone_and_inside_mixed_precision():
    alone = fused_forward(model())
    assert describe(forward_that_runs(alone)) == "_fused_forward of trl/trainer/utils.py"
    assert refusal(alone).startswith("Trainer: the model's forward was replaced by "
                                     "_fused_forward of trl/trainer/utils.py")
    # functools.wraps gave it the model's forward as __wrapped__: following that would accept it
    assert alone.forward.__func__.__wrapped__ is type(alone).forward
    wrapped = prepare_bf16(fused_forward(model()), times=2)
    assert describe(forward_that_runs(wrapped)) == "_fused_forward of trl/trainer/utils.py"
    assert "tsp_trl.TSPSFTTrainer" in refusal(wrapped)


def test_other_replaced_forwards_are_refused():
    liger = model()
    liger.forward = MethodType(lce_forward, liger)
    assert describe(forward_that_runs(liger)) == \
        "lce_forward of tests/integrations/test_forward_guard.py"
    refusal(prepare_bf16(liger))
    # a copy that names the model's forward (functools.wraps) but runs something else
    copied = model()

    @functools.wraps(type(copied).forward)
    def named_like_forward(self, *args, **kwargs):
        return lce_forward(self, *args, **kwargs)

    copied.forward = MethodType(named_like_forward, copied)
    assert "named_like_forward of tests/integrations/test_forward_guard.py" in refusal(copied)
    # the class's forward, bound to another model: this model's weights would not be used
    other, m = model(), model()
    m.forward = other.forward
    assert forward_that_runs(m) == other.forward
    assert "bound to another object (a LlamaForCausalLM)" in refusal(m)
