"""The layouts TSP is measured against, applied to the same Hugging Face models as
:func:`tsp_core.parallelize`: Megatron TP (``tp``), TP with sequence parallel (``tp-sp``), context
parallel (``cp``) and the 2-D meshes ``tp+cp`` / ``tp-sp+cp`` (docs/design.md "What TSP buys").
Sparse mixture-of-experts blocks (Mixtral) get Megatron's tensor-parallel experts (:mod:`.moe`)."""

from .layouts import LAYOUTS, LayoutSpec, ParallelModel, build, layout_specs, parse_layouts

__all__ = ["LAYOUTS", "LayoutSpec", "ParallelModel", "build", "layout_specs", "parse_layouts"]
