"""A plain transformers ``Trainer`` + PEFT LoRA fine-tune of a tiny random-init Llama (no zero_plugin in it).

Trains --max_steps with checkpoints every --save_steps and evaluation at each checkpoint, optionally
resuming from --resume.  Then ``save_model`` to OUT/final, ``predict`` logits, and on rank 0 reloads
the saved adapter with ``PeftModel.from_pretrained`` into a freshly built base model.  Rank 0 writes
OUT/result.json and OUT/logits.pt.
"""

import argparse
import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from tests.models import llama_config  # noqa: E402


class Sequences(Dataset):
    def __init__(self, rows, seed, length=16, vocab=128):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def base_model():
    set_seed(0)
    config = llama_config(128, 64, use_cache=False)
    return LlamaForCausalLM(config)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_steps", type=int, default=8)
    ap.add_argument("--save_steps", type=int, default=4)
    args = ap.parse_args()

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    model = get_peft_model(base_model(), lora)
    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        learning_rate=1e-2,
        max_grad_norm=0.15,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        save_steps=args.save_steps,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Sequences(96, seed=1), eval_dataset=Sequences(16, seed=2)
    )
    trainer.train(resume_from_checkpoint=args.resume)
    final = os.path.join(args.out, "final")
    trainer.save_model(final)
    test = Sequences(6, seed=3)
    logits = torch.as_tensor(trainer.predict(test).predictions)
    if trainer.is_world_process_zero():
        reloaded = PeftModel.from_pretrained(base_model(), final).eval()
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=test.ids).logits
            base_logits = base_model()(input_ids=test.ids).logits
        torch.save(
            {"trained": logits, "reloaded": reloaded_logits, "base": base_logits}, os.path.join(args.out, "logits.pt")
        )
        result = {
            "log_history": trainer.state.log_history,
            "global_step": trainer.state.global_step,
            "world_size": training_args.world_size,
            "accelerator_class": type(trainer.accelerator).__module__,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
