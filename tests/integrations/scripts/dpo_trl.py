"""TRL's ``DPOTrainer`` with a PEFT (LoRA) policy and a separate reference model (no zero_plugin in it).

A tiny random-init Llama and a word-level tokenizer built here (offline), a small preference dataset of
arithmetic word sequences (chosen: the sequence goes on; rejected: it jumps).  Trains --max_steps, then
each rank records the bytes its reference model's parameters hold (unique storages) and rank 0 writes
OUT/result.json with the trainer's log history.  TRL prepares the reference model with
``accelerator.prepare_model(ref_model, evaluation_mode=True)`` (no DeepSpeed / FSDP here).

The suite no longer launches it (``test_trl_dpo.py`` checks ``trl_stages.py``'s DPO trainer, which writes the same
reference bytes): ``trl_stages.py`` and ``trl_trainers.py`` import its tokenizer, data and ``storage_bytes``; it
still runs alone, by hand.
"""

import argparse
import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, set_seed
from trl import DPOConfig, DPOTrainer
from trl_common import trl_args, write_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
from tests.models import llama_config  # noqa: E402

WORDS = 48


def tokenizer():
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def preferences(rows: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    out = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(rows):
        start, stride = int(torch.randint(0, WORDS, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        seq = [(start + stride * k) % WORDS for k in range(8)]
        jump = [(w + 7) % WORDS for w in seq[4:]]
        out["prompt"].append(" ".join(f"w{w}" for w in seq[:4]) + " ")
        out["chosen"].append(" ".join(f"w{w}" for w in seq[4:]))
        out["rejected"].append(" ".join(f"w{w}" for w in jump))
    return Dataset.from_dict(out)


def llama(vocab: int, seed: int) -> LlamaForCausalLM:
    set_seed(seed)
    config = llama_config(vocab, 64, use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(config)


def storage_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        s = p.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=3)
    args = ap.parse_args()

    tok = tokenizer()
    # a reference unlike the policy, so that its log-probabilities move the loss from the first step
    policy, reference = llama(len(tok), seed=0), llama(len(tok), seed=1)
    set_seed(0)
    full_bytes = storage_bytes(reference)
    config = DPOConfig(**trl_args(args.out, args.max_steps), gradient_accumulation_steps=1, beta=0.1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config,
        train_dataset=preferences(32, seed=1),
        processing_class=tok,
        peft_config=lora,
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(args.out, f"memory-rank{rank}.json"), "w") as f:
        json.dump(
            {
                "ref_param_bytes": storage_bytes(trainer.ref_model),
                "ref_full_bytes": full_bytes,
                "ref_requires_grad": [p.requires_grad for p in trainer.ref_model.parameters()][:1],
            },
            f,
        )
    write_result(trainer, args.out)


if __name__ == "__main__":
    main()
