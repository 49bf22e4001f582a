"""Pipeline parallelism over TSP stages (docs/pipeline.md): :func:`pipeline` cuts a Hugging Face
causal LM into stages of whole decoder layers, each a TSP model on its own TSP group, run by
torch.distributed.pipelining's schedules."""

from .pipeline import SCHEDULES, TSPPipeline, pipeline
from .split import balanced_split, split_layers, stage_ranks

__all__ = ["SCHEDULES", "TSPPipeline", "balanced_split", "pipeline", "split_layers",
           "stage_ranks"]
