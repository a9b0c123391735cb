"""Ordinary edits between ``from_pretrained`` and ``prepare``, several cases in one Accelerate script.

What transformers' ``run_clm_no_trainer.py`` (a vocabulary resize), TRL's ``clone_chat_template``,
Accelerate's ``complete_nlp_example.py`` (``model.to(accelerator.device)``) and many scripts do before
``accelerator.prepare``: each case loads a model, edits it, prepares it with a fresh AdamW, trains 2 steps.
No zero_plugin in it: run under ``zero-plugin launch --stage S`` (lazy loading at stage 3, or on rank 1 with
``cpu_ram_efficient_loading``) and under plain ``accelerate launch`` (DDP, eager) by
tests/integrations/test_lazy_edits.py, which compares the runs.

Rank 0 writes ``<out>/<case>.pt``: the full embedding / output-layer tensors right after ``prepare`` (to be
compared bit for bit) and the losses; every rank writes ``<out>/<case>.rank<r>.json`` with what a forward
before ``prepare`` did (``"ok"`` or the error's text).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
ADDED = 8  # rows a resize adds to the real-shaped model (4096 -> 4104)


def resize_mean(args, accelerator):
    model = load(args.real)
    model.resize_token_embeddings(model.config.vocab_size + ADDED)  # run_clm_no_trainer.py: len(tokenizer)
    return model


def resize_plain(args, accelerator):
    model = load(args.real)
    model.resize_token_embeddings(model.config.vocab_size + ADDED, mean_resizing=False)
    return model


def to_device(args, accelerator):
    """complete_nlp_example.py: the model is moved before prepare; modes switched as scripts do."""
    model = load(args.real).to(accelerator.device)
    model.eval()
    return model.train()


def dtype_round_trip(args, accelerator):
    """Casts before prepare act on the values: bf16 and back rounds every weight, as eagerly."""
    model = load(args.real).to(torch.bfloat16)
    return model.float().to(accelerator.device, torch.float32)


def chat_template(args, accelerator):
    """TRL's clone_chat_template: added special tokens, eos, a resize padded to a multiple of 64."""
    from trl import clone_chat_template

    model, tokenizer = load(args.tied), AutoTokenizer.from_pretrained(args.tied)
    model, tokenizer, added = clone_chat_template(model, tokenizer, args.chat_source)
    assert added and model.config.vocab_size == len(tokenizer.vocab)
    return model


def special_tokens_tied(args, accelerator):
    model, tokenizer = load(args.tied), AutoTokenizer.from_pretrained(args.tied)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|tool|>"]})
    model.resize_token_embeddings(len(tokenizer))
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.gradient_checkpointing_enable()
    return model


def peft_resized(args, accelerator):
    """A resized embedding and output layer trained in full next to LoRA (PEFT modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    model = load(args.real)
    model.resize_token_embeddings(model.config.vocab_size + ADDED)
    model.tie_weights()
    config = LoraConfig(r=4, target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"])
    return get_peft_model(model, config)


def forward_first(args, accelerator):
    """A forward before prepare needs the weights: it runs (eager) or says why not and how to load eagerly."""
    model = load(args.real)
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(8)[None]).logits.sum().item()
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(args.out, f"forward_first.rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"forward": outcome}, f)
    return model


CASES = {
    f.__name__: f
    for f in (
        resize_mean,
        resize_plain,
        to_device,
        dtype_round_trip,
        chat_template,
        special_tokens_tied,
        peft_resized,
        forward_first,
    )
}


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def run_case(name, args, accelerator):
    allow_next_lazy_load()
    set_seed(0)
    model = CASES[name](args, accelerator)
    vocab = model.get_input_embeddings().weight.shape[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = accelerator.get_state_dict(model)  # collective; full tensors on rank 0
    tensors = {k: v.clone() for k, v in state.items() if "embed_tokens" in k or "lm_head" in k}
    losses = []
    for step in range(2):
        ids = torch.randint(
            0, vocab, (2, 16), generator=torch.Generator().manual_seed(10 * step + accelerator.process_index)
        )
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    if accelerator.is_main_process:
        torch.save({"tensors": tensors, "losses": losses}, os.path.join(args.out, f"{name}.pt"))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def allow_next_lazy_load():
    """Under zero_plugin.run a from_pretrained after the process's first prepare loads eagerly (an evaluation
    copy, nothing will shard it); these cases each load a model to be prepared, so each is a first load."""
    try:
        from zero_plugin.loading import materialize
    except ImportError:  # a plain DDP run without zero_plugin installed
        return
    materialize._SET_UP[0] = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", required=True, help="real-shaped untied model folder")
    ap.add_argument("--tied", required=True, help="small tied model folder with its tokenizer")
    ap.add_argument("--chat_source", required=True, help="tokenizer folder with a chat template and added tokens")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    accelerator = Accelerator()
    for name in args.cases.split(","):
        run_case(name, args, accelerator)
    accelerator.end_training()


if __name__ == "__main__":
    main()
