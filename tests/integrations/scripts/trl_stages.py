"""TRL's ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer`` (LoRA, TRL's fused LM head) one after the other in
one launch, on real-shaped random-init Llamas (no zero_plugin in it): SFT on an untied head of 4096 x 256 = 2^20
elements (a stage-3 unit of its own), DPO on a tied one with a separate reference model, GRPO on an untied one
generating in the trainer (``model.generate``, no vLLM) and scored by a tiny reward function.  Rank 0 writes
OUT/result.json (each trainer's log history and seconds) and OUT/<trainer>/adapter_model.safetensors
(``save_model``).  Each rank writes OUT/dpo/memory-rank<r>.json: the bytes its DPO reference model's parameters
hold after training and the whole model's (TRL prepares the reference with ``prepare_model(evaluation_mode=True)``).
``--more``: ``trl_trainers.py``'s trainers after these, in the same processes and files.
"""

import argparse
import json
import os
import sys
import time

import torch
from peft import LoraConfig
from transformers import LlamaForCausalLM, set_seed
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl_common import trl_args

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from dpo_trl import preferences, storage_bytes, tokenizer  # noqa: E402

from tests.models import real_llama_config  # noqa: E402

REFERENCE_FULL_BYTES: list[int] = []  # dpo(): the reference model's bytes as built


def llama(tok, tie: bool, seed: int) -> LlamaForCausalLM:
    set_seed(seed)
    config = real_llama_config(tie=tie)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    return LlamaForCausalLM(config)


def texts(rows: int) -> list[dict]:
    """Plain-text rows for SFT: the preference rows' prompt and chosen continuation."""
    data = preferences(rows, seed=2)
    return [{"text": p + c} for p, c in zip(data["prompt"], data["chosen"])]


def lora(targets) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")


def sft(tok, out: str, steps: int) -> SFTTrainer:
    from datasets import Dataset

    config = SFTConfig(**trl_args(os.path.join(out, "sft"), steps), packing=False, dataset_text_field="text")
    return SFTTrainer(
        model=llama(tok, tie=False, seed=0),
        args=config,
        train_dataset=Dataset.from_list(texts(16)),
        processing_class=tok,
        peft_config=lora("all-linear"),
    )


def dpo(tok, out: str, steps: int) -> DPOTrainer:
    config = DPOConfig(**trl_args(os.path.join(out, "dpo"), steps), beta=0.1)
    policy, reference = llama(tok, tie=True, seed=0), llama(tok, tie=True, seed=1)
    REFERENCE_FULL_BYTES.append(storage_bytes(reference))  # before prepare shards it
    return DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config,
        train_dataset=preferences(16, seed=1),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def even_tokens(completions, completion_ids, **kwargs) -> list[float]:
    """GRPO's reward: the share of even token ids (ids, not text: the random model samples from its 4096 ids,
    most of them outside the tokenizer's vocabulary), so that the sampled completions of a prompt differ."""
    return [sum(i % 2 == 0 for i in ids) / max(1, len(ids)) for ids in completion_ids]


def grpo(tok, out: str, steps: int) -> GRPOTrainer:
    settings = {k: v for k, v in trl_args(os.path.join(out, "grpo"), steps).items() if k != "max_length"}
    config = GRPOConfig(**settings, num_generations=2, max_completion_length=6, beta=0.0)
    return GRPOTrainer(
        model=llama(tok, tie=False, seed=0),
        reward_funcs=even_tokens,
        args=config,
        train_dataset=preferences(16, seed=3).select_columns(["prompt"]),
        processing_class=tok,
        peft_config=lora(["q_proj", "v_proj"]),
    )


def write_reference_bytes(trainer, out: str) -> None:
    """OUT/memory-rank<r>.json: this rank's reference-model bytes after training, and the whole model's."""
    full = REFERENCE_FULL_BYTES[-1]
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"memory-rank{rank}.json"), "w") as f:
        json.dump({"ref_param_bytes": storage_bytes(trainer.ref_model), "ref_full_bytes": full}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--more", default="", help="trl_trainers.py's trainers (comma-separated) to run after these")
    args = ap.parse_args()
    tok = tokenizer()
    result = {}
    for name, build in (("sft", sft), ("dpo", dpo), ("grpo", grpo)):
        start = time.perf_counter()
        trainer = build(tok, args.out, args.max_steps)
        trainer.train()
        trainer.save_model(os.path.join(args.out, name))
        result[name] = trainer.state.log_history
        if name == "dpo":
            write_reference_bytes(trainer, os.path.join(args.out, name))
        result[f"{name}_seconds"] = time.perf_counter() - start
        result["world_size"] = trainer.args.world_size
        result["accelerator_class"] = type(trainer.accelerator).__module__
    # what GRPO / RLOO push to vLLM with: zero_plugin.run's patch (integrations/trl_vllm.py) or TRL's own
    result["vllm_sync"] = VLLMGeneration._iter_named_params.__module__
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    if args.more:  # in the same processes: the launch's fixed cost (start, imports of TRL's stack) paid once
        from trl_trainers import run

        run(args.more.split(","), args.out, args.max_steps, result)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
