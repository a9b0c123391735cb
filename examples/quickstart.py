"""Quick start: a LoRA fine-tune of a small Llama-shaped model under ZeRO-3.

Run on 2 CPU processes (what ``make demo`` does until the full examples land):

    torchrun --nproc-per-node 2 examples/quickstart.py --stage 3

The model is built from a config with random init (no download); the task is
learnable (continue an arithmetic sequence), so the loss falls quickly.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import zero_plugin as zp


def batch(step: int, rank: int, size: int = 8, length: int = 24, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    ids = (start + stride * torch.arange(length)) % vocab
    return {"input_ids": ids, "labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    # Learn a small task quickly: LoRA on attention and MLP plus a trainable embedding.
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj",
                                                                                  "down_proj"],
                                             modules_to_save=["embed_tokens"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model, optimizer = zp.setup(model, optimizer, zp.ZeroConfig(stage=args.stage))
    for step in range(args.steps):
        loss = model(**batch(step, rank)).loss
        loss.backward()
        norm = zp.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}  grad-norm {float(norm):.2f}", flush=True)
    report = zp.memory_report(model, optimizer)
    if rank == 0:
        print(f"\nZeRO-{args.stage} memory on rank 0 (bytes): measured {report['measured']}")
        print(f"theory: { {k: int(v) for k, v in report['theory'].items()} }")
        print(f"comm: {zp.comm_stats()['total']}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
