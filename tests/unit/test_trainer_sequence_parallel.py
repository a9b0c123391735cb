"""The HF Trainer's count and refusals under sequence parallelism, on stand-ins (no processes): [Note: the Trainer
under sequence parallelism] in ``zero_plugin/integrations/hf_trainer.py``; its tiled loss ([Note: the Trainer's
tiled loss]) on 2 ranks at K = 2 against its untiled loss and one process on the whole sequences.  The launched
runs against K = 1 are in ``tests/integrations/test_long_context.py``."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import zero_plugin as zp
from tests import models
from tests.harness import run_ranks
from tests.unit import trainer_sequence_parallel_workers as workers
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


# -- the tiled loss: [Note: the Trainer's tiled loss] -------------------------------------------------------------
@functools.cache
def _run(stage: int, tie: bool, tiled: bool, *options) -> list:
    return run_ranks(workers.K, workers.train_worker, stage, tie, tiled, *options)


def _assert_losses(got, want) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0
    )


def _logged(results: list) -> list:
    """The loss the Trainer logs: the ranks' mean."""
    return torch.tensor([out["losses"] for out in results], dtype=torch.float64).mean(0).tolist()


@functools.cache
def _reference(tie: bool, lora: bool = False, counted: bool = True) -> dict:
    return workers.reference(tie, lora, counted)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("stage", [0, 3])
def test_tiled_trainer_loss_trains_as_the_untiled_loss_and_whole_sequences(stage, tie):
    """K = 2 on 2 ranks, float64 real-shaped Llama (4096 x 256 head; untied: a stage-3 unit of its own), 2 SGD
    steps of 2 accumulated micro-batches with ``num_items_in_batch`` summed over the ranks: each rank's loss and the
    parameters equal today's untiled loss (1e-12) and one process on the whole sequences (K = 1 / DDP), and the
    head never runs on the rank's tokens: no tensor holds more than one tile of vocabulary rows."""
    tiled, untiled, ref = _run(stage, tie, True), _run(stage, tie, False), _reference(tie)
    rank_tokens = workers.BATCH * workers.SEQ // workers.K
    for out, other in zip(tiled, untiled):
        _assert_losses(out["losses"], other["losses"])
        assert (out["head_tokens"], other["head_tokens"]) == (0, rank_tokens)  # the head module: no logits
        assert (out["vocab_rows"], other["vocab_rows"]) == (workers.TILE_TOKENS, rank_tokens)
    _assert_losses(_logged(tiled), ref["losses"])  # each rank's loss is S_r / count x N
    for other in (untiled[0]["params"], ref["params"]):
        error = models.update_norm_error(tiled[0]["params"], other, ref["theta0"])
        assert error <= 1e-12, error
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    assert not torch.equal(tiled[0]["params"][head], ref["theta0"][head])  # the head trained


@pytest.mark.parametrize(
    "lora, checkpointing, slice_numel",
    [(True, False, 1 << 22), (True, False, 1 << 18), (False, True, 1 << 22)],
    ids=["lora", "lora-sliced-head", "checkpointing"],
)
def test_tiled_trainer_loss_with_lora_or_checkpointing_at_stage_3(lora, checkpointing, slice_numel):
    """PEFT LoRA (the head frozen, read through ``get_base_model``; with ``linear_slice_numel`` 2^18 the frozen
    2^20 head is a sliced unit, gathered whole by the read at the backbone's end), or the layers checkpointed
    (backward recomputes the backbone without the hook): tiled as above, equal to one process on whole sequences."""
    tiled, ref = _run(3, False, True, lora, checkpointing, slice_numel), _reference(False, lora)
    sliced = [name for name in tiled[0]["sliced_units"] if name.endswith("lm_head")]
    assert len(sliced) == (slice_numel < 1 << 20), tiled[0]["sliced_units"]
    assert tiled[0]["head_tokens"] == 0 and tiled[0]["vocab_rows"] == workers.TILE_TOKENS
    _assert_losses(_logged(tiled), ref["losses"])
    error = models.update_norm_error(tiled[0]["params"], ref["params"], ref["theta0"])
    assert error <= 1e-12, error


@pytest.mark.parametrize("stage", [0, 3])
def test_tiled_trainer_loss_without_a_count_is_the_whole_sequences_mean(stage):
    """A model whose forward takes no loss keyword arguments gets no ``num_items_in_batch``: the tiled loss is then
    ``zp.tiled_lm_loss(..., sequence_parallel=model)``, each micro-batch's whole-sequence mean on every rank, which
    the Trainer divides by the accumulation steps; equal to the untiled ``zp.sequence_parallel_loss`` and to one
    process on the whole sequences."""
    options = (False, False, 1 << 22, False)  # no LoRA, no checkpointing, no sliced unit, no count
    tiled, untiled, ref = (
        _run(stage, False, True, *options),
        _run(stage, False, False, *options),
        _reference(False, False, False),
    )
    for out, other in zip(tiled, untiled):  # every rank holds the whole sequences' mean
        _assert_losses(out["losses"], ref["losses"])
        _assert_losses(other["losses"], ref["losses"])
        assert (out["head_tokens"], out["vocab_rows"]) == (0, workers.TILE_TOKENS)
    for other in (untiled[0]["params"], ref["params"]):
        error = models.update_norm_error(tiled[0]["params"], other, ref["theta0"])
        assert error <= 1e-12, error


def test_heads_that_are_not_provably_plain_keep_the_untiled_loss():
    """[Note: the Trainer's tiled loss]: a final logit softcapping, a biased head, an architecture not checked."""
    model = models.make_real_llama(tie=False, layers=1)
    assert hf_trainer.tiled_head(model) is not None
    model.config.final_logit_softcapping = 30.0
    assert hf_trainer.tiled_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    assert hf_trainer.tiled_head(model) is None
    model.lm_head.bias = None
    model.config.model_type = "cohere"  # logits * logit_scale
    assert hf_trainer.tiled_head(model) is None
