"""A plain Accelerate training script in the style of Accelerate's examples (no zero_plugin in it).

Tiny random-init Llama, gradient accumulation, clipping, a linear schedule, ``save_state`` after
epoch 1, epoch 2, then ``load_state`` and epoch 2 again (the replay must repeat epoch 2 exactly).
Rank 0 writes losses and state dicts to --out.  ``--memory_report`` (zero_plugin runs only) adds
each rank's ``zp.memory_report`` taken after the last backward, before the step.
"""

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM, get_linear_schedule_with_warmup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from tests.models import llama_config  # noqa: E402


def make_dataset(rows=64, length=16, vocab=128):
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(length)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def train_epoch(accelerator, model, optimizer, scheduler, loader, report=None):
    losses, norms = [], []
    model.train()
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            if report is not None and step == len(loader) - 1:
                report(model, optimizer)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return {"losses": losses, "grad_norms": norms}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--memory_report", action="store_true")
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    config = llama_config(128, 64, use_cache=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(make_dataset(), batch_size=4, shuffle=False)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=40)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    report = None
    if args.memory_report:
        import zero_plugin as zp

        def report(model, optimizer):
            path = os.path.join(args.out, f"memory_rank{accelerator.process_index}.json")
            with open(path, "w") as f:
                json.dump(zp.memory_report(model, optimizer.optimizer), f)

    init_state = accelerator.get_state_dict(model)
    accelerator.save(init_state, os.path.join(args.out, "init.pt"))
    epochs = {"epoch1": train_epoch(accelerator, model, optimizer, scheduler, loader)}
    checkpoint = os.path.join(args.out, "state")
    accelerator.save_state(checkpoint)
    epochs["epoch2"] = train_epoch(accelerator, model, optimizer, scheduler, loader)
    accelerator.save(accelerator.get_state_dict(model), os.path.join(args.out, "before_replay.pt"))
    accelerator.load_state(checkpoint)
    epochs["replay"] = train_epoch(accelerator, model, optimizer, scheduler, loader, report)
    accelerator.save(accelerator.get_state_dict(model), os.path.join(args.out, "final.pt"))
    accelerator.save_model(model, os.path.join(args.out, "saved_model"))
    accelerator.wait_for_everyone()
    # Only to report which configuration reached the processes (absent under plain Accelerate).
    zero_config = getattr(accelerator, "zero_config", None)
    if accelerator.is_main_process:
        info = {
            "epochs": epochs,
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "accelerator_class": f"{type(accelerator).__module__}.{type(accelerator).__qualname__}",
            "model_class": type(model).__name__,
            "zero_config": zero_config.to_dict() if zero_config is not None else None,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
