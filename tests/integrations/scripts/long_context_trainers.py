"""A plain Accelerate loop, the HF ``Trainer`` (full fine-tune, gradient accumulation, evaluation) and TRL's
``SFTTrainer`` (LoRA) on tiny random Llamas, one after the other (the Trainer also resumed from its step-2
checkpoint in a fresh Trainer), under whatever ``zero-plugin launch`` chose (``--sequence_parallel_size K``).

Rows of different lengths (right-padded by the collators, with -100 under the pads and under a "prompt" at the
start of each HF row), 4 rows per micro-batch over all ranks whatever K (``per_device_train_batch_size`` = 4 /
data-parallel groups), so that runs differing only in K train on the same rows.  Rank 0 writes OUT/result.json
(losses, eval loss, the K and loader the Trainer used), OUT/hf_initial.pt and OUT/{hf,trl}_weights.pt (the full
state dicts before and after training).  No zero_plugin in the training code, except reading K to size the batches.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed
from trl import SFTConfig, SFTTrainer

import zero_plugin as zp

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import common  # noqa: E402

GLOBAL_BATCH = 4


def tiny_llama(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def hf_rows(count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(9, 31, (1,), generator=g))  # odd lengths too: K does not divide them all
        ids = torch.randint(1, 256, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def common_args(out: str, per_device: int) -> dict:
    return {
        "output_dir": out,
        "per_device_train_batch_size": per_device,
        "per_device_eval_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def accelerate_loop(k: int, per_device: int) -> list[float]:
    """A plain Accelerate loop (SGD, 4 steps): ``accelerator.prepare(loader)`` shards over the data-parallel
    groups and splits the batches when K > 1, and the loss is then ``zp.sequence_parallel_loss``.  Every row has
    the same number of labels, so K = 1's mean of the ranks' means is the mean over all rows."""
    from accelerate import Accelerator  # zero_plugin's, under zero-plugin launch

    accelerator = Accelerator()
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(16):
        ids = torch.randint(1, 256, (23,), generator=g).tolist()  # K does not divide 23
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    model = tiny_llama(2, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(rows, batch_size=per_device, collate_fn=common.Collator(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    out = []
    for batch in loader:
        if k > 1:
            shift_labels = batch.pop("shift_labels")
            loss = zp.sequence_parallel_loss(model(**batch).logits, shift_labels, model)
        else:
            loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        out.append(accelerator.reduce(loss.detach(), "mean").item())
    return out


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    k = zp.ZeroConfig.from_env().resolved_sequence_parallel_size(world)
    per_device = GLOBAL_BATCH // (world // k)
    result = {"k": k, "accelerate_losses": accelerate_loop(k, per_device)}

    set_seed(0)
    rows = hf_rows(24, seed=1)
    model = tiny_llama(0, 256)
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(
            {n: t.detach().clone() for n, t in model.state_dict().items()}, os.path.join(args.out, "hf_initial.pt")
        )
    hf_args = {**common_args(os.path.join(args.out, "hf"), per_device), "save_strategy": "steps", "save_steps": 2}
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**hf_args),
        train_dataset=rows,
        eval_dataset=hf_rows(6, seed=2),
        data_collator=common.Collator(0),
    )
    result["hf_eval_before"] = trainer.evaluate()["eval_loss"]  # stage 3: set up for evaluation first
    trainer.train()
    result["hf_losses"] = losses(trainer)
    result["hf_eval_loss"] = trainer.evaluate()["eval_loss"]
    result["hf_loader"] = type(trainer.get_train_dataloader()).__name__
    result["hf_sequence_parallel_size"] = trainer.accelerator.sequence_parallel_size
    hf_state = trainer.accelerator.get_state_dict(trainer.model)
    # a fresh Trainer resumed mid-epoch from step 2: the loader skips the trained batches of its shard
    resumed = Trainer(
        model=tiny_llama(0, 256),
        args=TrainingArguments(**{**hf_args, "save_strategy": "no"}),
        train_dataset=rows,
        data_collator=common.Collator(0),
    )
    resumed.train(resume_from_checkpoint=os.path.join(args.out, "hf", "checkpoint-2"))
    result["hf_resumed_losses"] = losses(resumed)

    tokenizer = common.default_tokenizer(common.DEFAULT_DATA, os.path.join(args.out, "cache"))
    texts = [
        {"text": " ".join(r["instruction"].split()[: 3 + i % 9])}
        for i, r in enumerate(common.load_records(common.DEFAULT_DATA)[:24])
    ]
    set_seed(0)
    sft = SFTTrainer(
        model=tiny_llama(1, len(tokenizer)),
        # SGD: Adam's first steps turn float noise on near-zero LoRA gradients into whole +-lr updates
        args=SFTConfig(
            **{**common_args(os.path.join(args.out, "trl"), per_device), "optim": "sgd", "learning_rate": 0.5},
            max_length=64,
            packing=False,
            bf16=False,  # SFTConfig's default: float32, so that K = 1 and 2 can agree to float32 rounding
        ),
        train_dataset=Dataset.from_list(texts),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
    )
    sft.train()
    result["trl_losses"] = losses(sft)
    trl_state = sft.accelerator.get_state_dict(sft.model)
    if trainer.is_world_process_zero():
        torch.save(hf_state, os.path.join(args.out, "hf_weights.pt"))
        torch.save(trl_state, os.path.join(args.out, "trl_weights.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
