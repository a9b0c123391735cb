"""Functions that run inside the ranks of ``test_save_pretrained.py``: a script written the way
transformers' ``run_clm_no_trainer.py`` saves, under zero_plugin's ``Accelerator``.

Module-level so the worker pool pickles them by reference.  Accelerate reads its distributed setup from the
environment, which the harness's processes (already in a gloo group) do not set: the worker sets it first.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models


def _accelerator(config):
    from accelerate.state import AcceleratorState

    from zero_plugin.integrations.accelerate import Accelerator

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)
    return Accelerator(cpu=True, zero_plugin=config)


def train_and_save_pretrained(stage: int, peft: bool, output_dir: str, rank0_only: bool = False) -> dict:
    """Two steps, then the upstream saving lines verbatim; returns the trained full state (rank 0)."""
    import zero_plugin as zp

    switch = {"state_dict_rank0_only": True} if rank0_only else {}
    accelerator = _accelerator(zp.ZeroConfig(stage=stage, **switch))
    model = models.make_tiny_llama_lora(layers=3) if peft else models.make_tiny_llama(layers=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in models.make_batches("llama", 2, world, 2):
        accelerator.backward(models.loss_fn(model, models.shard_batch(batch, rank, world)))
        optimizer.step()
        optimizer.zero_grad()

    # transformers/examples/pytorch/language-modeling/run_clm_no_trainer.py, end of main():
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )

    trained = zp.full_state_dict(model)  # rank 0: the trained weights; {} elsewhere
    accelerator.wait_for_everyone()
    return trained
