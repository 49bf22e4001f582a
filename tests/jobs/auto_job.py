"""tsp_size="auto" through TSPAccelerator on a real process group (torchrun): the planner's degree
from TSP_SEQ_LEN / TSP_MEMORY_GB and the model's config, one training step on it. An impossible
budget must raise on every rank before any collective (each rank prints its error, exits 3)."""

from __future__ import annotations

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_accelerate import TSPAccelerator


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    try:
        accelerator = TSPAccelerator(tsp_size="auto", tsp_model_config=config)
    except ValueError as err:
        print(f"rank {os.environ['RANK']} refused: {err}", flush=True)
        sys.exit(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    print(f"rank {accelerator.process_index}: degree {accelerator.tsp_mesh.size}, dp "
          f"{accelerator.tsp_mesh.dp_size}, loss {loss.item():.4f}, choice: "
          f"{accelerator.tsp_choice.reason}", flush=True)


if __name__ == "__main__":
    main()
