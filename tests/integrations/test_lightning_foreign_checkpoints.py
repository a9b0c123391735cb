"""Issue 40: ``Trainer.fit(ckpt_path=...)`` with a ZeRO strategy resumes what Lightning's own DeepSpeedStrategy and
ModelParallelStrategy (FSDP2) saved, at other stages and world sizes.

The fixtures (``tests/fixtures/lightning/make_lightning_ckpt.py``) were written by Lightning 2.6.6 with DeepSpeed
0.19.8 (ZeRO 2 and 3) and with torch FSDP2, 2 ranks on CPU, together with each writer's own resumed run.  Here the
next two steps after the resume must give the writer's losses (mean over the global batch) to fp32 tolerance and
its learning rates exactly (the StepLR halves it every step, so a scheduler that was not restored shows): that
needs the weights, Adam moments and step count, and Lightning's loop and scheduler state.  One pool launch per world
size runs every case.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest

from tests.harness import run_ranks
from tests.integrations import lightning_foreign_workers as w

LOSS_RTOL = 1e-5  # fp32, another reduction order and shard layout than the writer's
CASES = {
    2: [("deepspeed_stage2", "zero1"), ("deepspeed_stage3", "zero3"), ("fsdp2", "zero2"), ("fsdp2", "zero3_offload")],
    3: [("deepspeed_stage2", "zero3"), ("deepspeed_stage3", "zero2_offload"), ("fsdp2", "zero1")],
}


@functools.cache
def resumed(world: int) -> list[dict]:
    return run_ranks(world, w.resume_worker, CASES[world], timeout=300)


def _expected(fixture: str) -> dict:
    with open(os.path.join(w.FIXTURES, fixture, "expected.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("world", sorted(CASES))
def test_fit_resumes_lightning_deepspeed_and_fsdp2_checkpoints_as_their_writer(world):
    results = resumed(world)
    for (fixture, strategy), got in zip(CASES[world], results[0]):
        expected = _expected(fixture)
        assert got["global_step"] == 4, (fixture, strategy)
        assert got["lrs"] == expected["resumed_lrs"], (fixture, strategy)
        for ours, theirs in zip(got["losses"], expected["resumed_losses"], strict=True):
            assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (fixture, strategy, got["losses"], expected)


def test_a_dcp_folder_without_lightnings_meta_file_and_a_deepspeed_checkpoint_not_from_lightning(tmp_path):
    bare = os.path.join(tmp_path, "bare")
    shutil.copytree(w.checkpoint("fsdp2"), bare)
    os.remove(os.path.join(bare, "meta.pt"))
    for message in run_ranks(2, w.error_worker, bare, timeout=120):
        assert "without Lightning's meta.pt" in message and "zp.load_checkpoint" in message, message
    plain = os.path.join(os.path.dirname(w.FIXTURES), "deepspeed", "stage2", "ckpt")
    for message in run_ranks(2, w.error_worker, plain, timeout=120):
        assert "was not saved by Lightning" in message and "on_fit_start" in message, message
