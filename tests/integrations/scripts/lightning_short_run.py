"""One short Lightning fit under a zero strategy, for the exit-code loop in ``test_lightning_exit.py``.

    python tests/integrations/scripts/lightning_short_run.py STRATEGY CKPT_DIR [--resume]

Without ``--resume``: one epoch, ModelCheckpoint writes ``CKPT_DIR/epoch=0.ckpt`` (a sharded directory
under the zero strategies).  With it: ``fit(ckpt_path=CKPT_DIR/epoch=0.ckpt)`` for a second epoch.
Ranks come from the environment (the test starts both, torchrun-style) or from Lightning's own
launcher when ``LOCAL_RANK`` is unset.  The model is ``tests.models.OddMLP`` (three stage-3 units)
with dropout; a validation loop runs too (stage-3 forwards without gradients).  ``--count-threads`` prints
the process's thread count before the Trainer starts and at exit, after the strategy's exit handler
([Note: gloo at interpreter exit] in ``integrations/lightning_exit.py``): gloo's threads must be gone.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import zero_plugin.integrations.lightning  # noqa: E402,F401  (registers zero1 ... zero3_offload)
from tests.integrations.lightning_setup import cpu_trainer  # noqa: E402
from tests.models import MLP_IN, MLP_OUT, OddMLP  # noqa: E402


class ShortRun(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = OddMLP().float()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.drop(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, MLP_IN), torch.randn(16, MLP_OUT)), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, MLP_IN), torch.randn(8, MLP_OUT)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--count-threads", action="store_true")
    args = parser.parse_args()
    if args.count_threads:  # registered first, so it runs after every handler registered later
        before = _threads()
        atexit.register(lambda: print(f"THREADS before={before} at_exit={_threads()}", flush=True))
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    saver = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="{epoch}", save_top_k=-1)
    trainer = cpu_trainer(
        args.strategy, args.ckpt_dir, max_epochs=2 if args.resume else 1, callbacks=[saver], enable_checkpointing=True
    )
    ckpt = os.path.join(args.ckpt_dir, "epoch=0.ckpt") if args.resume else None
    trainer.fit(ShortRun(), ckpt_path=ckpt)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


if __name__ == "__main__":
    main()
