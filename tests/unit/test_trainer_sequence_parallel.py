"""The HF Trainer's count and refusals under sequence parallelism, on stand-ins (no processes): [Note: the Trainer
under sequence parallelism] in ``zero_plugin/integrations/hf_trainer.py``.  The launched runs against K = 1 are in
``tests/integrations/test_long_context.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import zero_plugin as zp
from zero_plugin.integrations import hf_trainer


class _Group:
    """A sequence-parallel group of 2 whose other rank holds ``other`` labels."""

    size = 2

    def __init__(self, other: int) -> None:
        self.comm = SimpleNamespace(all_reduce=lambda t, tag="": t.add_(other))


class _Trainer:
    compute_loss = hf_trainer.compute_loss  # the Trainer's own loss (installed)

    def __init__(self, across: bool, accepts: bool = True) -> None:
        self.args = SimpleNamespace(average_tokens_across_devices=across, world_size=2)
        self.model_accepts_loss_kwargs, self.compute_loss_func = accepts, None
        # K = 1 of the other rank of the world: its labels counted too
        self.accelerator = SimpleNamespace(
            gather=lambda t: torch.stack([t, t + 5]), sequence_parallel_model=lambda: "model"
        )


class _OwnLoss(_Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # TRL-like
        raise AssertionError("not called")


@pytest.fixture
def k2(monkeypatch):
    monkeypatch.setattr(hf_trainer, "_sequence_parallel_size", lambda trainer: 2)
    monkeypatch.setattr(zp, "sequence_parallel_of", lambda model: _Group(other=3))


def _micro_batches() -> list[dict]:
    first = torch.tensor([[5, -100, 7], [-100, -100, 1]])  # 3 labels
    second = torch.tensor([[2, 2, -100], [4, -100, -100]])  # 3 labels
    return [{"input_ids": torch.zeros(2, 3), "shift_labels": labels} for labels in (first, second)]


def test_count_is_the_split_labels_over_the_accumulation_steps_and_all_ranks(k2):
    count = hf_trainer._get_num_items_in_batch(_Trainer(across=True), _micro_batches(), torch.device("cpu"))
    assert int(count) == 6 + 11  # this rank's 6 over both micro-batches, plus the other rank's slices


def test_count_without_averaging_across_devices_is_the_groups_over_k(k2):
    # loss = S_r / (T_g / K) = K S_r / T_g: each rank of the group seeds K / T_g ([Note: sequence-parallel loss])
    count = hf_trainer._get_num_items_in_batch(_Trainer(across=False), _micro_batches(), torch.device("cpu"))
    assert float(count) == (6 + 3) / 2


def test_no_count_for_a_loss_of_its_own_is_refused(k2):
    assert hf_trainer._get_num_items_in_batch(_Trainer(True, accepts=False), _micro_batches(), "cpu") is None
    with pytest.raises(ValueError, match="_OwnLoss computes its own loss"):
        hf_trainer._get_num_items_in_batch(_OwnLoss(True, accepts=False), _micro_batches(), "cpu")


@pytest.mark.parametrize(
    "change, name",
    [
        ({"compute_loss_func": len}, "compute_loss_func"),
        ({"label_smoother": len}, "label_smoothing_factor"),
        ({"aux_loss_enabled": True}, "MoE auxiliary loss"),
        ({"args": SimpleNamespace(use_liger_kernel=True)}, "use_liger_kernel"),
    ],
)
def test_losses_on_a_slice_are_refused(k2, change, name):
    trainer = SimpleNamespace(compute_loss_func=None, label_smoother=None, args=SimpleNamespace(), **{})
    for key, value in change.items():
        setattr(trainer, key, value)
    with pytest.raises(ValueError, match=f"{name}.*sequence_parallel_size=2 is not supported"):
        hf_trainer._check_sequence_parallel_loss(trainer)
