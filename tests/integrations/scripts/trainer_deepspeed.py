"""One ``transformers.Trainer`` fine-tune (tiny random-init Llama, fp32, 6 optimizer steps of 2 x 2 micro-batches
per rank), trained six times in one launch (issue 53): three DeepSpeed configurations given the DeepSpeed way,
each beside the same training configured the zero_plugin way.

* ``ds_zero2``: ``TrainingArguments(deepspeed=<the transformers docs' ZeRO-2 JSON>)``;
  ``stage2``: no DeepSpeed, ``ZERO_PLUGIN_STAGE=2`` + ``ZERO_PLUGIN_OFFLOAD=cpu`` (what ``--stage 2 --offload cpu``
  sets) and, built by hand, what the JSON's ``optimizer`` / ``scheduler`` sections make DeepSpeed build: torch's
  AdamW over every parameter in one group with the Trainer's hyper-parameters, and DeepSpeed's WarmupLR rates.
* ``ds_zero3``: the ZeRO-3 JSON through the command line (``HfArgumentParser`` parsing ``--deepspeed``), the model
  then loaded with ``from_pretrained`` (lazily, as a ZeRO-3 DeepSpeed config makes transformers load it with
  ``zero.Init``); ``stage3``: ``--stage 3 --offload cpu`` + ``offload_params``, the same hand-built optimizer and
  schedule, the same checkpoint.
* ``ds_optimizer``: a JSON with only a stage and an ``optimizer`` section (explicit values, no scheduler: the
  Trainer's linear schedule); ``adamw_by_hand``: ``--stage 2`` and that AdamW built by hand.

The ZeRO-3 pair runs first: a lazy ``from_pretrained`` needs a process where nothing was set up yet.  The
``ZERO_PLUGIN_*`` variables are set here, per run, only because one launch trains all six; the DeepSpeed runs
have none (a ``--stage`` that disagreed with a JSON would be refused).  Rank 0 writes OUT/result.json.
"""

import argparse
import json
import math
import os
import sys

import torch
from transformers import HfArgumentParser, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from trainer_lora import Sequences  # noqa: E402 - this folder is the script's sys.path[0]

from tests.models import llama_config  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fixtures", "deepspeed_configs")
LR, WEIGHT_DECAY, WARMUP = 3e-3, 0.01, 3


def arguments(out, **extra):
    return dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=WARMUP,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def adamw_by_hand(model):
    """What DeepSpeed builds from ``{"type": "AdamW", "params": {...}}``: every trainable parameter, one group."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)


def warmup_lr_by_hand(optimizer):
    """DeepSpeed's WarmupLR (log warm-up from 0 to LR over WARMUP iterations, then LR), as its engine steps it: the
    rate of iteration -1 (the minimum) for the first optimizer step, of iteration s - 1 for step s."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, math.log(max(s, 1)) / math.log(WARMUP)))


def set_zero_env(**variables):
    for key in [k for k in os.environ if k.startswith("ZERO_PLUGIN_") and k != "ZERO_PLUGIN_CONFIG"]:
        del os.environ[key]
    os.environ.update(variables)


def train(args, optimizer_for=None, schedule_for=None, pretrained=None):
    set_seed(0)
    if pretrained is None:
        model = LlamaForCausalLM(llama_config(128, 64, use_cache=False))
    else:  # after TrainingArguments, as DeepSpeed's ZeRO-3 asks: loaded lazily when its config says stage 3
        model = LlamaForCausalLM.from_pretrained(pretrained)
    lazily_loaded = any(p.is_meta for p in model.parameters())
    optimizer = optimizer_for(model) if optimizer_for else None
    schedule = schedule_for(optimizer) if schedule_for else None
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(64, seed=1), optimizers=(optimizer, schedule))
    trainer.train()
    zero = trainer.optimizer.optimizer  # Accelerate's wrapper around the ZeroOptimizer
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "learning_rates": [h["learning_rate"] for h in history if "learning_rate" in h],
        "zero_config": trainer.accelerator.zero_config.to_dict(),
        "zero_optimizer": type(zero).__name__,
        "inner_optimizer": type(zero.inner).__name__,
        "weight_decays": [g["weight_decay"] for g in zero.param_groups],
        "betas": [list(g["betas"]) for g in zero.param_groups],
        "scheduler": type(trainer.lr_scheduler).__name__,
        "deepspeed_kept": args.deepspeed is not None,
        "lazily_loaded": lazily_loaded,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", required=True, help="a save_pretrained folder of the model, for the ZeRO-3 runs")
    cli = ap.parse_args()
    runs = {}

    set_zero_env()
    command_line = [f"--{k}={v}" for k, v in arguments(cli.out).items() if k not in ("report_to",)]
    command_line += ["--report_to", "none", "--deepspeed", os.path.join(CONFIGS, "ds_config_zero3.json")]
    (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=command_line)
    runs["ds_zero3"] = train(parsed, pretrained=cli.base)
    set_zero_env(ZERO_PLUGIN_STAGE="3", ZERO_PLUGIN_OFFLOAD="cpu", ZERO_PLUGIN_OFFLOAD_PARAMS="true")
    runs["stage3"] = train(
        TrainingArguments(**arguments(cli.out)), adamw_by_hand, warmup_lr_by_hand, pretrained=cli.base
    )

    set_zero_env()
    runs["ds_zero2"] = train(
        TrainingArguments(**arguments(cli.out, deepspeed=os.path.join(CONFIGS, "ds_config_zero2.json")))
    )
    set_zero_env(ZERO_PLUGIN_STAGE="2", ZERO_PLUGIN_OFFLOAD="cpu")
    runs["stage2"] = train(TrainingArguments(**arguments(cli.out)), adamw_by_hand, warmup_lr_by_hand)

    set_zero_env()
    optimizer_only = {
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
    }
    runs["ds_optimizer"] = train(TrainingArguments(**arguments(cli.out, deepspeed=optimizer_only)))
    set_zero_env(ZERO_PLUGIN_STAGE="2")
    runs["adamw_by_hand"] = train(TrainingArguments(**arguments(cli.out)), adamw_by_hand)

    if int(os.environ.get("RANK", "0")) == 0:
        info = {
            "runs": runs,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "deepspeed_imported": "deepspeed" in sys.modules,
        }
        with open(os.path.join(cli.out, "result.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main()
