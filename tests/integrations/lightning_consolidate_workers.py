"""Functions that run inside the ranks of ``tests/integrations/test_lightning_consolidate.py``.

A module with ``save_hyperparameters()`` and a tied tiny Llama built in ``__init__`` (what
``load_from_checkpoint`` rebuilds), trained under a ZeRO strategy with ``ModelCheckpoint`` writing a
sharded directory per epoch; and a plain-DDP resume from the consolidated file.
"""

from __future__ import annotations

import functools
import logging
import tempfile

import torch
import torch.distributed as dist

from tests import models
from tests.integrations.lightning_setup import lightning_ranks
from tests.integrations.lightning_workers import (
    ACCUM,
    LR,
    full_state,
    loader,
    make_optimizer,
    make_trainer,
)

STEPS_PER_EPOCH = 2


@functools.cache
def module_class():
    import lightning.pytorch as pl

    class TinyLlamaWithHparams(pl.LightningModule):
        def __init__(self, layers: int = 2, lr: float = LR) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = models.make_tiny_llama(layers=layers)  # lm_head tied to the embedding
            self.step_losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.net(**batch).loss
            self.step_losses.append(loss.detach().item())
            return loss

        def configure_optimizers(self):
            opt = make_optimizer(self.parameters(), self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyLlamaWithHparams


def train_worker(strategy: str, ckpt_dir: str, epochs: int = 2) -> dict:
    """Fit ``epochs`` epochs, a sharded checkpoint per epoch; the final full state, the consolidated optimizer
    state (both rank 0), the losses, and what the strategy logged about loading the directories."""
    import lightning.pytorch as pl
    from lightning_utilities.core import rank_zero

    from zero_plugin.integrations.lightning import common

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        # rank_zero_info logs to the rank_zero module of whichever Lightning package was imported last.
        info_logger = logging.getLogger(rank_zero.log.name)
        info_logger.addHandler(handler)
        info_logger.setLevel(logging.INFO)
        try:
            module = module_class()()
            saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
            trainer = make_trainer(strategy, root, max_epochs=epochs, callbacks=[saver], enable_checkpointing=True)
            trainer.fit(module, loader(STEPS_PER_EPOCH * ACCUM))
        finally:
            info_logger.removeHandler(handler)
            info_logger.setLevel(logging.NOTSET)
        out = {
            "losses": list(module.step_losses),
            "state": full_state(trainer),
            "optimizer": common.full_optimizer_state(trainer.optimizers[0]),
            "log": records,
        }
    return out


def ddp_resume_worker(ckpt_file: str, epochs: int = 2) -> dict:
    """``Trainer(strategy="ddp").fit(ckpt_path=<consolidated file>)`` for the remaining epochs."""
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = module_class()()
        trainer = make_trainer("ddp", root, max_epochs=epochs)
        trainer.fit(module, loader(STEPS_PER_EPOCH * ACCUM), ckpt_path=ckpt_file)
        state = {k: v.detach().clone() for k, v in module.state_dict().items()} if dist.get_rank() == 0 else {}
        return {"losses": list(module.step_losses), "state": state, "global_step": trainer.global_step}
