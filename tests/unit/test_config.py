"""Unit tests for zero_plugin.config.ZeroConfig: defaults, normalisation, validation, frozen copies and the
hierarchical-sharding fields.  Serialisation and loading (to_dict / from_dict, from_file, from_env) are in
test_config_loading.py."""

import dataclasses
import math
import pickle

import pytest
import torch

from zero_plugin.config import ZeroConfig


def _policy(module, name):
    return isinstance(module, torch.nn.Linear)


class Block(torch.nn.Module):
    pass


def _raises(match_parts, **kwargs):
    with pytest.raises(ValueError) as info:
        ZeroConfig(**kwargs)
    for part in match_parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"
    return str(info.value)


# --------------------------------------------------------------------- defaults and normalisation


def test_defaults_are_valid():
    config = ZeroConfig()
    assert config.stage == 2
    assert config.offload_optimizer == "none" and not config.offload
    assert config.param_dtype is None and config.reduce_dtype is None
    assert config.master_dtype is torch.float32
    assert config.bucket_size_mb == 25.0 and config.timeout_s == 600.0
    assert config.unit_classes == () and config.unit_policy is None
    assert config.loss_scale == "dynamic" and config.clip_grad_norm is None
    assert not config.mixed_precision and config.effective_reduce_dtype is None


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp64", torch.float64),
        ("float64", torch.float64),
        ("double", torch.float64),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names_normalise(text, dtype):
    assert ZeroConfig(param_dtype=text).param_dtype is dtype
    assert ZeroConfig(reduce_dtype=text).reduce_dtype is dtype


def test_master_dtype_normalises():
    assert ZeroConfig(master_dtype="fp64").master_dtype is torch.float64


@pytest.mark.parametrize(
    "value, expected", [(None, "none"), (False, "none"), (True, "cpu"), ("CPU", "cpu"), ("none", "none")]
)
def test_offload_optimizer_normalises(value, expected):
    config = ZeroConfig(offload_optimizer=value)
    assert config.offload_optimizer == expected
    assert config.offload.optimizer == expected and bool(config.offload) is (expected == "cpu")


def test_unit_classes_normalise_to_tuple():
    assert ZeroConfig(unit_classes=[Block, "GPT2Block"]).unit_classes == (Block, "GPT2Block")
    assert ZeroConfig(unit_classes="GPT2Block").unit_classes == ("GPT2Block",)
    # Sets are sorted so every rank gets the same order.
    assert ZeroConfig(unit_classes={"B", "A", "C"}).unit_classes == ("A", "B", "C")


def test_numbers_normalise():
    config = ZeroConfig(bucket_size_mb=50, clip_grad_norm=1, timeout_s=30, stage=3, param_dtype="fp16", loss_scale=128)
    assert isinstance(config.bucket_size_mb, float) and isinstance(config.clip_grad_norm, float)
    assert config.loss_scale == 128.0 and isinstance(config.timeout_s, float)


def test_properties():
    assert ZeroConfig(param_dtype="bf16").mixed_precision
    assert ZeroConfig(param_dtype="fp16").mixed_precision
    assert not ZeroConfig(param_dtype="fp32").mixed_precision
    assert ZeroConfig(param_dtype="fp32", master_dtype="fp64").mixed_precision
    assert ZeroConfig(param_dtype="bf16").effective_reduce_dtype is torch.bfloat16
    assert ZeroConfig(param_dtype="bf16", reduce_dtype="fp32").effective_reduce_dtype is torch.float32
    assert ZeroConfig(reduce_dtype="fp32").effective_reduce_dtype is torch.float32


def test_constructor_ignores_environment(monkeypatch):
    monkeypatch.setenv("ZERO_PLUGIN_STAGE", "3")
    assert ZeroConfig().stage == 2


# --------------------------------------------------------------------- single-field validation


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("stage", 5, "5"),
        ("stage", -1, "-1"),
        ("stage", True, "True"),
        ("stage", "3", "'3'"),
        ("stage", 2.0, "2.0"),
        ("offload_optimizer", "gpu", "'gpu'"),
        ("offload_optimizer", 1, "1"),
        ("offload_params", "yes", "'yes'"),
        ("offload_params", 1, "1"),
        ("param_dtype", "int8", "'int8'"),
        ("param_dtype", torch.int32, "torch.int32"),
        ("param_dtype", 3, "3"),
        ("reduce_dtype", torch.int64, "torch.int64"),
        ("reduce_dtype", "fp8", "'fp8'"),
        ("master_dtype", "bf16", "'bf16'"),
        ("master_dtype", torch.float16, "torch.float16"),
        ("master_dtype", None, "None"),
        ("bucket_size_mb", 0, "0"),
        ("bucket_size_mb", -1.0, "-1.0"),
        ("bucket_size_mb", 5000, "5000"),
        ("bucket_size_mb", "25", "'25'"),
        ("bucket_size_mb", True, "True"),
        ("bucket_size_mb", math.nan, "nan"),
        ("prefetch_depth", -1, "-1"),
        ("prefetch_depth", 9, "9"),
        ("prefetch_depth", 1.5, "1.5"),
        ("persistence_threshold", -1, "-1"),
        ("persistence_threshold", "0", "'0'"),
        ("reshard_after_forward", "yes", "'yes'"),
        ("reshard_after_forward", 0, "0"),
        ("unit_classes", 5, "5"),
        ("unit_classes", [int], "<class 'int'>"),
        ("unit_classes", [""], "''"),
        ("unit_classes", [torch.nn.Linear(1, 1)], "Linear"),
        ("unit_policy", 5, "5"),
        ("unit_policy", torch.nn.Linear, "Linear"),
        ("clip_grad_norm", 0, "0"),
        ("clip_grad_norm", -1.0, "-1.0"),
        ("clip_grad_norm", "1", "'1'"),
        ("clip_grad_norm", math.inf, "inf"),
        ("loss_scale", "static", "'static'"),
        ("loss_scale", 0, "0"),
        ("loss_scale", -2.0, "-2.0"),
        ("debug_collectives", 1, "1"),
        ("timeout_s", 0, "0"),
        ("timeout_s", math.inf, "inf"),
        ("check_ranks", "true", "'true'"),
        ("trim_host_heap", "no", "'no'"),
        ("trim_each_unit_above", -0.5, "-0.5"),
        ("trim_each_unit_above", "1", "'1'"),
        ("trim_each_unit_above", math.nan, "nan"),
        ("loss_scaling", "yes", "'yes'"),
        ("loss_scaling", 1, "1"),
    ],
)
def test_invalid_field_value(field, value, shown):
    kwargs = {field: value}
    if field == "loss_scale":
        kwargs["param_dtype"] = torch.float16  # so only the value itself is wrong
    message = _raises([f"ZeroConfig.{field}", shown], **kwargs)
    assert "must be" in message


def test_stage_message_lists_allowed_values():
    assert _raises(["stage"], stage=5) == "ZeroConfig.stage must be one of 0, 1, 2, 3; got 5"


# --------------------------------------------------------------------- cross-field validation


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_params_requires_stage3(stage):
    _raises(["offload_params", "stage", f"stage={stage}"], stage=stage, offload_params=True)


def test_offload_params_with_stage3_needs_nothing_else():
    assert ZeroConfig(stage=3, offload_params=True).offload_params


def test_unit_classes_and_policy_are_exclusive():
    _raises(["unit_classes", "unit_policy", "GPT2Block", "_policy"], unit_classes=["GPT2Block"], unit_policy=_policy)


@pytest.mark.parametrize("param_dtype", [None, "bf16", "fp32"])
def test_fixed_loss_scale_requires_fp16(param_dtype):
    _raises(["loss_scale", "128", "param_dtype"], loss_scale=128, param_dtype=param_dtype)


def test_fixed_loss_scale_with_fp16_is_allowed():
    assert ZeroConfig(loss_scale=1024.0, param_dtype="fp16").loss_scale == 1024.0


@pytest.mark.parametrize(
    "param_dtype, loss_scaling, scales",
    [
        (None, None, False),
        ("bf16", None, False),
        ("fp16", None, True),  # default: exactly fp16 parameters
        (None, True, True),
        ("fp32", True, True),
        ("fp16", False, False),  # explicit: whatever the parameters
    ],
)
def test_loss_scaling_switch(param_dtype, loss_scaling, scales):
    assert ZeroConfig(param_dtype=param_dtype, loss_scaling=loss_scaling).scales_loss is scales


def test_fixed_loss_scale_with_fp32_parameters_and_loss_scaling_is_allowed():
    assert ZeroConfig(loss_scale=1024.0, loss_scaling=True).loss_scale == 1024.0


def test_fixed_loss_scale_with_loss_scaling_off_is_refused():
    _raises(["loss_scale", "128", "loss_scaling=False"], loss_scale=128, param_dtype="fp16", loss_scaling=False)


def test_loss_scaling_from_text():
    assert ZeroConfig.from_dict({"loss_scaling": "true"}).loss_scaling is True
    assert ZeroConfig.from_dict({"loss_scaling": "none"}).loss_scaling is None


def test_reduce_dtype_without_param_dtype_is_allowed():
    assert ZeroConfig(reduce_dtype="fp32").reduce_dtype is torch.float32


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_knobs_are_harmless_below_stage3(stage):
    config = ZeroConfig(
        stage=stage, prefetch_depth=4, persistence_threshold=1000, reshard_after_forward=False, unit_classes=[Block]
    )
    assert config.replace(stage=3).prefetch_depth == 4


# --------------------------------------------------------------------- frozen, replace, fingerprint


def test_frozen():
    config = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3
    with pytest.raises((AttributeError, TypeError)):
        config.not_a_field = 1


def test_keyword_only():
    with pytest.raises(TypeError):
        ZeroConfig(3)


def test_replace_revalidates_and_copies():
    config = ZeroConfig()
    assert config.replace(stage=3).stage == 3 and config.stage == 2
    with pytest.raises(ValueError, match="stage"):
        config.replace(stage=7)
    with pytest.raises(ValueError, match="offload_params"):
        config.replace(offload_params=True)
    with pytest.raises(ValueError, match="did you mean 'stage'"):
        config.replace(stag=3)


def test_fingerprint():
    assert ZeroConfig(stage=3).fingerprint() == ZeroConfig(stage=3).fingerprint()
    assert ZeroConfig(stage=3).fingerprint() != ZeroConfig(stage=2).fingerprint()
    assert ZeroConfig(param_dtype="bf16").fingerprint() == ZeroConfig(param_dtype=torch.bfloat16).fingerprint()
    assert len(ZeroConfig().fingerprint()) == 64


def test_hashable_and_picklable():
    config = ZeroConfig(stage=3, param_dtype="bf16", unit_classes=[Block])
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config) == hash(ZeroConfig(stage=3, param_dtype=torch.bfloat16, unit_classes=(Block,)))


# --------------------------------------------------------------------- shard_group_size (hierarchical sharding)


@pytest.mark.parametrize("value, expected", [(None, None), (2, 2), (1, 1), ("node", "node"), (" NODE ", "node")])
def test_shard_group_size_normalises(value, expected):
    assert ZeroConfig(shard_group_size=value).shard_group_size == expected


@pytest.mark.parametrize("value", [0, -2, 2.0, True, "nodes", "2"])
def test_shard_group_size_invalid(value):
    with pytest.raises(ValueError, match=r"ZeroConfig\.shard_group_size must be None, \"node\" or an int >= 1"):
        ZeroConfig(shard_group_size=value)


def test_shard_group_size_from_text_and_env():
    assert ZeroConfig.from_dict({"shard_group_size": "4"}).shard_group_size == 4
    assert ZeroConfig.from_dict({"shard_group_size": "none"}).shard_group_size is None
    assert ZeroConfig.from_env({"ZERO_PLUGIN_SHARD_GROUP_SIZE": "node"}).shard_group_size == "node"
    with pytest.raises(ValueError, match="shard_group_size"):
        ZeroConfig.from_dict({"shard_group_size": "two"})


def test_resolved_shard_group_size():
    assert ZeroConfig().resolved_shard_group_size(4) is None
    assert ZeroConfig(shard_group_size=2).resolved_shard_group_size(4) == 2
    assert ZeroConfig(shard_group_size=4).resolved_shard_group_size(4) is None  # the whole world: default path
    assert ZeroConfig(stage=0, shard_group_size=2).resolved_shard_group_size(4) is None  # stage 0 ignores it
    assert ZeroConfig(shard_group_size="node").resolved_shard_group_size(1, {}) is None  # no launcher, one rank
    node = ZeroConfig(stage=3, shard_group_size="node")
    assert node.resolved_shard_group_size(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    with pytest.raises(ValueError, match="must divide the world size 4; got 3"):
        ZeroConfig(shard_group_size=3).resolved_shard_group_size(4)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3"):
        node.resolved_shard_group_size(8, {"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="reads LOCAL_WORLD_SIZE"):
        node.resolved_shard_group_size(8, {})


def test_constructor_does_not_resolve_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ZeroConfig(shard_group_size="node").shard_group_size == "node"  # resolved at setup only


def test_accumulate_full_grads_field():
    """Stage-3 accumulation mode ([Note: deferred reduction]): a bool, default off, parsed from text."""
    assert ZeroConfig().accumulate_full_grads is False
    assert ZeroConfig.from_dict({"stage": "3", "accumulate_full_grads": "on"}).accumulate_full_grads is True
    assert ZeroConfig.from_env({"ZERO_PLUGIN_ACCUMULATE_FULL_GRADS": "1"}).accumulate_full_grads is True
    assert ZeroConfig(stage=1, accumulate_full_grads=True).accumulate_full_grads  # accepted, ignored below 3
    with pytest.raises(ValueError, match=r"ZeroConfig.accumulate_full_grads must be a bool.*got 'maybe'"):
        ZeroConfig(accumulate_full_grads="maybe")
    with pytest.raises(ValueError, match="accumulate_full_grads"):
        ZeroConfig.from_dict({"accumulate_full_grads": "maybe"})
