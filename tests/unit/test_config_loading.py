"""Unit tests for zero_plugin.config.ZeroConfig's serialisation and loading: to_dict / from_dict, from_file
(YAML / JSON) and from_env.  Construction and validation are in test_config.py."""

import json

import pytest
import torch
import yaml

from zero_plugin.config import ZeroConfig


def _policy(module, name):
    return isinstance(module, torch.nn.Linear)


class Block(torch.nn.Module):
    pass


# --------------------------------------------------------------------- to_dict / from_dict


def test_to_dict_is_json_and_yaml_safe():
    config = ZeroConfig(stage=3, param_dtype="bf16", unit_classes=[Block, "GPT2Block"])
    data = config.to_dict()
    assert data["param_dtype"] == "bf16" and data["master_dtype"] == "fp32"
    assert data["unit_classes"] == [f"{__name__}.Block", "GPT2Block"]
    assert json.loads(json.dumps(data)) == data
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_round_trip():
    config = ZeroConfig(
        stage=3,
        offload_optimizer="cpu",
        offload_params=True,
        param_dtype="fp16",
        reduce_dtype="fp32",
        master_dtype="fp64",
        bucket_size_mb=12.5,
        prefetch_depth=2,
        persistence_threshold=100,
        reshard_after_forward=False,
        unit_policy=_policy,
        clip_grad_norm=1.0,
        loss_scale=256.0,
        debug_collectives=True,
        timeout_s=30.0,
        check_ranks=False,
        trim_host_heap=False,
        loss_scaling=True,
        loss_scale_init=1024.0,
        loss_scale_growth_interval=10,
    )
    assert config.to_dict()["unit_policy"] == f"{__name__}._policy"
    assert ZeroConfig.from_dict(config.to_dict()) == config


def test_round_trip_keeps_class_names_as_strings():
    config = ZeroConfig(stage=3, unit_classes=[Block])
    again = ZeroConfig.from_dict(config.to_dict())
    assert again.unit_classes == (f"{__name__}.Block",)
    assert again.fingerprint() == config.fingerprint()


def test_from_dict_parses_strings():
    config = ZeroConfig.from_dict(
        {
            "stage": "3",
            "offload_optimizer": "true",
            "offload_params": "True",
            "param_dtype": "bf16",
            "reduce_dtype": "none",
            "bucket_size_mb": "25",
            "prefetch_depth": "2",
            "reshard_after_forward": "false",
            "unit_classes": "LlamaDecoderLayer, GPT2Block",
            "clip_grad_norm": "0.5",
            "timeout_s": "60",
            "debug_collectives": "yes",
            "check_ranks": "0",
            "unit_policy": "null",
            "loss_scale": "dynamic",
            "trim_host_heap": "off",
        }
    )
    assert config.stage == 3 and config.offload and config.offload_params
    assert config.param_dtype is torch.bfloat16 and config.reduce_dtype is None
    assert config.bucket_size_mb == 25.0 and config.prefetch_depth == 2 and not config.reshard_after_forward
    assert config.unit_classes == ("LlamaDecoderLayer", "GPT2Block")
    assert config.clip_grad_norm == 0.5 and config.timeout_s == 60.0
    assert config.debug_collectives and not config.check_ranks and not config.trim_host_heap


@pytest.mark.parametrize(
    "field, text",
    [
        ("stage", "three"),
        ("check_ranks", "maybe"),
        ("bucket_size_mb", "big"),
        ("unit_policy", "no.such.module_fn"),
        ("loss_scale", "static"),
    ],
)
def test_from_dict_bad_string(field, text):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_dict({field: text})
    assert f"ZeroConfig.{field}" in str(info.value) and repr(text) in str(info.value)


def test_from_dict_unknown_key_suggests_close_match():
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_dict({"stag": 3, "zzz": 1})
    message = str(info.value)
    assert "'stag' (did you mean 'stage'?)" in message and "'zzz'" in message
    assert "prefetch_depth" in message  # the allowed names are listed


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ValueError, match="mapping"):
        ZeroConfig.from_dict([("stage", 3)])


# --------------------------------------------------------------------- from_file


@pytest.mark.parametrize(
    "name, text",
    [
        ("c.yaml", "stage: 3\noffload_optimizer: cpu\nparam_dtype: bf16\n"),
        ("c.yml", "zero_plugin:\n  stage: 3\n  offload_optimizer: true\n  param_dtype: bf16\nother_tool:\n  x: 1\n"),
        ("c.json", '{"stage": 3, "offload_optimizer": "cpu", "param_dtype": "bf16"}'),
        ("n.json", '{"zero_plugin": {"stage": "3", "offload_optimizer": "cpu", "param_dtype": "bfloat16"}}'),
    ],
)
def test_from_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert ZeroConfig.from_file(path) == ZeroConfig(stage=3, offload_optimizer="cpu", param_dtype="bf16")
    assert ZeroConfig.from_file(str(path)).stage == 3


def test_from_file_empty_yaml_gives_defaults(tmp_path):
    (tmp_path / "e.yaml").write_text("")
    assert ZeroConfig.from_file(tmp_path / "e.yaml") == ZeroConfig()


def test_from_file_missing(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        ZeroConfig.from_file(path)


@pytest.mark.parametrize("name, text", [("bad.yaml", "stage: [3\n"), ("bad.json", "{stage: 3"), ("list.yaml", "- 3\n")])
def test_from_file_bad_content(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=name):
        ZeroConfig.from_file(tmp_path / name)


def test_from_file_wrong_extension(tmp_path):
    (tmp_path / "c.toml").write_text("stage = 3\n")
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.json"):
        ZeroConfig.from_file(tmp_path / "c.toml")


def test_from_file_invalid_value_names_path_and_field(tmp_path):
    (tmp_path / "c.yaml").write_text("stage: 7\n")
    with pytest.raises(ValueError, match=r"c\.yaml.*ZeroConfig\.stage.*7"):
        ZeroConfig.from_file(tmp_path / "c.yaml")


# --------------------------------------------------------------------- from_env


def test_from_env_empty_gives_defaults():
    assert ZeroConfig.from_env({}) == ZeroConfig()
    assert ZeroConfig.from_env({"ZERO_PLUGIN_STAGE": "", "UNRELATED": "x"}) == ZeroConfig()


def test_from_env_stage():
    assert ZeroConfig.from_env({"ZERO_PLUGIN_STAGE": "3"}).stage == 3


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cpu", "cpu"),
        ("none", "none"),
        ("1", "cpu"),
        ("0", "none"),
        ("true", "cpu"),
        ("false", "none"),
    ],
)
def test_from_env_offload(text, expected):
    assert ZeroConfig.from_env({"ZERO_PLUGIN_OFFLOAD": text}).offload_optimizer == expected


def test_from_env_config_file_then_overrides(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("stage: 1\nbucket_size_mb: 10\nparam_dtype: fp16\n")
    config = ZeroConfig.from_env({"ZERO_PLUGIN_CONFIG": str(path), "ZERO_PLUGIN_STAGE": "3"})
    assert config.stage == 3 and config.bucket_size_mb == 10.0 and config.param_dtype is torch.float16


def test_from_env_generic_fields():
    config = ZeroConfig.from_env(
        {
            "ZERO_PLUGIN_PARAM_DTYPE": "bf16",
            "ZERO_PLUGIN_BUCKET_SIZE_MB": "50",
            "ZERO_PLUGIN_UNIT_CLASSES": "GPT2Block",
            "ZERO_PLUGIN_LAUNCHER_ONLY": "x",
            "ZERO_PLUGIN_stage": "3",
        }
    )
    assert config.param_dtype is torch.bfloat16 and config.bucket_size_mb == 50.0
    assert config.unit_classes == ("GPT2Block",) and config.stage == 2  # lower-case names are not fields


@pytest.mark.parametrize(
    "environ, var",
    [
        ({"ZERO_PLUGIN_STAGE": "9"}, "ZERO_PLUGIN_STAGE"),
        ({"ZERO_PLUGIN_STAGE": "abc"}, "ZERO_PLUGIN_STAGE"),
        ({"ZERO_PLUGIN_OFFLOAD": "gpu"}, "ZERO_PLUGIN_OFFLOAD"),
        ({"ZERO_PLUGIN_TIMEOUT_S": "-1"}, "ZERO_PLUGIN_TIMEOUT_S"),
        ({"ZERO_PLUGIN_OFFLOAD": "cpu", "ZERO_PLUGIN_OFFLOAD_OPTIMIZER": "none"}, "ZERO_PLUGIN_OFFLOAD_OPTIMIZER"),
    ],
)
def test_from_env_bad_value_names_variable(environ, var):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_env(environ)
    assert var in str(info.value) and repr(environ[var]) in str(info.value)


def test_from_env_missing_config_file_names_variable(tmp_path):
    with pytest.raises(FileNotFoundError, match="ZERO_PLUGIN_CONFIG.*nope.yaml"):
        ZeroConfig.from_env({"ZERO_PLUGIN_CONFIG": str(tmp_path / "nope.yaml")})


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("ZERO_PLUGIN_STAGE", "1")
    assert ZeroConfig.from_env().stage == 1
