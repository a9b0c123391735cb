"""LoRA fine-tune with an ordinary ``transformers.Trainer`` + PEFT script.

Nothing in the training code knows about zero_plugin; launching through it picks the ZeRO stage:

    zero-plugin launch --stage 3 --num_processes 2 examples/finetune_trainer.py
    zero-plugin launch --config_file examples/configs/stage2.yaml examples/finetune_trainer.py
    accelerate launch --num_processes 2 examples/finetune_trainer.py     # plain Trainer (DDP), for comparison

The only zero_plugin-specific part is optional: ``ZeroReport``, a ``TrainerCallback`` that adds
each rank's model-state memory to the Trainer's logs and prints the memory table
and communication per step at the end (it does nothing when the run is not under zero_plugin).

Output (``--output_dir``): ``checkpoint-N/`` (Trainer checkpoints, resumable with ``--resume``),
``adapter/`` (``trainer.save_model``: PEFT adapter + tokenizer), ``metrics.json``.
"""

from __future__ import annotations

import argparse
import os

import common
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_arguments(parser, max_steps=250, lr=5e-3, output_dir="out/trainer")
    common.add_lora_arguments(parser)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    return parser.parse_args()


class ZeroReport(TrainerCallback):
    """Each rank's model-state memory in the Trainer's logs; memory table and comm per step at the end.

    The Trainer already logs ``train_tokens_per_second``.  Every hook runs on every rank, so the
    collective here (gathering the memory reports) lines up.
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.zp = None
        self.reports: list[dict] | None = None
        self.comm: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(self.trainer.accelerator, "zero_config", None) is not None:  # launched under zero_plugin
            import zero_plugin

            self.zp = zero_plugin
            self.zp.reset_comm_stats()  # the model is set up by now: count training only

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        # After clipping, before the step: gradients are held, so this is the peak of model state.
        step = state.global_step + 1
        if self.zp is not None and (step % args.logging_steps == 0 or step == args.max_steps):
            from accelerate.utils import gather_object

            self.reports = gather_object([self.zp.memory_report(model, optimizer)])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.reports:
            for report in self.reports:
                logs[f"mem_rank{report['rank']}"] = common.format_bytes(report["measured"]["total"])

    def on_train_end(self, args, state, control, **kwargs):
        if self.zp is not None:
            self.comm = self.zp.comm_stats()


class FirstSamples(TrainerCallback):
    """Sample answers once the Trainer has prepared the model, before the first step.

    Not before ``trainer.train()``: under ``zero-plugin launch --stage 3`` ``from_pretrained`` leaves the
    weights on the meta device until the Trainer's ``prepare`` loads and shards them unit by unit.  At
    ZeRO-3 generation is collective (every rank runs this hook); see [Note: generate at ZeRO-3 with PEFT].
    """

    def __init__(self, trainer: Trainer, tokenizer, max_new_tokens: int) -> None:
        self.trainer, self.tokenizer, self.max_new_tokens = trainer, tokenizer, max_new_tokens
        self.samples: dict[str, str] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        zero_config = getattr(self.trainer.accelerator, "zero_config", None)  # launched under zero_plugin
        through_forward = zero_config is not None and zero_config.stage == 3
        self.samples = common.samples(model, self.tokenizer, self.max_new_tokens, through_forward)
        if self.trainer.is_world_process_zero():
            common.print_samples("Before training:", self.samples)


def main() -> None:
    args = parse_args()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=args.log_every,
        save_strategy="steps",
        save_steps=args.save_steps or args.max_steps,
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",
        use_cpu=not torch.cuda.is_available(),
    )
    with training_args.main_process_first(desc="tokenizer"):
        tokenizer = common.load_tokenizer(args)
    rows = common.encode_all(common.load_records(args.data), tokenizer, args.max_length)
    set_seed(args.seed)  # LoRA draws its initial weights from the global RNG (the Trainer seeds only later)
    model = common.add_lora(common.build_model(args, tokenizer), args)
    trainable, total = common.count_parameters(model)
    report = ZeroReport()  # passed here so that it runs before the progress bar prints each log
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=common.Collator(tokenizer.pad_token_id),
        callbacks=[report],
    )
    report.trainer = trainer
    main_process = trainer.is_world_process_zero()
    if main_process:
        print(
            f"{trainable:,} of {total:,} parameters train (LoRA r={args.lora_r}); {len(rows)} examples; "
            f"{training_args.world_size} processes"
        )
    first = FirstSamples(trainer, tokenizer, args.max_new_tokens)
    trainer.add_callback(first)

    result = trainer.train(resume_from_checkpoint=args.resume)
    before = first.samples

    # Set up by now; at ZeRO-3 generation is collective (see [Note: generate at ZeRO-3 with PEFT]).
    zero_config = getattr(trainer.accelerator, "zero_config", None)
    through_forward = zero_config is not None and zero_config.stage == 3
    after = common.samples(trainer.model, tokenizer, args.max_new_tokens, through_forward)
    adapter_dir = os.path.join(args.output_dir, "adapter")
    trainer.save_model(adapter_dir)  # collective; the main process writes adapter + tokenizer
    trainer.accelerator.wait_for_everyone()
    if main_process:
        common.print_samples("After training:", after)
        reloaded = common.reload_adapter_samples(args, adapter_dir)
        common.print_samples(f"Adapter reloaded from {adapter_dir} onto a fresh base model:", reloaded)
        steps = trainer.state.global_step - (resumed_step(args.resume) or 0)
        logged = [h for h in trainer.state.log_history if "loss" in h]
        common.print_report(
            logged, report.reports, report.comm, result.metrics["train_runtime"], adapter_dir, steps, args.log_every
        )
        common.write_json(
            os.path.join(args.output_dir, "metrics.json"),
            {
                "example": "finetune_trainer",
                "log_history": trainer.state.log_history,
                "losses": [h["loss"] for h in logged],
                "global_step": trainer.state.global_step,
                "world_size": training_args.world_size,
                "zero_config": zero_config.to_dict() if zero_config is not None else None,
                "trainable_params": trainable,
                "total_params": total,
                "samples_before": before,
                "samples_after": after,
                "samples_reloaded": reloaded,
                "memory": report.reports,
                "comm": report.comm,
            },
        )


def resumed_step(checkpoint: str | None) -> int | None:
    """The step a run resumed from (``checkpoint-N`` folders), to count only this run's steps."""
    if not checkpoint:
        return None
    tail = os.path.basename(os.path.normpath(checkpoint))
    return int(tail.split("-")[-1]) if tail.startswith("checkpoint-") else None


if __name__ == "__main__":
    main()
