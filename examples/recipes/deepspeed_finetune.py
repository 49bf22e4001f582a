"""Fine-tune a pretrained causal LM with TSP and DeepSpeed ZeRO (docs/recipes.md).

    deepspeed --num_gpus 8 examples/recipes/deepspeed_finetune.py \
        --model /models/Llama-3.1-8B --data tokens.bin --out runs/llama8b

The switch: ``tsp_deepspeed.initialize`` in place of ``deepspeed.initialize``, and
``tsp_core.shard_batch`` on every full batch. The model comes from
``tsp_transformers.load_pretrained``, each rank reading only its slices of the safetensors files;
``initialize`` takes it converted and uses its mesh. ZeRO (``--stage``, 2 by default) partitions
over the data-parallel ranks only. bf16 on CUDA (DeepSpeed's ``bf16`` section: float32 master
weights in the optimizer), activation checkpointing, AdamW, ``engine.save_checkpoint`` every
``--save-every`` steps (DeepSpeed's format: resume at the same TSP degree and ZeRO layout),
``--resume`` from the latest, and TSP's figures per step (``tsp_core.metrics.StepMetrics``;
DeepSpeed's own ZeRO collectives are not counted) printed and appended to
``<out>/metrics.jsonl``. On CPU set ``DS_ACCELERATOR=cpu``. Long context: ``--activation-offload``
and ``--tile-tokens N`` are ``initialize(..., activation_offload=True, tile_tokens=N)`` and go to
``load_pretrained`` too (docs/long-context.md). Data format and flags: common.py.
"""

from __future__ import annotations

import torch
from common import TokenRows, data_parallel_sampler, device, long_context, parse_args, report
from torch.utils.data import DataLoader

import tsp_core
import tsp_deepspeed
from tsp_transformers import load_pretrained


def main(argv: list[str] | None = None) -> None:
    a = parse_args(__doc__, argv, extra=(("--stage", dict(type=int, default=2)),
                                         ("--local_rank", dict(type=int, default=-1))))
    bf16 = a.torch_dtype == torch.bfloat16
    # DeepSpeed keeps float32 master weights and casts the model to bf16 itself
    model = load_pretrained(a.model, tsp_size=a.tsp,
                            dtype=torch.float32 if bf16 else a.torch_dtype, **long_context(a))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    config = {"train_micro_batch_size_per_gpu": a.batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0}},
              "zero_optimization": {"stage": a.stage}, "bf16": {"enabled": bf16}}
    engine, _, _, _ = tsp_deepspeed.initialize(model=model, config=config,   # <- the switch
                                               **long_context(a))
    mesh = tsp_core.get_mesh(model)

    start = 0
    if a.resume:
        path, client = engine.load_checkpoint(a.out)      # the tag in <out>/latest
        start = client["step"] if path else 0
    data = TokenRows(a, model.config.vocab_size, start=start * a.batch * mesh.dp_size)
    loader = DataLoader(data, batch_size=a.batch, sampler=data_parallel_sampler(data, mesh))

    meter = tsp_core.metrics.StepMetrics(mesh)
    meter.start(start)
    for step, batch in zip(range(start + 1, a.steps + 1), loader):
        batch = {k: v.to(device()) for k, v in batch.items()}
        model.tsp_step = step
        loss = engine(**tsp_core.shard_batch(batch, mesh)).loss
        engine.backward(loss)
        engine.step()
        report(a, step, loss.item(), meter.read(step))
        if step % a.save_every == 0 or step == a.steps:
            with tsp_core.metrics.paused():
                engine.save_checkpoint(a.out, tag=f"step_{step}", client_state={"step": step})


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
