"""A plain transformers ``Trainer`` full fine-tune with ``--optim`` (e.g. ``adafactor``) of a random-init Llama whose
embedding and untied LM head are stage-3 units of their own (vocab 4096 x hidden 256); no zero_plugin in it.

Rank 0 writes OUT/result.json (the logged per-step losses) and the final weights (``save_model`` to OUT/final).
"""

import argparse
import json
import os
import sys

from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from trainer_lora import Sequences  # noqa: E402 - this folder is the script's sys.path[0]

from tests.models import llama_config  # noqa: E402

VOCAB, HIDDEN = 4096, 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optim", default="adafactor")
    ap.add_argument("--max_steps", type=int, default=4)
    args = ap.parse_args()

    set_seed(0)
    model = LlamaForCausalLM(
        llama_config(VOCAB, HIDDEN, intermediate=384, layers=2, heads=4, kv_heads=2, use_cache=False)
    )
    training_args = TrainingArguments(
        output_dir=args.out,
        optim=args.optim,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=Sequences(64, seed=1, vocab=VOCAB))
    trainer.train()
    trainer.save_model(os.path.join(args.out, "final"))
    if trainer.args.process_index == 0:
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        optimizer = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "optimizer": optimizer}, f)


if __name__ == "__main__":
    main()
