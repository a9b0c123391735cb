"""Functions that run inside the ranks of ``tests/integrations/test_lightning_seed.py``.

The pattern of Lightning's ``BoringModel`` scripts: ``seed_everything`` first, then a module built in
``__init__`` (its init draws from the global generator), then ``trainer.fit`` / ``fabric.launch()``.
Lightning's Trainer DDP strategy calls ``reset_seed()`` when it sets up the processes, so dropout masks and
data drawn in ``train_dataloader()`` start from the seed again, not from wherever model init left the
generator; ``ZeroStrategy`` must do the same for a run to reproduce its ``strategy="ddp"`` run.
"""

from __future__ import annotations

import functools
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests import models
from tests.integrations.lightning_setup import cpu_fabric, cpu_trainer, lightning_ranks

SEED = 42
ROWS = 8  # per rank: every rank's sampler takes 4 batches of 2 from the 2 * ROWS rows


@functools.cache
def _dropout_module_class():
    import lightning.pytorch as pl

    class DropoutModule(pl.LightningModule):
        """OddMLP (three stage-3 units) behind a dropout; data drawn with torch's generator."""

        def __init__(self) -> None:
            super().__init__()
            self.net = models.OddMLP().double()
            self.drop = nn.Dropout(0.5)
            self.losses: list[float] = []
            self.first_batch: torch.Tensor | None = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.first_batch is None:
                self.first_batch = x.detach().clone()
            loss = F.mse_loss(self.net(self.drop(x)), y)
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self) -> DataLoader:
            world = 2 * ROWS
            data = TensorDataset(
                torch.randn(world, models.MLP_IN, dtype=torch.float64),
                torch.randn(world, models.MLP_OUT, dtype=torch.float64),
            )
            return DataLoader(data, batch_size=2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return DropoutModule


def seeded_fit_worker(strategy: str, steps: int = 2) -> dict:
    """``seed_everything(SEED)``, build the module, fit ``steps`` steps; this rank's losses and first batch."""
    import lightning.pytorch as pl

    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        pl.seed_everything(SEED, verbose=False)
        module = _dropout_module_class()()
        trainer = cpu_trainer(strategy, root, max_steps=steps)
        trainer.fit(module)
        return {"losses": module.losses, "first_batch": module.first_batch}


def seeded_fabric_worker(strategy: str) -> dict:
    """``seed_everything(SEED)``, draw (as model init would), ``Fabric(...).launch()``, draw again
    (Fabric's DDP does not reset the seed at launch; the ZeRO strategy must not either)."""
    from lightning.fabric import seed_everything

    with lightning_ranks():
        seed_everything(SEED, verbose=False)
        torch.randn(100)  # what building a model before launch() takes from the generator
        cpu_fabric(strategy)
        return {"after_launch": torch.randn(4, dtype=torch.float64), "rank": dist.get_rank()}
