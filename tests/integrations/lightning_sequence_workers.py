"""Functions that run inside the ranks of ``tests/integrations/test_long_context.py``'s Lightning case:
``ZeroStrategy(config="zero3", sequence_parallel_size=K)`` fits a tiny random Llama (SGD, 3 steps, a validation
loop) on rows of 4 per step over all ranks whatever K; the module computes ``zp.sequence_parallel_loss`` on the
split batches (K > 1) or the model's own loss (K = 1).  Every row has the same number of labels, so K = 1's mean
of the ranks' losses is the mean over all rows."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import zero_plugin as zp
from tests.integrations.lightning_setup import cpu_trainer, lightning_ranks
from tests.models import llama_config

ROWS_PER_STEP = 4


def _rows(count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 128, (19,), generator=g)  # K does not divide 19
        labels = ids.clone()
        labels[:4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _module_class():
    import lightning.pytorch as pl
    from transformers import LlamaForCausalLM

    class TinyLlama(pl.LightningModule):
        def __init__(self, per_device: int) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(llama_config(128, 32, attn_implementation="sdpa"))
            self.per_device = per_device
            self.losses: list[float] = []

        def _loss(self, batch):
            if "shift_labels" in batch:  # split by the strategy (K > 1)
                shift_labels = batch.pop("shift_labels")
                return zp.sequence_parallel_loss(self.model(**batch).logits, shift_labels, self)
            return self.model(**batch).loss

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def train_dataloader(self):
            return DataLoader(_rows(12, seed=1), batch_size=self.per_device)

        def val_dataloader(self):
            return DataLoader(_rows(8, seed=2), batch_size=self.per_device)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return TinyLlama


def fit_worker(k: int) -> dict:
    """Fit under ``ZeroStrategy(config="zero3", sequence_parallel_size=k)``: this rank's losses, the validation loss,
    the sampler's replicas and (rank 0) the full weights."""
    from zero_plugin.integrations.lightning import ZeroStrategy

    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = _module_class()(ROWS_PER_STEP // (dist.get_world_size() // k))
        strategy = ZeroStrategy(config="zero3", sequence_parallel_size=k)
        trainer = cpu_trainer(strategy, root, max_epochs=1)
        trainer.fit(module)
        weights = zp.full_state_dict(module)
        return {
            "losses": module.losses,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "replicas": strategy.distributed_sampler_kwargs["num_replicas"],
            "weights": weights,
        }


def fabric_worker(k: int) -> dict:
    """The same rows and SGD steps in a Fabric loop under ``ZeroFabricStrategy(config="zero3",
    sequence_parallel_size=k)``: ``fabric.setup_dataloaders`` gives the data-parallel sampler and split batches."""
    from transformers import LlamaForCausalLM

    from tests.integrations.lightning_setup import cpu_fabric
    from zero_plugin.integrations.lightning import ZeroFabricStrategy

    with lightning_ranks():
        fabric = cpu_fabric(ZeroFabricStrategy(config="zero3", sequence_parallel_size=k))
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(128, 32, attn_implementation="sdpa"))
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        loader = fabric.setup_dataloaders(DataLoader(_rows(12, seed=1), batch_size=ROWS_PER_STEP // (2 // k)))
        losses = []
        for batch in loader:
            if "shift_labels" in batch:
                shift_labels = batch.pop("shift_labels")
                loss = zp.sequence_parallel_loss(model(**batch).logits, shift_labels, model)
            else:
                loss = model(**batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "weights": zp.full_state_dict(model)}
