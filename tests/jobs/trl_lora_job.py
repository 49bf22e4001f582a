"""LoRA through TRL's SFT (tests/integrations/test_trl_lora.py): a tiny Llama saved with
save_pretrained and trained with a LoRA adapter on all seven projections, by TRL's own
``SFTTrainer(peft_config=...)`` (``--mode plain``, one process: the reference) or by
``tsp_trl.TSPSFTTrainer`` under torchrun: ``--mode tsp`` with ``peft_config=``, ``--mode
peft_model`` handed the PeftModel itself (``get_peft_model`` by the user; TSPTrainer converts it),
``--mode dpo`` ``TSPDPOTrainer(peft_config=...)`` (it must refuse: its error is the result).
torch's generator is seeded with ``--seed`` before the trainer, so every process creates the same
adapters.

Every rank writes ``rank<R>.json`` in --out: the training log rows (loss, grad_norm,
mean_token_accuracy, entropy, num_tokens), the names of the parameters that require gradients,
or the error; ``rank<R>_base.pt``: the full base weights (Hugging Face names) after training;
``rank0_base0.pt`` (one process): the base weights before. ``trainer.save_model()`` writes the
adapter to --out/adapter (the processes together; rank 0 writes).

``--case "NAME ARGS..."`` (repeatable): one more run in the same processes with ARGS added,
results in --out/NAME."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, set_seed
from trl import SFTTrainer

import tsp_core
from tests.jobs.trl_job import Rows, preference_rows, run_cases, sft_rows
from tsp_core.models.lora import inner_model
from tsp_trl import TSPDPOConfig, TSPDPOTrainer, TSPSFTConfig, TSPSFTTrainer

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")
    mode: str = field(default="plain")
    rows: int = field(default=12)
    case: list[str] = field(default_factory=list)


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(PROJECTIONS),
                      task_type="CAUSAL_LM")


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full base weights by their Hugging Face names (PEFT's prefix and ``base_layer.``
    taken out), the adapters left out; every rank gathers."""
    state = (tsp_core.full_state_dict(model) if hasattr(inner_model(model), "_tsp_state")
             else model.state_dict())
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v.detach().clone()
            for k, v in state.items() if "lora_" not in k}


def train(job: JobArgs, args: TSPSFTConfig) -> None:
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(job.out, exist_ok=True)
    if job.mode == "plain":
        torch.save(base_weights(model), os.path.join(job.out, "rank0_base0.pt"))
    data = Dataset.from_list(sft_rows(model.config.vocab_size, job.rows, False))
    set_seed(args.seed)  # the adapters' initial values: the same on every process
    log = Rows()
    common = dict(train_dataset=data, processing_class=tokenizer, callbacks=[log])
    if job.mode == "dpo":
        pairs = Dataset.from_list(preference_rows(model.config.vocab_size, 4))
        dpo_args = TSPDPOConfig(output_dir=args.output_dir, tsp_size=args.tsp_size, use_cpu=True,
                                report_to="none", bf16=False)
        try:
            TSPDPOTrainer(model=model, args=dpo_args, train_dataset=pairs,
                          processing_class=tokenizer, peft_config=lora_config())
        except NotImplementedError as e:
            result = {"error": str(e)}
        else:
            result = {"error": None}
        with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return
    if job.mode == "peft_model":
        trainer = TSPSFTTrainer(model=get_peft_model(model, lora_config()), args=args, **common)
    else:
        trainer_class = SFTTrainer if job.mode == "plain" else TSPSFTTrainer
        trainer = trainer_class(model=model, args=args, peft_config=lora_config(), **common)
    trainer.train()
    trainer.save_model(os.path.join(job.out, "adapter"))
    model = trainer.model
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rows": log.rows, "trainable": trainable, "class": type(model).__name__},
                  f)
    torch.save(base_weights(model), os.path.join(job.out, f"rank{rank}_base.pt"))


def parse(argv: list[str]) -> tuple[JobArgs, TSPSFTConfig]:
    return HfArgumentParser((JobArgs, TSPSFTConfig)).parse_args_into_dataclasses(args=argv)


def main() -> None:
    argv = sys.argv[1:]
    if "--case" not in argv:
        return train(*parse(argv))
    run_cases(argv, parse, train)


if __name__ == "__main__":
    main()
