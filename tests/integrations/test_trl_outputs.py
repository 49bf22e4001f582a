"""tsp_core answers TRL's ``fused_lm_head=True`` without importing TRL: its output class must keep
TRL's fields, in TRL's order (TRL reads them by name, a ModelOutput also by position)."""

from __future__ import annotations

from dataclasses import fields


def test_fused_output_has_trls_fields_in_trls_order():
    from trl.trainer.utils import FusedCausalLMOutput

    from tsp_core.models.outputs import FusedLMOutput

    assert [f.name for f in fields(FusedLMOutput)] == [f.name for f in fields(FusedCausalLMOutput)]
