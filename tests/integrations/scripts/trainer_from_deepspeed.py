"""A plain transformers ``Trainer`` resuming the HF Trainer + DeepSpeed ZeRO-3 fixture.

No zero_plugin and no DeepSpeed in it: the model, data and arguments are those of
``tests/fixtures/deepspeed/make_hf_trainer_ckpt.py`` (global batch kept at any world size).  Resumes from
--resume to the end; rank 0 writes OUT/result.json with the losses logged after the resume.
"""

import argparse
import json
import os

import torch
from transformers import LlamaForCausalLM, Trainer

from tests.fixtures.deepspeed import make_hf_trainer_ckpt as fx  # the repository root is on PYTHONPATH


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", required=True)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(1)  # not the writer's seed: only the checkpoint can make the weights equal
    trainer = Trainer(
        LlamaForCausalLM(fx.llama_config()), fx.training_args(args.out, world), train_dataset=fx.dataset()
    )
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        result = {"losses": fx.losses(trainer), "world_size": trainer.accelerator.num_processes}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
