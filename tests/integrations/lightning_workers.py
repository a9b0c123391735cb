"""Functions that run inside the ranks of ``tests/integrations/test_lightning.py``.

Two ways in:
  * ``tests.harness`` pool workers (gloo already initialised): ``lightning_setup.lightning_ranks`` sets the
    variables with which Lightning treats the processes as externally launched, so
    ``Trainer(accelerator="cpu", devices=2, strategy=...)`` runs in the existing processes;
  * ``python -m tests.integrations.lightning_workers resume ...``: a fresh script whose Trainer
    starts its second rank itself (Lightning's subprocess launcher), for the new-process resume.

Every worker returns plain Python / CPU tensors; rank 0 adds the full model state.  Fabric's loops are in
``lightning_fabric_workers.py``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests import models
from tests.integrations.lightning_setup import cpu_trainer, lightning_package, lightning_ranks, quiet_loggers

LR = 1e-2
PER_RANK_BATCH = 2
ACCUM = 2
CLIP = 1.0


# -- the LightningModule --------------------------------------------------------------------------
def build_net(kind: str):
    if kind == "llama":
        return models.make_tiny_llama(layers=2)
    if kind == "lora":
        return models.make_tiny_llama_lora(layers=2)
    raise ValueError(f"unknown model kind {kind!r}")


def make_optimizer(params, lr: float = LR):
    """AdamW: matrices (wd 0.1) and vectors (wd 0, lr / 2); LoRA has matrices only."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1, "lr": lr},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": lr / 2},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


@functools.cache
def _module_class(package: str = "lightning.pytorch"):
    pl = lightning_package(package)

    class TinyLlamaModule(pl.LightningModule):
        """A tiny random Llama (or its LoRA variant) built in ``configure_model``, seeded."""

        def __init__(self, kind: str = "llama") -> None:
            super().__init__()
            self.kind = kind
            self.net = None
            self.step_losses: list[float] = []
            self.init_state: dict[str, torch.Tensor] = {}

        def configure_model(self) -> None:
            if self.net is not None:  # fit -> validate -> test -> predict call this again
                return
            self.net = build_net(self.kind)
            self.init_state = {k: v.detach().clone() for k, v in self.state_dict().items()}

        def training_step(self, batch, batch_idx):
            loss = self.net(**batch).loss
            self.step_losses.append(loss.detach().item())
            return loss

        def validation_step(self, batch, batch_idx):
            loss = self.net(**batch).loss
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def test_step(self, batch, batch_idx):
            loss = self.net(**batch).loss
            self.log("test_loss", loss, sync_dist=True)
            return loss

        def predict_step(self, batch, batch_idx):
            return self.net(**batch).logits.detach()

        def configure_optimizers(self):
            opt = make_optimizer(self.parameters())
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyLlamaModule


@functools.cache
def _manual_module_class(package: str = "lightning.pytorch"):
    class ManualTinyLlamaModule(_module_class(package)):
        """Manual optimization: accumulation with toggle_model(sync_grad=...), clip_gradients, step."""

        def __init__(self, kind: str) -> None:
            super().__init__(kind)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt, sched = self.optimizers(), self.lr_schedulers()
            loss = self.net(**batch).loss
            self.step_losses.append(loss.detach().item())
            last = (batch_idx + 1) % ACCUM == 0
            with opt.toggle_model(sync_grad=last):
                self.manual_backward(loss / ACCUM)
            if last:
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
                sched.step()

    return ManualTinyLlamaModule


def make_module(kind: str = "llama", package: str = "lightning.pytorch", manual: bool = False):
    return (_manual_module_class if manual else _module_class)(package)(kind)


def loader(micro_batches_per_rank: int, world_size: int = 2, seed: int = 0) -> DataLoader:
    """Samples for ``micro_batches_per_rank`` micro-batches of PER_RANK_BATCH rows on every rank."""
    globals_ = models.make_batches("llama", micro_batches_per_rank, world_size, PER_RANK_BATCH, seed=seed)
    samples = [{k: v[i] for k, v in b.items()} for b in globals_ for i in range(b["input_ids"].shape[0])]
    return DataLoader(samples, batch_size=PER_RANK_BATCH, shuffle=False)


# -- running Lightning inside pool workers (lightning_setup.lightning_ranks) -------------------------
def resolve_strategy(name: Any, package: str = "lightning.pytorch", meta_init: bool = False):
    """A registered name, or ``"<preset>:full"`` for ``ZeroStrategy(config=<preset>, checkpoint="full")``.

    Stage-3 presets are built with ``meta_init=False`` unless asked: these tests compare training with DDP
    from the same eagerly built weights, while meta construction initialises unit by unit
    (``test_lightning_meta.py`` covers it).
    """
    if not isinstance(name, str) or (":" not in name and (not name.startswith("zero3") or meta_init)):
        return name
    from zero_plugin.integrations.lightning import ZeroStrategy, standalone_strategies

    cls = ZeroStrategy if package == "lightning.pytorch" else standalone_strategies()[package]
    preset, _, checkpoint = name.partition(":")
    return cls(config=preset, checkpoint=checkpoint or "sharded", meta_init=meta_init)


def make_trainer(strategy: str, root: str, package: str = "lightning.pytorch", **kwargs: Any):
    """``lightning_setup.cpu_trainer`` on ``resolve_strategy(strategy)``, accumulating ACCUM micro-batches and
    clipping the norm to CLIP unless ``kwargs`` say otherwise."""
    options = {"accumulate_grad_batches": ACCUM, "gradient_clip_val": CLIP, **kwargs}
    return cpu_trainer(resolve_strategy(strategy, package), root, package, **options)


def full_state(trainer) -> dict:
    """Collective: the LightningModule's full state dict on rank 0 (whatever the strategy), {} elsewhere."""
    from zero_plugin.integrations.lightning import common

    module = trainer.lightning_module
    if common.is_set_up(module):
        return common.full_model_state(module)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if dist.get_rank() == 0 else {}


def _result(trainer, module, **extra) -> dict:
    out = {"losses": list(module.step_losses), "state": full_state(trainer), **extra}
    if dist.get_rank() == 0:
        out["init"] = module.init_state
    return out


def fit_worker(
    kind: str,
    strategy: str,
    steps: int = 3,
    package: str = "lightning.pytorch",
    manual: bool = False,
    **trainer_kwargs: Any,
) -> dict:
    """``steps`` optimizer steps of ACCUM micro-batches, clipping at CLIP; losses and final weights."""
    if manual:  # the module accumulates and clips itself
        trainer_kwargs.update(accumulate_grad_batches=1, gradient_clip_val=None)
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = make_module(kind, package, manual)
        trainer = make_trainer(strategy, root, package, max_epochs=1, **trainer_kwargs)
        trainer.fit(module, loader(steps * ACCUM))
        return _result(
            trainer,
            module,
            global_step=trainer.global_step,
            strategy_class=f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
        )


def fit_eval_worker(strategy: str) -> dict:
    """fit -> validate -> test -> predict with one Trainer and one module, in one process."""
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = make_module("llama")
        trainer = make_trainer(strategy, root, max_epochs=1)
        trainer.fit(module, loader(2 * ACCUM))
        val = trainer.validate(module, loader(2, seed=1), verbose=False)
        test = trainer.test(module, loader(2, seed=2), verbose=False)
        preds = trainer.predict(module, loader(2, seed=3))
        again = trainer.validate(module, loader(2, seed=1), verbose=False)
        return _result(trainer, module, val=val, test=test, again=again, preds=[p.clone() for p in preds])


def eval_first_worker(strategy: str) -> dict:
    """validate before any fit (sharded for inference), then fit, then validate."""
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = make_module("llama")
        trainer = make_trainer(strategy, root, max_epochs=1)
        before = trainer.validate(module, loader(2, seed=1), verbose=False)
        trainer.fit(module, loader(2 * ACCUM))
        after = trainer.validate(module, loader(2, seed=1), verbose=False)
        return _result(trainer, module, before=before, after=after)


def checkpoint_worker(strategy: str, ckpt_dir: str, epochs: int = 2, steps_per_epoch: int = 2) -> dict:
    """An uninterrupted fit that saves a checkpoint at the end of every epoch (ModelCheckpoint)."""
    pl = lightning_package()
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = make_module("llama")
        saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
        trainer = make_trainer(strategy, root, max_epochs=epochs, callbacks=[saver], enable_checkpointing=True)
        trainer.fit(module, loader(steps_per_epoch * ACCUM))
        return _result(trainer, module, files=sorted(os.listdir(ckpt_dir)))


def resume_run(strategy: str, ckpt_path: str, epochs: int = 2, steps_per_epoch: int = 2) -> dict:
    """``trainer.fit(ckpt_path=...)`` in whatever processes run this (the subprocess script)."""
    with tempfile.TemporaryDirectory() as root:
        module = make_module("llama")
        trainer = make_trainer(strategy, root, max_epochs=epochs)
        trainer.fit(module, loader(steps_per_epoch * ACCUM), ckpt_path=ckpt_path)
        return _result(trainer, module, global_step=trainer.global_step)


def summary_worker(strategy: str) -> dict:
    """ModelSummary's printed table and counts (full sizes expected at stage 3)."""
    pl = lightning_package()
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        summary_logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
        summary_logger.addHandler(handler)
        summary_logger.setLevel(logging.INFO)
        try:
            module = make_module("llama")
            trainer = make_trainer(strategy, root, max_steps=1, callbacks=[pl.callbacks.ModelSummary(max_depth=2)])
            trainer.fit(module, loader(ACCUM))
        finally:
            summary_logger.removeHandler(handler)
        from zero_plugin.integrations.lightning import ZeroSummary

        summary = ZeroSummary(module, max_depth=2)
        shard_numel = sum(p.numel() for p in module.parameters())
        return {
            "log": "\n".join(records),
            "total": summary.total_parameters,
            "trainable": summary.trainable_parameters,
            "layers": dict(zip(summary.layer_names, summary.param_nums)),
            "shard_numel": shard_numel,
            "callbacks": [type(c).__name__ for c in trainer.callbacks],
        }


def env_strategy_worker() -> dict:
    """PL_TRAINER_STRATEGY=zero3 switches a Trainer that does not pass strategy= itself; registered names."""
    import lightning.fabric.strategies
    import lightning.pytorch.strategies
    import lightning_fabric.strategies
    import pytorch_lightning.strategies

    pl = lightning_package()
    with lightning_ranks():
        from zero_plugin.integrations.lightning import register_strategies

        register_strategies()  # idempotent: a second call (e.g. from a launcher) changes nothing
        os.environ["PL_TRAINER_STRATEGY"] = "zero3"
        trainer = pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
        strategy = trainer.strategy
        registries = {
            "lightning.pytorch": lightning.pytorch.strategies.StrategyRegistry,
            "pytorch_lightning": pytorch_lightning.strategies.StrategyRegistry,
            "lightning.fabric": lightning.fabric.strategies.STRATEGY_REGISTRY,
            "lightning_fabric": lightning_fabric.strategies.STRATEGY_REGISTRY,
        }
        names = {pkg: sorted(k for k in reg if k.startswith("zero")) for pkg, reg in registries.items()}
        return {
            "type": type(strategy).__name__,
            "stage": getattr(getattr(strategy, "config", None), "stage", None),
            "names": names,
        }


def errors_worker() -> dict:
    """The messages of configurations the integration refuses."""
    from zero_plugin.integrations.lightning import ZeroStrategy

    out = {}
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        try:
            ZeroStrategy(config="zero4")
        except ValueError as exc:
            out["bad_preset"] = str(exc)
        module = _two_optimizer_class()("llama")
        try:
            make_trainer("zero3", root, max_epochs=1, gradient_clip_val=None, accumulate_grad_batches=1).fit(
                module, loader(2)
            )
        except ValueError as exc:
            out["two_optimizers"] = str(exc)
    return out


@functools.cache
def _two_optimizer_class():
    class TwoOptimizers(_module_class()):
        def __init__(self, kind: str) -> None:
            super().__init__(kind)
            self.automatic_optimization = False

        def configure_optimizers(self):
            params = list(self.parameters())
            return make_optimizer(params[:2]), make_optimizer(params[2:])

    return TwoOptimizers


# -- new processes: python -m tests.integrations.lightning_workers resume ... -------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["resume"])
    parser.add_argument(
        "--run",
        action="append",
        nargs=3,
        metavar=("STRATEGY", "CKPT", "OUT"),
        required=True,
        help="one resumed fit per --run, all in the same two new processes",
    )
    args = parser.parse_args(argv)
    import zero_plugin.integrations.lightning  # noqa: F401  (registers the names in every rank)

    torch.set_num_threads(1)
    quiet_loggers()
    warnings.simplefilter("ignore")
    for strategy, ckpt, out in args.run:
        result = resume_run(strategy, ckpt)
        torch.save(result, f"{out}.rank{dist.get_rank()}")


if __name__ == "__main__":
    sys.exit(main())
