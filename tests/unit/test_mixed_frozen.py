"""Frozen parameters and mixed precision at every stage; freezing or unfreezing after setup; edits through
``zp.gathered_parameters`` with bf16 parameters and fp32 masters; autograd through gathered stage-3
parameters; ``unit_classes`` that match nothing.  Workers in ``mixed_frozen_workers.py``."""

from __future__ import annotations

import pytest
import torch

import zero_plugin as zp
from tests import models
from tests.harness import run_ranks
from tests.unit import mixed_frozen_workers as MW
from zero_plugin.stage3.policy import assign_units

STAGES = [0, 1, 2, 3]
F64 = 1e-10


# -- frozen parameters with param_dtype ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage3_lora_dtypes():
    r = run_ranks(2, MW.lora_bf16_worker, 3, 1)[0]
    return r["frozen_dtypes"], r["buffer_dtypes"]


@pytest.mark.parametrize("stage", STAGES)
def test_lora_bf16_frozen_base_cast_like_stage3(stage, stage3_lora_dtypes):
    frozen3, buffers3 = stage3_lora_dtypes
    assert set(frozen3.values()) == {"torch.bfloat16"}, frozen3  # stage 3 stores frozen params in param_dtype
    for rank, r in enumerate(run_ranks(2, MW.lora_bf16_worker, stage)):
        assert r["frozen_dtypes"] == frozen3, f"rank {rank}: frozen params {r['frozen_dtypes']}"
        assert r["buffer_dtypes"] == buffers3, f"rank {rank}: buffers {r['buffer_dtypes']}"
        assert r["n_trainable"] > 0
        # bf16 forward/backward against fp32 single-process training.
        assert r["update_norm_error"] <= 0.05, f"rank {rank}: update-norm error {r['update_norm_error']:.3g}"
        assert r["loss_rel"] <= 1e-2, f"rank {rank}: loss relative error {r['loss_rel']:.3g}"


# -- unfreezing / freezing after setup ----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_unfrozen_after_setup_is_refused(stage):
    for rank, r in enumerate(run_ranks(2, MW.unfreeze_worker, stage, timeout=60)):
        error = r["error"]
        assert error is not None, f"rank {rank}: a parameter unfrozen after setup trained silently (or not at all)"
        kind, _, message = error.partition(": ")
        assert kind in ("ValueError", "RuntimeError") and message.startswith("zero_plugin"), error
        assert "blocks.0.fc.weight" in message and "zp.setup" in message, error


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_frozen_after_setup_matches_reference(stage, world_size):
    for rank, r in enumerate(run_ranks(world_size, MW.freeze_later_worker, stage)):
        assert r["moved"] > 1e-3 and r["frozen_moved_in_ref"] == 0.0, r
        assert r["max_abs_diff"] <= F64, f"rank {rank}: max |θ - θ_ref| = {r['max_abs_diff']:.3g}"


# -- gathered_parameters edits with fp32 masters -------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage,host_masters,world_size",
    [
        (0, False, 2),
        (1, False, 2),
        (2, False, 2),
        (3, False, 2),
        (3, False, 3),
        (1, False, 3),
        (3, True, 2),
        (3, True, 1),
    ],
)
def test_gathered_edit_keeps_unedited_masters_bitwise(stage, host_masters, world_size):
    for rank, r in enumerate(run_ranks(world_size, MW.gathered_edit_worker, stage, host_masters)):
        assert r["master_dtypes"] == ["torch.float32"], r["master_dtypes"]
        if host_masters:  # the layout under test: bf16 shards, separate fp32 host masters
            assert r["separate_masters"] > 0, r
        assert r["changed"] == {} and r["max_error"] == 0.0, (
            f"rank {rank}: masters changed by an edit of one element: {r['changed']} (max {r['max_error']:.3g})"
        )
        assert abs(r["edit_after_step"] - MW.EDIT_VALUE) < 0.05, r["edit_after_step"]  # one lr=1e-2 step away


# -- autograd through parameters used outside their unit's forward -------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("where", ["gathered_after", "gathered_before"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_regulariser_inside_gathered_parameters_matches_reference(stage, where, world_size):
    for rank, r in enumerate(run_ranks(world_size, MW.regulariser_worker, stage, where, timeout=60)):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["moved"] > 1e-3
        assert r["max_abs_diff"] <= F64, f"rank {rank}: max |θ - θ_ref| = {r['max_abs_diff']:.3g}"


# -- unit_classes ---------------------------------------------------------------------------------------------------


def test_unit_classes_matching_nothing_is_an_error():
    model = models.make_odd_mlp()
    with pytest.raises(ValueError) as info:
        assign_units(model, zp.ZeroConfig(stage=3, unit_classes=("OddBlok", torch.nn.Conv2d)))
    message = str(info.value)
    assert message.startswith("zp.setup") and "unit_classes" in message, message
    assert "OddBlok" in message and "Conv2d" in message, message  # what was asked for
    assert "OddBlock" in message and "Linear" in message, message  # what the model has


def test_unit_classes_matching_something_still_works():
    units, _ = assign_units(models.make_odd_mlp(), zp.ZeroConfig(stage=3, unit_classes=("OddBlock",)))
    assert [n for n, _ in units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("where", ["plain_after", "plain_before"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_parameter_used_outside_its_unit_is_a_zero_plugin_error(where, world_size):
    """Without ``zp.gathered_parameters`` the regulariser sees this rank's 1-D shard: an error naming the
    parameter and the fix, on every rank, not autograd's shape error (or, for a 1-D shard that happens to fit,
    a silently wrong gradient)."""
    for rank, r in enumerate(run_ranks(world_size, MW.regulariser_worker, 3, where, timeout=60)):
        error = r["error"] or ""
        assert "blocks.0.fc.weight" in error and "zp.gathered_parameters" in error, f"rank {rank}: {error!r}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameter_used_outside_any_unit_trains_at_stages_0_to_2(stage):
    for rank, r in enumerate(run_ranks(2, MW.regulariser_worker, stage, "plain_after", timeout=60)):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["max_abs_diff"] <= F64, f"rank {rank}: max |θ - θ_ref| = {r['max_abs_diff']:.3g}"


# -- [Note: leaf units] -----------------------------------------------------------------------------------------------


def _untied_llama_with_big_vocab():
    from transformers import LlamaForCausalLM

    cfg = models.llama_config(8192, 128, kv_heads=4, max_positions=2048)  # 2048: transformers' default
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)  # 8192 x 128 = 1M elements each: embedding and head are leaf units


@pytest.mark.parametrize("unit_classes", [(), ("LlamaDecoderLayer",), ("LlamaMLP", "LlamaAttention")])
def test_big_embedding_and_head_are_units_of_their_own_with_default_or_named_blocks(unit_classes):
    """An untied embedding or LM head outside every block is its own unit (gathered around its use), not part
    of the root unit gathered for the whole step, whether the blocks are the default or named by
    ``unit_classes`` (half-layer units only pay off if the 32k-vocabulary matrices are not held all step)."""
    units, owner = assign_units(_untied_llama_with_big_vocab(), zp.ZeroConfig(stage=3, unit_classes=unit_classes))
    names = [n for n, _ in units]
    assert "model.embed_tokens" in names and "lm_head" in names, names


def test_a_custom_unit_policy_decides_alone():
    policy = lambda module, name: type(module).__name__ == "LlamaDecoderLayer"  # noqa: E731
    units, _ = assign_units(_untied_llama_with_big_vocab(), zp.ZeroConfig(stage=3, unit_policy=policy))
    assert [n for n, _ in units] == ["<root>", "model.layers.0", "model.layers.1"]


# -- offloaded masters keep a float64 model's precision -----------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])  # offload needs a sharded optimizer
def test_float64_model_offloaded_to_a_separate_host_keeps_float64_masters(stage):
    for r in run_ranks(2, MW.float64_host_master_worker, stage):
        assert r["master_dtypes"] == ["torch.float64"], r
        assert r["max_abs_diff"] <= F64, r
