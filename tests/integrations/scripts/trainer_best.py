"""A plain transformers ``Trainer`` full fine-tune of a tiny random-init Llama with ``load_best_model_at_end``.

No zero_plugin in it.  Trains --max_steps, saving and evaluating every step; the metric ``score`` is
fixed per step (SCORES) so that checkpoint-2 is the best whatever the losses do.  Optionally resumes from
--resume.  At the end the Trainer loads the best checkpoint; the script then ``save_model``s to OUT/final.
Rank 0 writes OUT/result.json (log history, best checkpoint, world size, accelerator module).
"""

import argparse
import json
import os
import sys

from trainer_lora import Sequences  # this folder is the script's sys.path[0]
from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from tests.models import llama_config  # noqa: E402

SCORES = {1: 0.3, 2: 0.9, 3: 0.5, 4: 0.7}  # step -> eval_score; greater is better, so step 2 wins


def build_model():
    set_seed(0)
    return LlamaForCausalLM(llama_config(128, 32, use_cache=False))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_steps", type=int, default=4)
    ap.add_argument("--no_load_best", action="store_true")
    args = ap.parse_args()

    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=args.max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=not args.no_load_best,
        metric_for_best_model="score",
        greater_is_better=True,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = None

    def compute_metrics(_prediction):
        return {"score": SCORES[trainer.state.global_step]}

    trainer = Trainer(
        model=build_model(),
        args=training_args,
        train_dataset=Sequences(64, seed=1),
        eval_dataset=Sequences(8, seed=2),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits[:, :1, :1],
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(os.path.join(args.out, "final"))
    if trainer.is_world_process_zero():
        result = {
            "log_history": trainer.state.log_history,
            "global_step": trainer.state.global_step,
            "best_model_checkpoint": trainer.state.best_model_checkpoint,
            "world_size": training_args.world_size,
            "accelerator_class": type(trainer.accelerator).__module__,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
