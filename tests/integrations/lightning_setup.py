"""How the Lightning tests set Lightning up: the harness's pool workers as externally launched ranks, and a
``Trainer`` or a launched ``Fabric`` on the CPU over 2 devices with everything no test reads turned off.

Strategies are passed through as given (a registered name, ``"ddp"``, a strategy object); the ``"<preset>:full"``
shorthand and the eager stage-3 presets of the parity tests are ``lightning_workers.resolve_strategy``'s.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from typing import Any, Iterator

import torch.distributed as dist

QUIET = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


def lightning_package(package: str = "lightning.pytorch"):
    """``lightning.pytorch`` or the standalone ``pytorch_lightning`` (distinct classes, same API)."""
    return importlib.import_module(package)


def quiet_loggers(level: int = logging.WARNING) -> None:
    """Lightning's info lines (devices, strategies, seeds) off in every package's logger."""
    for name in QUIET:
        logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def lightning_ranks() -> Iterator[None]:
    """Let Lightning use this pool worker's process group as externally launched ranks; restore after."""
    import zero_plugin.integrations.lightning  # noqa: F401  (registers zero1 ... zero3_offload)

    saved = dict(os.environ)
    os.environ.update(
        LOCAL_RANK=str(dist.get_rank()),
        NODE_RANK="0",
        WORLD_SIZE=str(dist.get_world_size()),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
    quiet_loggers()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cpu_trainer(strategy: Any, root: str, package: str = "lightning.pytorch", **options: Any):
    """``Trainer`` on 2 CPU devices writing under ``root``, without logger, checkpointing, progress bar, model
    summary or sanity validation; ``options``: any other ``Trainer`` argument, or one of those turned back on."""
    settings = dict(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(options)
    return lightning_package(package).Trainer(**settings)


def cpu_fabric(strategy: Any, package: str = "lightning.fabric", **options: Any):
    """``Fabric`` on 2 CPU devices (``options``: e.g. ``plugins``), launched."""
    fabric = importlib.import_module(package).Fabric(accelerator="cpu", devices=2, strategy=strategy, **options)
    fabric.launch()
    return fabric
