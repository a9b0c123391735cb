"""Stage 3 prepares a model larger than the device's memory cap (part ``lazy_load`` of tests/gpu/check.py).

A ~1.1 GB fp32 Llama-shaped checkpoint (safetensors, several files) is loaded the way ``zero-plugin launch
--stage 3`` runs a script: ``zero_plugin.run.install()`` (lazy ``from_pretrained``), PEFT LoRA on top, then
zero_plugin's ``Accelerator().prepare`` with parameter and optimizer offload, under
``torch.cuda.set_per_process_memory_fraction`` capping the device at ``CAP_BYTES`` (less than half the
model).  Before this change ``_set_up`` called ``model.to(device)`` on the whole model (OOM under the cap);
now each parameter reaches the device only while its unit is sharded.  Two LoRA steps follow.

    python -m tests.gpu.lazy_load    # prints RESULT{json}; one process, NCCL world size 1
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

CAP_BYTES = 512 * 2**20


def write_checkpoint(folder: str) -> int:
    """Random-init Llama (hidden 1024, 16 layers, vocab 32000: ~270M parameters) as safetensors; its bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="300MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(folder: str, model_bytes: int) -> dict:
    os.environ.update(ZERO_PLUGIN_STAGE="3", ZERO_PLUGIN_OFFLOAD_PARAMS="true", ZERO_PLUGIN_OFFLOAD="cpu")
    from zero_plugin import run as zero_run

    zero_run.install()  # what the launched child does before the script's imports
    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / torch.cuda.get_device_properties(0).total_memory, 0)
    from accelerate import Accelerator  # zero_plugin's, after install()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    meta = sum(p.is_meta for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    accelerator = Accelerator()
    torch.cuda.reset_peak_memory_stats()
    model, optimizer = accelerator.prepare(model, optimizer)
    setup_peak = torch.cuda.max_memory_allocated()
    losses = []
    for step in range(2):
        ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(step)).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "model_bytes": model_bytes,
        "cap_bytes": CAP_BYTES,
        "meta_after_load": meta,
        "setup_peak_bytes": setup_peak,
        "train_peak_bytes": torch.cuda.max_memory_allocated(),
        "losses": losses,
        "whole_model_fits_under_cap": _fits(model_bytes),
        "ok": meta > 0 and model_bytes > 2 * CAP_BYTES and setup_peak < CAP_BYTES and all(x == x for x in losses),
    }


def _fits(nbytes: int) -> bool:
    """Control: the old ``model.to(device)`` needed the whole model on the device at once."""
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        return False
    del block
    return True


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model_bytes = write_checkpoint(folder)
        print("RESULT" + json.dumps(run(folder, model_bytes)), flush=True)


if __name__ == "__main__":
    main()
