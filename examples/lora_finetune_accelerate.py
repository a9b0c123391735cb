"""LoRA fine-tune of a causal LM with a plain Accelerate training loop.

The training code is ordinary Accelerate (``Accelerator()``, ``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_state``, ``get_state_dict``); the ZeRO stage is chosen at launch:

    zero-plugin launch --stage 3 --num_processes 2 examples/lora_finetune_accelerate.py
    zero-plugin launch --config_file examples/configs/stage2_offload.yaml examples/lora_finetune_accelerate.py
    accelerate launch --num_processes 2 -m zero_plugin.run examples/lora_finetune_accelerate.py  # + ZERO_PLUGIN_STAGE
    accelerate launch examples/lora_finetune_accelerate.py             # plain Accelerate, for comparison

Defaults need no download (a small random-init Llama, a BPE trained on the repo's synthetic
instruction set); ``--model`` / ``--data`` take your own.  zero_plugin is imported only for the
end-of-run report (memory per rank against the ZeRO theory, communication per step), and only
when the script runs under zero_plugin.

Output (``--output_dir``): ``state/`` (``save_state``: resumable), ``adapter/`` (PEFT adapter and
tokenizer, loads with ``PeftModel.from_pretrained``), ``metrics.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import common
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_arguments(parser, max_steps=250, lr=5e-3, output_dir="out/lora_accelerate")
    common.add_lora_arguments(parser)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    return parser.parse_args()


def zero_plugin_of(accelerator: Accelerator):
    """zero_plugin's module when this Accelerator is zero_plugin's (launched through it), else None."""
    if getattr(accelerator, "zero_config", None) is None:
        return None
    import zero_plugin

    return zero_plugin


def describe(accelerator: Accelerator, zp) -> str:
    if zp is None:
        return "plain Accelerate"
    config = accelerator.zero_config
    return f"ZeRO-{config.stage}" + (" + CPU offload" if config.offload_optimizer == "cpu" else "")


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    zp = zero_plugin_of(accelerator)
    with accelerator.main_process_first():  # the main process fills the tokenizer cache
        tokenizer = common.load_tokenizer(args)
    rows = common.encode_all(common.load_records(args.data), tokenizer, args.max_length)
    loader = DataLoader(
        rows,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=common.Collator(tokenizer.pad_token_id),
    )
    model = common.add_lora(common.build_model(args, tokenizer), args)
    trainable, total = common.count_parameters(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    # A prepared scheduler steps once per process for every optimizer step (Accelerate's convention).
    scheduler = get_linear_schedule_with_warmup(
        optimizer, args.warmup_steps * accelerator.num_processes, args.max_steps * accelerator.num_processes
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.print(
        f"{describe(accelerator, zp)} on {accelerator.num_processes} processes "
        f"({accelerator.distributed_type}); {trainable:,} of {total:,} parameters train "
        f"(LoRA r={args.lora_r}); {len(rows)} examples, {args.batch_size} per process per micro-batch"
    )

    # Collective at ZeRO-3 (every rank generates); see [Note: generate at ZeRO-3 with PEFT] in common.py.
    # (zero_plugin adds no wrapper, so unwrap_model only matters for plain Accelerate's DDP.)
    through_forward = zp is not None and accelerator.zero_config.stage == 3
    before = common.samples(accelerator.unwrap_model(model), tokenizer, args.max_new_tokens, through_forward)
    if accelerator.is_main_process:
        common.print_samples("Before training:", before)
    if zp:
        zp.reset_comm_stats()  # count the training steps only
    history, reports, seconds = train(args, accelerator, model, optimizer, loader, scheduler, zp)
    comm = zp.comm_stats() if zp else None
    after = common.samples(accelerator.unwrap_model(model), tokenizer, args.max_new_tokens, through_forward)

    accelerator.save_state(os.path.join(args.output_dir, "state"))  # resumable: accelerator.load_state
    adapter_dir = os.path.join(args.output_dir, "adapter")
    state = accelerator.get_state_dict(model)  # collective: full tensors on the main process, {} elsewhere
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(adapter_dir, state_dict=state)  # adapter weights only
        tokenizer.save_pretrained(adapter_dir)
    accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        common.print_samples("After training:", after)
        reloaded = common.reload_adapter_samples(args, adapter_dir)
        common.print_samples(f"Adapter reloaded from {adapter_dir} onto a fresh base model:", reloaded)
        common.print_report(history, reports, comm, seconds, adapter_dir)
        common.write_json(
            os.path.join(args.output_dir, "metrics.json"),
            {
                "example": "lora_finetune_accelerate",
                "history": history,
                "losses": [h["loss"] for h in history],
                "seconds": seconds,
                "num_processes": accelerator.num_processes,
                "zero_config": accelerator.zero_config.to_dict() if zp else None,
                "trainable_params": trainable,
                "total_params": total,
                "samples_before": before,
                "samples_after": after,
                "samples_reloaded": reloaded,
                "memory": reports,
                "comm": comm,
            },
        )
    accelerator.end_training()


def train(args, accelerator, model, optimizer, loader, scheduler, zp):
    """Returns (per-step history, every rank's memory report at the last step, seconds)."""
    progress = common.Progress(args.max_steps, accelerator.is_main_process, desc="train")
    history, reports = [], None
    step, loss_sum, tokens, micro = 0, 0.0, 0, 0
    model.train()
    while step < args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    log = (step + 1) % args.log_every == 0 or step + 1 == args.max_steps
                    memory = memory_of(zp, model, optimizer) if log else None  # grads are still held here
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            loss_sum += loss.detach().float()
            tokens += int(batch["attention_mask"].sum())
            micro += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            totals = accelerator.reduce(torch.tensor([float(loss_sum) / micro, float(tokens)]), "sum")
            mean_loss = float(totals[0]) / accelerator.num_processes
            history.append(
                {
                    "step": step,
                    "loss": mean_loss,
                    "grad_norm": float(norm),
                    "tokens": int(totals[1]),
                    "lr": scheduler.get_last_lr()[0],
                    "time": time.perf_counter(),
                }
            )
            memory_bytes = None
            if memory is not None:
                reports = gather_object([memory]) if zp else None
                memory_bytes = [r["measured"]["total"] for r in reports] if reports else None
            progress.update(step, mean_loss, int(totals[1]), memory_bytes, log=memory is not None)
            loss_sum, tokens, micro = 0.0, 0, 0
            if step >= args.max_steps:
                break
    return history, reports, progress.close()


def memory_of(zp, model, optimizer):
    return zp.memory_report(model, optimizer) if zp else None


if __name__ == "__main__":
    main()
