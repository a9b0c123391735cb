"""Functions that run inside the ranks of ``tests/unit/test_qlora.py`` (QLoRA: a bitsandbytes 4-bit base with
LoRA adapters; [Note: packed 4-bit weights] in zero_plugin/loading/quantized.py), and the model/data helpers the
single-process references in the test file share with them.

The base and its QLoRA setup (a tiny random Llama loaded 4-bit: nf4, double quantization, bf16 storage, fp32
compute so parity can be tight; odd sizes that pad at 2 ranks) are ``tests/qlora.py``'s.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests.qlora import VOCAB, load_base, load_qlora
from zero_plugin.engines.engine import engine_of

LR = 1e-2
SEQ, PER_RANK = 12, 2


def optimizer_for(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def global_batches(steps: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=g) for _ in range(steps)]


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def packed_bits(model) -> dict[str, torch.Tensor]:
    """Every packed 4-bit weight of a state dict, as its raw 16-bit patterns (a NaN stays what it was)."""
    sd = model.state_dict()
    return {
        k: v.view(torch.int16).clone()
        for k, v in sd.items()
        if k.endswith(".weight") and k + ".quant_state.bitsandbytes__nf4" in sd
    }


def lora_weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if "lora_" in k}


# -- rank workers ------------------------------------------------------------------------------------
def train_worker(folder: str, stage: int, steps: int, out_dir: str | None = None, config: dict | None = None) -> dict:
    """QLoRA under zp at ``stage`` (and ``config``): per-step losses (this rank's half of each global batch),
    the shard bytes of the packed base, the state dict after training, and (``out_dir``) a sharded checkpoint
    and a PEFT ``save_pretrained`` folder."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_qlora(folder)
    before = packed_bits(model)
    opt = optimizer_for(model)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage, **(config or {})))
    shard_bytes, full_bytes = _packed_bytes(model, engine_of(model, "test"))
    losses = []
    for ids in global_batches(steps, world):
        loss = lm_loss(model, ids[rank * PER_RANK : (rank + 1) * PER_RANK])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = model.state_dict()
    after = {k: state[k].view(torch.int16) for k in before}
    if out_dir is not None:
        zp.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt)
        model.save_pretrained(os.path.join(out_dir, "adapter"), is_main_process=rank == 0)
    return {
        "losses": losses,
        "lora": lora_weights(state),
        "shard_bytes": shard_bytes,
        "full_bytes": full_bytes,
        "bits_equal": all(torch.equal(before[k], after[k]) for k in before),
        "nan_patterns": sum(int(torch.isnan(v.view(torch.bfloat16)).sum()) for v in before.values()),
        "quant_keys": sorted(k for k in state if ".weight." in k),
        "packed_shapes": {k: tuple(state[k].shape) for k in before},
    }


def _packed_bytes(model, engine) -> tuple[int, int]:
    from zero_plugin.loading.quantized import is_packed_4bit

    sharded = getattr(engine, "sharded", {})
    shard = full = 0
    for p in model.parameters():
        if is_packed_4bit(p):
            sp = sharded.get(id(p))
            local = sp.local if sp is not None else p.data
            shard += local.numel() * local.element_size()
            full += (sp.layout.numel if sp is not None else p.numel()) * local.element_size()
    return shard, full


def load_state_dict_worker(folder: str) -> dict:
    """Stage 3: a full state dict of a trained copy loaded into a fresh set-up model gives that copy's loss."""
    world = dist.get_world_size()
    ids = global_batches(1, world)[0]
    trained = load_qlora(folder)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    want = lm_loss(trained, ids).item()
    state = trained.state_dict()
    # bitsandbytes' Linear4bit does not consume its own quant-state keys on load (the unsharded model reports
    # them as unexpected too): strict=False, and the test compares with the unsharded model's result.
    unsharded = load_qlora(folder).load_state_dict(state, strict=False)
    model = load_qlora(folder)
    model, _ = zp.setup(model, optimizer_for(model), zp.ZeroConfig(stage=3))
    result = model.load_state_dict(state, strict=False)
    got = lm_loss(model, ids).item()  # every rank runs the whole global batch
    return {
        "want": want,
        "got": got,
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "unsharded_missing": list(unsharded.missing_keys),
        "unsharded_unexpected": list(unsharded.unexpected_keys),
    }


def evaluation_save_worker(folder: str, out: str) -> dict:
    """Stage 3, evaluation only (a reference model): forward on the 4-bit base, then ``save_pretrained`` on
    every rank (rank 0 writes), which transformers must read back as a pre-quantized checkpoint."""
    rank = dist.get_rank()
    model = load_base(folder, cpu_repacking=True)  # as from_pretrained leaves it
    model, _ = zp.setup(model, None, zp.ZeroConfig(stage=3))
    ids = global_batches(1, 1)[0]
    logits = [model(input_ids=ids).logits.detach().clone() for _ in range(2)]  # eval mode, as loaded
    model.save_pretrained(out, is_main_process=rank == 0)
    return {"logits": logits}


def resume_worker(folder: str, out_dir: str) -> dict:
    """A fresh QLoRA model set up at stage 3 loads the sharded checkpoint ``train_worker`` saved."""
    model = load_qlora(folder)
    opt = optimizer_for(model)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3))
    zp.load_checkpoint(os.path.join(out_dir, "ckpt"), model, opt)
    state = model.state_dict()
    return {"lora": lora_weights(state), "steps": [s.get("step") for s in opt.state.values()][:1]}


def base_checkpoint_worker(folder: str, out_dir: str) -> dict:
    """Stage 3, no adapters: the 4-bit base frozen, its unquantized parameters (embeddings, norms, head)
    trained one step, then a sharded checkpoint; returns the logits after the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_base(folder)
    model.train()
    opt = optimizer_for(model)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3))
    ids = global_batches(1, world)[0]
    lm_loss(model, ids[rank * PER_RANK : (rank + 1) * PER_RANK]).backward()
    opt.step()
    opt.zero_grad()
    zp.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt)
    model.eval()
    with torch.no_grad():
        return {"logits": model(input_ids=ids).logits.clone()}
