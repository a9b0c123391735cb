"""What the TRL test scripts (``sft_trl.py``, ``dpo_trl.py``) share: the trainer arguments of a short,
offline, CPU run logged every step, and rank 0's ``OUT/result.json``."""

import json
import os


def trl_args(out: str, max_steps: int) -> dict:
    """Keyword arguments for ``SFTConfig`` / ``DPOConfig``: batch 2, lr 5e-3, every step logged, nothing
    saved or reported, sequences of at most 32 tokens."""
    return {
        "output_dir": out,
        "per_device_train_batch_size": 2,
        "max_steps": max_steps,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "max_length": 32,
    }


def write_result(trainer, out: str, **extra) -> None:
    """On rank 0: OUT/result.json with the log history, the world size, the accelerator's module and ``extra``."""
    if trainer.is_world_process_zero():
        with open(os.path.join(out, "result.json"), "w") as f:
            result = {
                "log_history": trainer.state.log_history,
                "world_size": trainer.args.world_size,
                "accelerator_class": type(trainer.accelerator).__module__,
            }
            json.dump({**result, **extra}, f)
