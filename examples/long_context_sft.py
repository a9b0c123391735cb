"""Long-context SFT with an ordinary ``transformers.Trainer`` (full fine-tune, or LoRA with ``--lora``).

Nothing in the training code knows about sequence parallelism; the launcher's one flag turns it on:

    zero-plugin launch --stage 3 --sequence_parallel_size 2 --num_processes 2 examples/long_context_sft.py --seq_len 2048
    zero-plugin launch --stage 3 --num_processes 2 examples/long_context_sft.py --seq_len 2048   # K = 1, same losses

With ``--sequence_parallel_size K`` each sequence is spread over K ranks (Ulysses: docs/long-context.md): the
Trainer's loader gives every rank its 1/K of each sequence's tokens and the loss is the whole sequences' mean
(``zero_plugin/integrations/hf_trainer.py``).  ``--global_batch_size`` sequences per optimizer step are kept
whatever K and the number of processes, so runs that differ only in K train on the same sequences and print the
same losses.

Data: long conversations, each ``--seq_len`` tokens, made by concatenating the repo's instruction/response
examples (``examples/data/instructions.jsonl``); only the responses are trained on (the prompts' labels are -100).
Model: ``--model NAME_OR_PATH`` (any causal LM with ``attn_implementation="sdpa"``), else a small random-init
Llama (vocabulary 4096 x hidden 256, head untied) built here.  Prints ``step N loss X`` for every optimizer step.
"""

from __future__ import annotations

import argparse
import os
import random

import common
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM name or local folder; default: random-init Llama")
    parser.add_argument("--data", default=str(common.DEFAULT_DATA), help="instruction/response .jsonl rows")
    parser.add_argument("--seq_len", type=int, default=4096, help="tokens per training sequence")
    parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--global_batch_size", type=int, default=2, help="sequences per micro-batch, all ranks")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 LoRA, 3e-4 full)")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter instead of every weight")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--gradient_checkpointing", action="store_true", help="recompute layers in backward")
    parser.add_argument("--output_dir", default="out/long_context_sft")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache_dir", default=str(common.DEFAULT_CACHE), help="where the default tokenizer is cached")
    return parser.parse_args()


def data_parallel_size(world_size: int) -> int:
    """Ranks that read different sequences: the world divided by zero_plugin's sequence_parallel_size (1 when
    not launched with zero_plugin)."""
    try:
        import zero_plugin as zp
    except ImportError:
        return world_size
    return world_size // zp.ZeroConfig.from_env().resolved_sequence_parallel_size(world_size)


def build_model(args: argparse.Namespace, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=4096,  # the head, 4096 x 256 = 2^20 elements, is a stage-3 unit of its own
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def long_rows(args: argparse.Namespace, tokenizer, count: int) -> list[dict[str, list[int]]]:
    """``count`` conversations of ``seq_len`` tokens: examples drawn (seeded) and concatenated, responses trained."""
    examples = common.encode_all(common.load_records(args.data), tokenizer, max_length=args.seq_len)
    draw = random.Random(args.seed)
    rows = []
    for _ in range(count):
        ids: list[int] = []
        labels: list[int] = []
        while len(ids) < args.seq_len:
            example = draw.choice(examples)
            ids += example["input_ids"]
            labels += example["labels"]
        rows.append({"input_ids": ids[: args.seq_len], "labels": labels[: args.seq_len]})
    return rows


class PrintLosses(TrainerCallback):
    """``step N loss X`` per optimizer step (``logging_steps=1``), on the main process, ``X`` as ``repr``."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None and "loss" in logs:
            print(f"step {state.global_step} loss {float(logs['loss'])!r}", flush=True)


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    groups = data_parallel_size(world_size)
    if args.global_batch_size % groups:
        raise SystemExit(
            f"--global_batch_size {args.global_batch_size} must be a multiple of the {groups} data-parallel groups"
        )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.global_batch_size // groups,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        learning_rate=args.lr or (1e-3 if args.lora else 3e-4),
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
    )
    with training_args.main_process_first(desc="tokenizer"):
        tokenizer = common.load_tokenizer(args)
    rows = long_rows(args, tokenizer, args.max_steps * args.grad_accum * args.global_batch_size)
    set_seed(args.seed)
    model = build_model(args, tokenizer)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=common.LORA_TARGETS)
        model = get_peft_model(model, lora)
    trainable, total = common.count_parameters(model)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        data_collator=common.Collator(tokenizer.pad_token_id),
        callbacks=[PrintLosses()],
    )
    if trainer.is_world_process_zero():
        print(
            f"{trainable:,} of {total:,} parameters train ({'LoRA' if args.lora else 'full'}); {len(rows)} sequences "
            f"of {args.seq_len} tokens; {world_size} processes in {groups} data-parallel groups",
            flush=True,
        )
    trainer.train()


if __name__ == "__main__":
    main()
