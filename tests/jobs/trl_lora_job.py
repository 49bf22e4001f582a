"""LoRA through TRL (tests/integrations/test_trl_lora.py): a tiny Llama saved with
save_pretrained and trained with a LoRA adapter on all seven projections, by TRL's own
``SFTTrainer(peft_config=...)`` (``--mode plain``) and ``DPOTrainer(peft_config=...)``
(``--mode dpo_plain``) on one process, the references (these runs import TRL alone, never
tsp_core, and record that they did not), or under torchrun with ``--tsp_size``: by
``tsp_trl.TSPSFTTrainer`` (``--mode tsp`` with ``peft_config=``, ``--mode peft_model`` handed
the PeftModel itself, ``get_peft_model`` by the user; TSPTrainer converts it), by
``tsp_trl.TSPDPOTrainer(peft_config=...)`` (``--mode dpo``) and by ``TSPDPOTrainer`` handed a
PeftModel without peft_config (``--mode dpo_peft_model``: it must refuse; its error is the
result, with the collectives issued before it: none). With ``peft_config=`` the trainers seed
torch with ``--seed`` before creating the adapters (TRL's SFTTrainer and DPOTrainer do, and so
must TSP's), so every process creates the same adapters; ``--mode peft_model`` seeds it itself.

Every rank writes ``rank<R>.json`` in --out: the training log rows (loss, grad_norm,
mean_token_accuracy, entropy, num_tokens; DPO's rewards, log-probs and mean logits), the names
of the parameters that require gradients, or the error; ``rank<R>_base.pt``: the full base
weights (Hugging Face names) after training; ``rank0_base0.pt`` (one process): the base weights
before. ``trainer.save_model()`` writes the adapter to --out/adapter (the processes together;
rank 0 writes).

``--case "NAME ARGS..."`` (repeatable): one more run in the same processes with ARGS added,
results in --out/NAME."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, set_seed

from tests.jobs.trl_rows import Rows, preference_rows, run_cases, sft_rows

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")
    mode: str = field(default="plain")
    rows: int = field(default=12)
    ref_model: bool = field(default=False)
    case: list[str] = field(default_factory=list)


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(PROJECTIONS),
                      task_type="CAUSAL_LM")


def moved_reference(path: str) -> torch.nn.Module:
    """``--ref_model true``: DPO's ``ref_model=``, the saved model with every weight moved by
    0.2 x N(0, 1) from a fixed generator (the same on every process), so that the rewards tell
    this reference from the policy with its adapter disabled (which is the saved model)."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return ref


def base_weights(model: torch.nn.Module, tsp: bool) -> dict[str, torch.Tensor]:
    """The full base weights by their Hugging Face names (PEFT's prefix and ``base_layer.``
    taken out), the adapters left out; with ``tsp`` every rank gathers."""
    if tsp:
        import tsp_core

        state = tsp_core.full_state_dict(model)
    else:
        state = model.state_dict()
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v.detach().clone()
            for k, v in state.items() if "lora_" not in k}


def trainer_class(mode: str) -> type:
    """The trainer a mode runs: TRL's own for the references (no tsp_core import), else
    tsp_trl's."""
    if mode == "plain" or mode.startswith("dpo_plain"):
        from trl import DPOTrainer, SFTTrainer

        return DPOTrainer if mode.startswith("dpo_plain") else SFTTrainer
    from tsp_trl import TSPDPOTrainer, TSPSFTTrainer

    return TSPDPOTrainer if mode.startswith("dpo") else TSPSFTTrainer


def write(job: JobArgs, rank: int, result: dict[str, Any]) -> None:
    """``rank<R>.json``, with whether this process imported tsp_core."""
    with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
        json.dump({**result, "tsp_core_imported": "tsp_core" in sys.modules}, f)


def refused(job: JobArgs, args: Any, model: torch.nn.Module, **common: Any) -> None:
    """``--mode dpo_peft_model``: TSPDPOTrainer handed a PeftModel without peft_config must
    raise; its message, and the collectives of tsp_core it issued first (none)."""
    import tsp_core

    with tsp_core.comm.track() as stats:
        try:
            trainer_class(job.mode)(model=get_peft_model(model, lora_config()), args=args,
                                    **common)
        except NotImplementedError as e:
            error = str(e)
        else:
            error = None
    write(job, int(os.environ.get("RANK", "0")), {"error": error, "collectives": dict(stats.calls)})


def train(job: JobArgs, args: Any) -> None:
    tsp = getattr(args, "tsp_size", 1) != 1
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(job.out, exist_ok=True)
    if not tsp:
        torch.save(base_weights(model, False), os.path.join(job.out, "rank0_base0.pt"))
    vocab = model.config.vocab_size
    data = Dataset.from_list(preference_rows(vocab, job.rows) if job.mode.startswith("dpo")
                             else sft_rows(vocab, job.rows, False))
    log = Rows()
    common = dict(train_dataset=data, processing_class=tokenizer, callbacks=[log])
    if job.ref_model:
        common["ref_model"] = moved_reference(job.model_path)
    elif job.mode == "dpo_peft_model":
        return refused(job, args, model, **common)
    if job.mode.endswith("peft_model"):
        set_seed(args.seed)  # the user's own seeding before their get_peft_model
        trainer = trainer_class(job.mode)(model=get_peft_model(model, lora_config()), args=args,
                                          **common)
    else:
        trainer = trainer_class(job.mode)(model=model, args=args, peft_config=lora_config(),
                                          **common)
    trainer.train()
    trainer.save_model(os.path.join(job.out, "adapter"))
    model = trainer.model
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    write(job, rank, {"rows": log.rows, "trainable": trainable, "class": type(model).__name__,
                      "ref_model": type(trainer.ref_model).__name__
                      if getattr(trainer, "ref_model", None) is not None else None,
                      "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))})
    torch.save(base_weights(model, tsp), os.path.join(job.out, f"rank{rank}_base.pt"))


def parse(argv: list[str]) -> tuple[JobArgs, Any]:
    """JobArgs and the trainer's config: TRL's own SFTConfig / DPOConfig without
    ``--tsp_size`` (the references), tsp_trl's with it; DPO's for the ``dpo`` modes."""
    modes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--mode"]
    dpo = bool(modes) and modes[-1].startswith("dpo")
    if "--tsp_size" in argv:
        from tsp_trl import TSPDPOConfig as DPOConfig
        from tsp_trl import TSPSFTConfig as SFTConfig
    else:
        from trl import DPOConfig, SFTConfig
    return HfArgumentParser((JobArgs, DPOConfig if dpo else SFTConfig)
                            ).parse_args_into_dataclasses(args=argv)


def main() -> None:
    argv = sys.argv[1:]
    if "--case" not in argv:
        return train(*parse(argv))
    run_cases(argv, parse, train)


if __name__ == "__main__":
    main()
