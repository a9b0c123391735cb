"""An ordinary Accelerate script: from_pretrained (+ LoRA), prepare, a few steps, save, reload on rank 0.

Run under ``zero-plugin launch --stage 3`` by tests/integrations/test_lazy_load.py.  Writes
``<out>/rank<r>.json``: host-memory growth over from_pretrained + prepare (peak RSS against the RSS
before loading), the sizes it is judged against, losses, whether embeddings stay tied, and (rank 0)
how far the saved-and-reloaded model's loss is from the trained one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def batch(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    accelerator = Accelerator()
    set_seed(0)
    import_model_code(args.lora)  # code, not weights: the growth measured below is tensors
    before = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.lora:
        model = add_lora(model)
    meta = sum(p.is_meta for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    growth = peak_rss_bytes() - before
    sizes = unit_sizes(model)
    inner = model.get_base_model() if args.lora else model
    vocab = inner.config.vocab_size
    losses = []
    for step in range(args.steps):
        ids = batch(vocab, 10 * step + accelerator.process_index)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {
        "growth": growth,
        **sizes,
        "meta_after_load": meta,
        "losses": losses,
        "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
    }
    result["reload_loss_error"] = save_and_reload(args, accelerator, model, batch(vocab, 999))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


def import_model_code(lora: bool) -> None:
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    if lora:
        import peft  # noqa: F401
    # Where DeepSpeed is installed, transformers' and Accelerate's integrations import it on first use, inside
    # the window measured (~16 MiB of modules, not tensors): import it first.
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401


def unit_sizes(model) -> dict:
    """Full model bytes, this rank's shard bytes, the largest unit's full bytes (stage 3)."""
    from zero_plugin.engines.engine import engine_of

    engine = engine_of(model, "lazy_load")
    units = [sum(sp.layout.numel * sp.param.element_size() for sp in u.params) for u in engine.units]
    return {
        "model_bytes": sum(units),
        "shard_bytes": sum(sp.local.numel() * sp.local.element_size() for u in engine.units for sp in u.params),
        "largest_unit_bytes": max(units),
    }


@torch.no_grad()
def save_and_reload(args, accelerator, model, ids) -> float | None:
    """Collective: save the trained weights (adapter with LoRA), reload on rank 0, compare losses."""
    model.eval()
    trained = model(input_ids=ids, labels=ids).loss.item()  # collective at stage 3
    state = accelerator.get_state_dict(model)
    saved = os.path.join(args.out, "saved")
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(saved, state_dict=state)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    if args.lora:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.model), saved)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(saved)
    return abs(reloaded.eval()(input_ids=ids, labels=ids).loss.item() - trained)


if __name__ == "__main__":
    main()
