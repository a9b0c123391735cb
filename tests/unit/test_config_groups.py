"""Unit tests for ZeroConfig's groups (zero_plugin/config_groups.py): grouped and flat spellings build the same
config (equal, same hash and fingerprint), nested dicts / files / the environment round-trip, a setting given both
ways must agree, and unknown group fields are refused naming the valid ones.  No process group."""

import copy
import dataclasses
import json
import pickle

import pytest
import torch
import yaml

import zero_plugin as zp
from zero_plugin.config import ZeroConfig
from zero_plugin.config_groups import FLAT_NAMES, GROUPS

GROUP_CLASSES = {
    "offload": zp.OffloadConfig,
    "precision": zp.PrecisionConfig,
    "comm": zp.CommConfig,
    "stage3": zp.Stage3Config,
    "loading": zp.LoadingConfig,
    "debug": zp.DebugConfig,
}


class Block(torch.nn.Module):
    pass


def _policy(module, name):
    return isinstance(module, Block)


GROUPED = dict(
    stage=3,
    offload=zp.OffloadConfig(optimizer="cpu", params=True),
    precision=zp.PrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype="fp32", clip_grad_norm=1.0),
    comm=zp.CommConfig(bucket_size_mb=5, timeout_s=30, quantized_weights=True, secondary_shard_size="node"),
    stage3=zp.Stage3Config(prefetch_depth=2, unit_classes=[Block, "GPT2Block"], accumulate_full_grads=True),
    loading=zp.LoadingConfig(lazy=False, cpu_ram_efficient=True),
    debug=zp.DebugConfig(collectives=True, check_ranks=False),
)
FLAT = dict(
    stage=3,
    offload_optimizer=True,
    offload_params=True,
    param_dtype="bf16",
    reduce_dtype=torch.float32,
    clip_grad_norm=1,
    bucket_size_mb=5.0,
    timeout_s=30.0,
    quantized_weights=True,
    secondary_shard_size="NODE",
    prefetch_depth=2,
    unit_classes=(Block, "GPT2Block"),
    accumulate_full_grads=True,
    lazy_loading=False,
    cpu_ram_efficient_loading=True,
    debug_collectives=True,
    check_ranks=False,
)


# --------------------------------------------------------------------- the public names and the flat names


def test_groups_are_exported():
    for cls in GROUP_CLASSES.values():
        assert cls.__name__ in zp.__all__ and getattr(zp, cls.__name__) is cls
    assert GROUPS == GROUP_CLASSES
    assert [f.name for f in dataclasses.fields(ZeroConfig)] == ["stage", *GROUPS]


def test_every_flat_name_reads_its_group_field():
    config = ZeroConfig(**GROUPED)
    for flat, (key, field) in FLAT_NAMES.items():
        assert getattr(config, flat) == getattr(getattr(config, key), field.name), flat
    assert config.offload_optimizer == "cpu" and config.debug_collectives and not config.lazy_loading


def test_flat_names_are_the_fields_of_before():
    """The 31 names existing code, saved configs and ZERO_PLUGIN_* variables use, optimizer_partition (#48),
    sequence_parallel_size and offload_activations (#50)."""
    assert set(ZeroConfig().to_dict()) == {"stage", *FLAT_NAMES}
    new = {"optimizer_partition", "sequence_parallel_size", "offload_activations"}
    assert len(FLAT_NAMES) == 34 and new <= FLAT_NAMES.keys()


def test_flat_names_are_declared_for_type_checkers():
    """config.py's ``if TYPE_CHECKING:`` block names every flat name with its field's type, so an IDE or mypy sees
    ``cfg.offload_optimizer``; a new setting without its line there fails here."""
    import ast
    import inspect

    import zero_plugin.config as module

    tree = ast.parse(inspect.getsource(module))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroConfig"]
    (block,) = [n for n in cls.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    declared = {n.target.id: ast.unparse(n.annotation) for n in block.body if isinstance(n, ast.AnnAssign)}
    assert declared == {flat: field.type for flat, (_, field) in FLAT_NAMES.items()}


def test_the_package_reads_the_groups():
    """Inside zero_plugin a ZeroConfig is read by its groups (``cfg.offload.optimizer``); the flat names are the
    public compatibility surface only.  A flat read of a config object outside the config modules fails here."""
    import pathlib
    import re

    package = pathlib.Path(zp.__file__).parent
    names = "|".join(sorted(FLAT_NAMES, key=len, reverse=True))
    read = re.compile(
        rf"(?<![\w.])((?:self\.|plan\.|engine\.|s\.)*_?(?:config|cfg|zero_config))\.({names})\b(?!\s*=[^=])"
    )
    found = [
        f"{path.relative_to(package)}:{n}: {m.group(0)}"
        for path in sorted(package.rglob("*.py"))
        if not path.name.startswith("config")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in read.finditer(line)
    ]
    assert not found, "read the group instead (FLAT_NAMES maps each flat name to its group field):\n" + "\n".join(found)


# --------------------------------------------------------------------- grouped == flat


def test_grouped_equals_flat():
    grouped, flat = ZeroConfig(**GROUPED), ZeroConfig(**FLAT)
    assert grouped == flat
    assert hash(grouped) == hash(flat)
    assert grouped.fingerprint() == flat.fingerprint()
    assert grouped.to_dict() == flat.to_dict()


def test_brief_example():
    config = ZeroConfig(
        stage=3, offload=zp.OffloadConfig(optimizer="cpu"), precision=zp.PrecisionConfig(param_dtype=torch.bfloat16)
    )
    assert config == ZeroConfig(stage=3, offload_optimizer="cpu", param_dtype="bf16")
    assert config.offload.optimizer == "cpu" and config.precision.param_dtype is torch.bfloat16


def test_mixed_spellings_and_mappings():
    mixed = ZeroConfig(
        stage=3,
        offload={"optimizer": "cpu"},
        offload_params=True,  # another field of the same group, given flat beside a mapping
        precision=zp.PrecisionConfig(param_dtype="bf16", reduce_dtype="fp32", clip_grad_norm=1.0),
        comm={"bucket_size_mb": 5, "timeout_s": 30},
        quantized_weights=True,
        secondary_shard_size="node",
        stage3=zp.Stage3Config(prefetch_depth=2, unit_classes=[Block, "GPT2Block"], accumulate_full_grads=True),
        loading={"lazy": False, "cpu_ram_efficient": True},
        debug_collectives=True,
        check_ranks=False,
    )
    assert mixed == ZeroConfig(**FLAT)


def test_same_value_both_ways_is_accepted():
    config = ZeroConfig(offload=zp.OffloadConfig(optimizer="cpu"), offload_optimizer=True)
    assert config.offload_optimizer == "cpu"
    assert ZeroConfig(precision={"param_dtype": "bf16"}, param_dtype=torch.bfloat16).param_dtype is torch.bfloat16


def test_group_records_normalise_and_compare():
    assert zp.PrecisionConfig(param_dtype="bfloat16") == zp.PrecisionConfig(param_dtype=torch.bfloat16)
    assert zp.Stage3Config(unit_classes=["A", "B"]).unit_classes == ("A", "B")
    assert hash(zp.CommConfig(bucket_size_mb=5)) == hash(zp.CommConfig(bucket_size_mb=5.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        zp.CommConfig().timeout_s = 1.0


def test_group_value_errors_name_both_spellings():
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_optimizer \(offload\.optimizer\) must be .*'gpu'"):
        zp.OffloadConfig(optimizer="gpu")
    with pytest.raises(ValueError, match=r"ZeroConfig\.prefetch_depth must be an int in \[0, 8\]; got 9"):
        zp.Stage3Config(prefetch_depth=9)


def test_offload_group_is_truthy_when_the_optimizer_is_offloaded():
    """``if config.offload:`` keeps meaning what it did when ``offload`` was a bool property."""
    assert ZeroConfig(offload_optimizer="cpu").offload
    assert not ZeroConfig().offload
    assert not ZeroConfig(stage=3, offload_params=True).offload


def test_copies_keep_groups():
    config = ZeroConfig(**GROUPED)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    assert dataclasses.replace(config, offload={"optimizer": "none"}).offload == zp.OffloadConfig()


# --------------------------------------------------------------------- conflicts and unknown names


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (
            {"offload": zp.OffloadConfig(optimizer="cpu"), "offload_optimizer": "none"},
            ["offload.optimizer", "offload_optimizer"],
        ),
        ({"offload": {"optimizer": "cpu"}, "offload_optimizer": False}, ["offload.optimizer", "offload_optimizer"]),
        ({"precision": {"param_dtype": "bf16"}, "param_dtype": "fp16"}, ["precision.param_dtype", "param_dtype"]),
        (
            {"stage3": zp.Stage3Config(prefetch_depth=2), "prefetch_depth": 3},
            ["stage3.prefetch_depth", "prefetch_depth"],
        ),
        # a record holds every field of its group, defaults included
        (
            {"stage": 3, "offload": zp.OffloadConfig(optimizer="cpu"), "offload_params": True},
            ["offload.params", "offload_params"],
        ),
    ],
)
def test_conflicting_spellings_are_refused(kwargs, names):
    with pytest.raises(ValueError) as info:
        ZeroConfig(**kwargs)
    for name in names:
        assert name in str(info.value), str(info.value)
    assert "disagree" in str(info.value)


def test_conflict_in_a_dict_is_refused():
    with pytest.raises(ValueError, match=r"loading\.lazy=False .* lazy_loading=True disagree"):
        ZeroConfig.from_dict({"loading": {"lazy": "false"}, "lazy_loading": "true"})


@pytest.mark.parametrize(
    "build", [lambda d: ZeroConfig(**d), ZeroConfig.from_dict, lambda d: ZeroConfig().replace(**d)]
)
def test_unknown_group_field_names_the_valid_ones(build):
    with pytest.raises(ValueError) as info:
        build({"offload": {"optimzer": "cpu"}})
    message = str(info.value)
    assert "'optimzer' (did you mean 'optimizer'?)" in message and "allowed: optimizer, params" in message


def test_wrong_group_type_is_refused():
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload must be OffloadConfig\(\.\.\.\), a mapping"):
        ZeroConfig(offload=zp.PrecisionConfig())
    with pytest.raises(ValueError, match="optimizer, params"):
        ZeroConfig.from_dict({"offload": "cpu"})


def test_unknown_keyword_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="'prefetch_dept' \\(did you mean 'prefetch_depth'\\?\\)"):
        ZeroConfig(prefetch_dept=2)


# --------------------------------------------------------------------- replace


def test_replace_accepts_either_form():
    config = ZeroConfig(stage=3, prefetch_depth=4)
    assert config.replace(offload_optimizer="cpu").offload == zp.OffloadConfig(optimizer="cpu")
    assert config.replace(offload=zp.OffloadConfig(optimizer="cpu")) == config.replace(offload_optimizer="cpu")
    # a mapping updates the fields it names, the rest of the group is kept
    assert config.replace(stage3={"reshard_after_forward": False}).prefetch_depth == 4
    # a record replaces the whole group
    assert config.replace(stage3=zp.Stage3Config()).prefetch_depth == 1
    # flat names update the current group
    assert config.replace(reshard_after_forward=False).stage3 == zp.Stage3Config(
        prefetch_depth=4, reshard_after_forward=False
    )
    with pytest.raises(ValueError, match="disagree"):
        config.replace(stage3={"prefetch_depth": 2}, prefetch_depth=3)
    with pytest.raises(ValueError, match="offload_params=True requires ZeroConfig.stage=3"):
        ZeroConfig().replace(offload={"params": True})


# --------------------------------------------------------------------- dicts, files, environment


def test_to_dict_is_flat_and_grouped_on_request():
    config = ZeroConfig(**GROUPED)
    flat, grouped = config.to_dict(), config.to_dict(grouped=True)
    assert flat["offload_optimizer"] == "cpu" and flat["param_dtype"] == "bf16" and "offload" not in flat
    assert grouped["offload"] == {
        "optimizer": "cpu",
        "params": True,
        "optimizer_partition": "auto",
        "activations": "none",
    }
    assert grouped["loading"] == {"cpu_ram_efficient": True, "lazy": False}
    assert grouped["stage3"]["unit_classes"] == [f"{__name__}.Block", "GPT2Block"]
    assert set(grouped) == {"stage", *GROUPS}
    for data in (flat, grouped):
        assert json.loads(json.dumps(data)) == data and yaml.safe_load(yaml.safe_dump(data)) == data


@pytest.mark.parametrize("grouped", [False, True])
def test_dict_round_trip(grouped):
    config = ZeroConfig(**{**FLAT, "unit_classes": ("GPT2Block",), "unit_policy": None}).replace(
        unit_classes=(), unit_policy=_policy
    )
    again = ZeroConfig.from_dict(config.to_dict(grouped=grouped))
    assert again == config and again.fingerprint() == config.fingerprint()


def test_nested_dict_with_text_values():
    config = ZeroConfig.from_dict(
        {
            "stage": "3",
            "offload": {"optimizer": "true", "params": "yes"},
            "precision": {"param_dtype": "bf16", "clip_grad_norm": "none", "loss_scaling": "null"},
            "comm": {"shard_group_size": "2", "bucket_size_mb": "12.5"},
            "stage3": {"unit_classes": "A, B", "prefetch_depth": "2"},
            "debug": {"collectives": "on"},
            "lazy_loading": "off",
        }
    )
    assert config == ZeroConfig(
        stage=3,
        offload_optimizer="cpu",
        offload_params=True,
        param_dtype="bf16",
        shard_group_size=2,
        bucket_size_mb=12.5,
        unit_classes=("A", "B"),
        prefetch_depth=2,
        debug_collectives=True,
        lazy_loading=False,
    )


def test_nested_bad_text_names_the_field():
    with pytest.raises(ValueError, match=r"ZeroConfig\.debug_collectives \(debug\.collectives\) must be .*'maybe'"):
        ZeroConfig.from_dict({"debug": {"collectives": "maybe"}})


def test_empty_group_section_gives_defaults():
    assert ZeroConfig.from_dict({"offload": None, "stage3": {}}) == ZeroConfig()


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
zero_plugin:
  stage: 3
  offload:
    optimizer: cpu
  precision:
    param_dtype: bf16
  stage3:
    prefetch_depth: 2
    unit_classes: [GPT2Block]
  check_ranks: false
"""


def test_nested_accelerate_style_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_YAML)
    expected = ZeroConfig(
        stage=3,
        offload_optimizer="cpu",
        param_dtype="bf16",
        prefetch_depth=2,
        unit_classes=["GPT2Block"],
        check_ranks=False,
    )
    assert ZeroConfig.from_file(path) == expected
    assert ZeroConfig.from_env({"ZERO_PLUGIN_CONFIG": str(path)}) == expected


def test_file_round_trip(tmp_path):
    config = ZeroConfig(**FLAT).replace(unit_classes=("GPT2Block",))
    for grouped in (False, True):
        path = tmp_path / f"c{grouped}.yaml"
        path.write_text(yaml.safe_dump({"zero_plugin": config.to_dict(grouped=grouped)}))
        assert ZeroConfig.from_file(path) == config


def test_environment_overrides_a_nested_file(tmp_path):
    """A ZERO_PLUGIN_<FLAT_NAME> variable wins over the file however the file writes that setting."""
    path = tmp_path / "z.yaml"
    path.write_text("stage: 3\noffload:\n  optimizer: none\n  params: true\nstage3:\n  prefetch_depth: 2\n")
    env = {"ZERO_PLUGIN_CONFIG": str(path), "ZERO_PLUGIN_OFFLOAD": "cpu", "ZERO_PLUGIN_PREFETCH_DEPTH": "4"}
    config = ZeroConfig.from_env(env)
    assert config.offload == zp.OffloadConfig(optimizer="cpu", params=True)
    assert config.prefetch_depth == 4 and config.stage == 3


def test_environment_renamed_fields_keep_their_variables():
    env = {"ZERO_PLUGIN_DEBUG_COLLECTIVES": "1", "ZERO_PLUGIN_LAZY_LOADING": "false", "ZERO_PLUGIN_STAGE": "1"}
    config = ZeroConfig.from_env(env)
    assert config.debug.collectives and not config.loading.lazy and config.stage == 1
    assert ZeroConfig.from_env({"ZERO_PLUGIN_PRECISION": "x"}) == ZeroConfig()  # groups are not variables


# Digests of the flat ZeroConfig of before the groups (commit b2bbda8): a fingerprint is unchanged by grouping, so
# ranks, checkpoint metadata and the rank check keep agreeing with configs written either way.  A new field changes
# every digest; update these with it.
PINNED = {
    "default": "6a0ae08820fa526f99ab13db90138e8f8857e0c4232bb1faa655358e31a1570a",
    "stage3_offload_bf16": "144199d0ff110e92e3ca8535d8697451a78f33504b743aee68f29c37146c2277",
}


def test_fingerprint_unchanged_by_grouping():
    assert ZeroConfig().fingerprint() == PINNED["default"]
    assert ZeroConfig(**{key: {} for key in GROUPS}).fingerprint() == PINNED["default"]
    grouped = ZeroConfig(stage=3, offload={"optimizer": "cpu", "params": True}, precision={"param_dtype": "bf16"})
    flat = ZeroConfig(stage=3, offload_optimizer="cpu", offload_params=True, param_dtype=torch.bfloat16)
    assert grouped.fingerprint() == flat.fingerprint() == PINNED["stage3_offload_bf16"]
