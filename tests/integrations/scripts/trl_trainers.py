"""The rest of TRL's trainers and PEFT's extras, unchanged, one after the other in one launch, on real-shaped
random-init Llamas (vocab 4096 x hidden 256, untied heads of 2^20 elements unless said; no zero_plugin in it),
written the way TRL's docs show them:

* ``rloo``: ``RLOOTrainer`` generating in the trainer, LoRA, KL to the reference (``beta`` 0.05: the adapter
  disabled is the reference);
* ``kto``: ``KTOTrainer`` on unpaired rows, LoRA, no ``ref_model`` (adapter disabled);
* ``reward``: ``RewardTrainer`` on a ``LlamaForSequenceClassification`` (LoRA, ``score`` saved whole);
* ``distill``: ``DistillationTrainer``, a separate untied teacher read by the chunked JSD loss;
* ``dpo_noref`` / ``dpo_precompute``: ``DPOTrainer`` without ``ref_model`` (adapter disabled), the second with
  ``precompute_ref_log_probs``;
* ``sft_save_head``: ``SFTTrainer``, LoRA with ``modules_to_save=["lm_head"]`` (the fused head reads the copy);
* ``sft_tokens``: ``trainable_token_indices`` on the input embedding;
* ``sft_lora_embed``: LoRA on ``embed_tokens`` too;
* ``sft_resized``: ``resize_token_embeddings`` (new tokens, mean-initialised) before the trainer,
  ``modules_to_save=["embed_tokens", "lm_head"]``;
* ``sft_bf16_weights``: the model loaded in bf16 (``dtype=torch.bfloat16``), LoRA.

``FP32`` trainers run in fp32, the others with TRL's own default ``bf16=True`` (autocast, on the CPU too).
Rank 0 writes OUT/result.json (each trainer's log history, seconds and the accelerator's mixed precision) and
OUT/<trainer>/adapter_model.safetensors (``save_model``).  ``trl_stages.py --more`` runs them (``run``) after its
own trainers, in the same launch.
"""

import argparse
import json
import os
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, set_seed
from trl import (
    DistillationConfig,
    DistillationTrainer,
    DPOConfig,
    DPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from trl_common import trl_args

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from dpo_trl import preferences, tokenizer  # noqa: E402
from trl_stages import even_tokens, llama, lora, texts  # noqa: E402

from tests.models import real_llama_config  # noqa: E402

# trained in fp32 (``bf16=False``); the others keep TRL's default ``bf16=True`` (autocast, on the CPU too)
FP32 = {"rloo", "kto", "reward", "dpo_noref", "dpo_precompute"}


# Trained without clipping (max_grad_norm so large that the coefficient is 1; the norm is still logged): each
# trains a tensor of 2^20 elements (lm_head / embed_tokens), whose norm torch's fp32 clip_grad_norm_ on DDP's
# side computes 4.7e-4 relative away from float64 (zero_plugin sums in float64: equal to the float64 reference
# to 1e-8), and under bf16 autocast that different clip coefficient flips AdamW's sign-like steps of near-zero
# gradients within three steps (adapters off by one lr).  Without clipping the adapters are bit-equal to DDP's.
UNCLIPPED = {"sft_save_head", "sft_lora_embed", "sft_resized"}


def settings(out: str, name: str, steps: int, generation: bool = False) -> dict:
    args = trl_args(os.path.join(out, name), steps)
    if generation:  # GRPO-style configs bound completions, not sequences
        del args["max_length"]
    if name in UNCLIPPED:
        args["max_grad_norm"] = 1e9
    return {**args, "bf16": name not in FP32}


def rloo(tok, out, steps):
    config = RLOOConfig(**settings(out, "rloo", steps, True), num_generations=2, max_completion_length=6)
    return RLOOTrainer(
        model=llama(tok, tie=False, seed=0),
        reward_funcs=even_tokens,
        args=config,
        train_dataset=preferences(16, seed=4).select_columns(["prompt"]),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def unpaired(rows: int, seed: int) -> Dataset:
    """KTO's rows: each preference row's chosen completion labelled desirable, its rejected one undesirable."""
    data = preferences(rows, seed)
    out = {"prompt": [], "completion": [], "label": []}
    for p, c, r in zip(data["prompt"], data["chosen"], data["rejected"]):
        out["prompt"] += [p, p]
        out["completion"] += [c, r]
        out["label"] += [True, False]
    return Dataset.from_dict(out)


def kto(tok, out, steps):
    config = KTOConfig(**settings(out, "kto", steps), beta=0.1)
    return KTOTrainer(
        model=llama(tok, tie=False, seed=0),
        args=config,
        train_dataset=unpaired(16, seed=5),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def reward(tok, out, steps):
    set_seed(0)
    config = real_llama_config()
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, tok.pad_token_id, tok.eos_token_id
    data = preferences(16, seed=6)
    rows = {"chosen": [p + c for p, c in zip(data["prompt"], data["chosen"])]}
    rows["rejected"] = [p + r for p, r in zip(data["prompt"], data["rejected"])]
    return RewardTrainer(
        model=LlamaForSequenceClassification(config),
        args=RewardConfig(**settings(out, "reward", steps)),
        train_dataset=Dataset.from_dict(rows),
        processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"),
    )


def distill(tok, out, steps):
    config = DistillationConfig(**settings(out, "distill", steps, True), max_completion_length=6)
    return DistillationTrainer(
        model=llama(tok, tie=False, seed=0),
        teacher_model=llama(tok, tie=False, seed=1),
        args=config,
        train_dataset=preferences(16, seed=7).select_columns(["prompt"]),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def on_disk(data: Dataset, out: str, name: str) -> Dataset:
    """``data`` as ``load_dataset`` gives it: backed by files in a cache folder every rank shares (TRL's
    ``precompute_ref_log_probs`` has rank 0 write the log-probabilities there; an in-memory dataset's cache
    folder is a temporary one per process, where the other ranks do not find them)."""
    from datasets import load_dataset

    path = os.path.join(out, "data", f"{name}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.environ.get('RANK', '0')}"
    data.to_json(part)
    os.utime(part, (0, 0))  # one modification time: the cache folder's name hashes it
    os.replace(part, path)  # the ranks write the same rows
    return load_dataset("json", data_files=path, split="train", cache_dir=os.path.join(out, "hf_cache"))


def dpo(tok, out, steps, name, precompute):
    config = DPOConfig(**settings(out, name, steps), beta=0.1, precompute_ref_log_probs=precompute)
    return DPOTrainer(
        model=llama(tok, tie=False, seed=0),
        args=config,
        train_dataset=on_disk(preferences(16, seed=8), out, name),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def sft(tok, out, steps, name, peft_config, model=None):
    config = SFTConfig(**settings(out, name, steps), packing=False, dataset_text_field="text")
    return SFTTrainer(
        model=model if model is not None else llama(tok, tie=False, seed=0),
        args=config,
        train_dataset=Dataset.from_list(texts(16)),
        processing_class=tok,
        peft_config=peft_config,
    )


def resized(tok) -> LlamaForCausalLM:
    """Two new tokens added to the tokenizer, the model's embeddings resized to them (rows 4096 and 4097, set
    to the mean of the old rows by transformers), as one does before fine-tuning on a new chat format."""
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    model = llama(tok, tie=False, seed=0)
    model.resize_token_embeddings(real_llama_config().vocab_size + 2)
    return model


TRAINERS = {
    "rloo": rloo,
    "kto": kto,
    "reward": reward,
    "distill": distill,
    "dpo_noref": lambda tok, out, steps: dpo(tok, out, steps, "dpo_noref", False),
    "dpo_precompute": lambda tok, out, steps: dpo(tok, out, steps, "dpo_precompute", True),
    "sft_save_head": lambda tok, out, steps: sft(
        tok, out, steps, "sft_save_head", LoraConfig(**LORA, modules_to_save=["lm_head"])
    ),
    "sft_tokens": lambda tok, out, steps: sft(
        tok, out, steps, "sft_tokens", LoraConfig(**LORA, trainable_token_indices=[3, 4, 5, 6])
    ),
    "sft_lora_embed": lambda tok, out, steps: sft(
        tok, out, steps, "sft_lora_embed", lora(["q_proj", "v_proj", "embed_tokens"])
    ),
    "sft_resized": lambda tok, out, steps: sft(
        tok,
        out,
        steps,
        "sft_resized",
        LoraConfig(**LORA, modules_to_save=["embed_tokens", "lm_head"]),
        model=resized(tok),
    ),
    "sft_bf16_weights": lambda tok, out, steps: sft(
        tok, out, steps, "sft_bf16_weights", lora("all-linear"), llama(tok, False, 0).to(torch.bfloat16)
    ),
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}


def run(names, out: str, steps: int, result: dict) -> None:
    """Train each of ``names`` in turn, its log history, seconds and mixed precision added to ``result``; rank 0
    rewrites OUT/result.json after every trainer (a later crash keeps the earlier ones)."""
    for name in names:
        start = time.perf_counter()
        trainer = TRAINERS[name](tokenizer(), out, steps)
        trainer.train()
        trainer.save_model(os.path.join(out, name))
        result[name] = trainer.state.log_history
        result[f"{name}_seconds"] = time.perf_counter() - start
        result[f"{name}_mixed_precision"] = trainer.accelerator.mixed_precision
        result["world_size"] = trainer.args.world_size
        result["accelerator_class"] = type(trainer.accelerator).__module__
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump(result, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    args = ap.parse_args()
    run(args.trainers.split(","), args.out, args.max_steps, {})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
