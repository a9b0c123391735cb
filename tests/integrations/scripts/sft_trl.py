"""TRL's ``SFTTrainer`` with ``peft_config`` (LoRA) on a base model named by path (no zero_plugin in it).

``SFTTrainer(model=PATH, peft_config=...)`` calls ``from_pretrained`` itself and wraps the model with PEFT;
under ``zero-plugin launch --stage 3`` that load is lazy (a safetensors folder) or eager (a pickle
``pytorch_model.bin``).  A small offline dataset (``datasets.Dataset.from_list``) of arithmetic word
sequences; rank 0 writes OUT/result.json with the trainer's log history and how many base parameters were
still on the meta device when the trainer was built.
"""

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer
from trl_common import trl_args, write_result


def texts(rows: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        start, stride = int(torch.randint(0, 90, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        out.append({"text": " ".join(str(start + stride * k) for k in range(8))})
    return Dataset.from_list(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=4)
    args = ap.parse_args()
    set_seed(0)
    config = SFTConfig(
        **trl_args(args.out, args.max_steps),
        packing=False,
        model_init_kwargs={"dtype": torch.float32},
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=args.model,
        args=config,
        train_dataset=texts(32, seed=1),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        peft_config=lora,
    )
    meta = sum(p.is_meta for p in trainer.model.parameters())
    trainer.train()
    write_result(trainer, args.out, meta_before_train=meta)


if __name__ == "__main__":
    main()
