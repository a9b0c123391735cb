"""Ranks of ``test_lightning_foreign_checkpoints.py``: ``Trainer.fit(ckpt_path=...)`` under a ZeRO strategy from
checkpoints Lightning's DeepSpeedStrategy and ModelParallelStrategy wrote (``tests/fixtures/lightning``)."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from tests.fixtures.deepspeed import tiny_model as tm
from tests.fixtures.lightning import make_lightning_ckpt as mk
from tests.integrations.lightning_setup import lightning_ranks
from tests.integrations.lightning_workers import make_trainer

FIXTURES = os.path.dirname(os.path.abspath(mk.__file__))


def checkpoint(fixture: str) -> str:
    return os.path.join(FIXTURES, fixture, "ckpt")


def _fit(strategy: str, ckpt_path: str, root: str):
    module = mk.module_class()(seed=1)  # another seed than the writer's: only the load can make it equal
    trainer = make_trainer(
        strategy, root, devices=dist.get_world_size(), max_steps=tm.TRAIN_STEPS + tm.RESUMED_STEPS, max_epochs=-1,
        accumulate_grad_batches=1, gradient_clip_val=None, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, mk.loader(tm.TRAIN_STEPS), ckpt_path=ckpt_path)
    return trainer, module


def resume_worker(cases: list[tuple[str, str]]) -> list[dict]:
    """For each ``(fixture, strategy)``: the losses and learning rates of the steps after the resume."""
    out = []
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        for fixture, strategy in cases:
            trainer, module = _fit(strategy, checkpoint(fixture), root)
            out.append({"losses": mk.global_mean(module.losses), "lrs": module.lrs, "global_step": trainer.global_step})
    return out


def error_worker(ckpt_path: str, strategy: str = "zero2") -> str:
    """The message of the error ``fit(ckpt_path=...)`` raises."""
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        try:
            _fit(strategy, ckpt_path, root)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}"
    return "no error"
