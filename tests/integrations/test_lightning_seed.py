"""``seed_everything`` under the ZeRO strategies seeds exactly as under ``strategy="ddp"``.

Lightning's Trainer DDP strategy calls ``reset_seed()`` while setting up the processes (Fabric's does not);
without it, dropout masks and data made in ``train_dataloader()`` continue from wherever model
construction left the generator.  The first loss of every rank is compared bitwise (dropout p=0.5 on,
float64): before the first update it depends only on the data, the mask and the initial weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import run_ranks
from tests.integrations import lightning_seed_workers as sw


@functools.cache
def trainer_run(strategy: str) -> list:
    return run_ranks(2, sw.seeded_fit_worker, strategy)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_trainer_seeding_matches_ddp(strategy):
    got, ref = trainer_run(strategy), trainer_run("ddp")
    for rank in range(2):
        assert torch.equal(got[rank]["first_batch"], ref[rank]["first_batch"]), rank
        assert got[rank]["losses"][0] == ref[rank]["losses"][0], (rank, got[rank]["losses"], ref[rank]["losses"])


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_fabric_launch_seeds_like_ddp(strategy):
    """Fabric's DDPStrategy does not call reset_seed() (its FSDP and DeepSpeed strategies do): the ZeRO
    strategy follows DDP, so the generator after launch() is where the script left it, as under DDP."""
    got, ref = run_ranks(2, sw.seeded_fabric_worker, strategy), run_ranks(2, sw.seeded_fabric_worker, "ddp")
    for rank in range(2):
        assert torch.equal(got[rank]["after_launch"], ref[rank]["after_launch"]), rank
