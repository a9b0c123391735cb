"""A plain Accelerate QLoRA script (no zero_plugin in it): a 4-bit base in the FSDP-QLoRA layout
(``bnb_4bit_quant_storage=torch.bfloat16``) loaded with ``from_pretrained``, PEFT LoRA on top (both by
``tests/qlora.py``, which the test's references use too), a few steps, then the adapter saved the way
transformers' examples save (every rank calls ``save_pretrained``).

    python qlora_accelerate.py --base DIR --out OUT --batch_size 4                  # one process
    zero-plugin launch --cpu --stage 3 --num_processes 2 qlora_accelerate.py --base DIR --out OUT --batch_size 2

Rank 0 writes the losses (the mean over processes) to OUT/losses.json; the adapter goes to OUT/adapter.
"""

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from tests import qlora  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    accelerator = Accelerator()
    model = qlora.add_lora(qlora.load_base(args.base, cpu_repacking=True))  # from_pretrained's CPU path as is
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(7)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, qlora.VOCAB, (4 * args.steps, 12), generator=g)]
    loader = DataLoader(rows, batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    accelerator.unwrap_model(model).save_pretrained(
        os.path.join(args.out, "adapter"), is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
