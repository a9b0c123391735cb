"""The DeepSpeed translator (``zero_plugin/config_deepspeed.py``, issue 53), in one process: the table and its page,
the transformers docs' ZeRO-2 / ZeRO-3 configurations with the Trainer's ``"auto"`` values, refusals naming the
key, the one warning for unknown keys, DeepSpeed's schedules step for step, and ``zero-plugin config
--from-deepspeed`` round-tripping.  The launch doors are in ``tests/integrations/test_deepspeed_doors.py``."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from zero_plugin import ZeroConfig
from zero_plugin.config_deepspeed import TABLE, ScheduleSpec, markdown_table, translate
from zero_plugin.config_groups import FLAT_NAMES

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "deepspeed_configs"
ZERO2, ZERO3 = CONFIGS / "ds_config_zero2.json", CONFIGS / "ds_config_zero3.json"
# What transformers' trainer_config_process fills in for TrainingArguments(per_device_train_batch_size=4,
# gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.01) at world size 2.
TRAINER_AUTOS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": 16,
    "gradient_clipping": 1.0,
    "optimizer": {"params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"params": {"warmup_max_lr": 1e-3}},
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


# -- the table and its page ---------------------------------------------------------------------------
PAGE = REPO / "docs" / "deepspeed.md"
_BEGIN, _END = "<!-- generated: zero_plugin.config_deepspeed.markdown_table() -->\n", "<!-- end generated -->"


def _page_parts() -> tuple[str, str, str]:
    page = PAGE.read_text()
    start, end = page.index(_BEGIN) + len(_BEGIN), page.index(_END)
    return page[:start], page[start:end], page[end:]


def test_docs_page_lists_the_translator_table():
    assert _page_parts()[1] == markdown_table(), (
        "docs/deepspeed.md's table differs from the translator's: `python -m tests.unit.test_config_deepspeed` "
        "rewrites it"
    )


def test_table_rows_are_unique_and_name_real_fields():
    keys = [row.key for row in TABLE]
    assert len(keys) == len(set(keys))
    for row in TABLE:
        assert row.action in ("mapped", "ignored", "refused", "mapped/refused", "ignored/refused"), row
        assert (row.rule is None) == (row.action == "ignored"), row.key
        if row.action.startswith("mapped"):
            named = [n for n in re.findall(r"`([a-z_0-9]+)", row.doc) if n in FLAT_NAMES or n == "stage"]
            assert (
                named
                or row.key.split(".")[0] in ("optimizer", "scheduler")
                or "batch" in row.doc
                or "older" in row.doc
                or "accumulation" in row.doc
            ), row.key
    required = [
        "zero_optimization.stage", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
        "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients", "gradient_clipping",
        "bf16.enabled", "fp16.enabled", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.min_loss_scale",
        "fp16.hysteresis", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size",
        "zero3_init_flag", "optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params",
        "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "pipeline", "moe",
    ]  # fmt: skip
    assert not set(required) - set(keys)


# -- the transformers docs' configurations ------------------------------------------------------------
def test_docs_zero2_and_zero3_with_the_trainers_autos():
    t2 = translate(ZERO2, resolved=TRAINER_AUTOS, world_size=2)
    assert ZeroConfig.from_dict(t2.settings) == ZeroConfig(
        stage=2, offload_optimizer="cpu", clip_grad_norm=1.0, bucket_size_mb=2e8 * 4 / 2**20
    )
    t3 = translate(ZERO3, resolved=TRAINER_AUTOS, world_size=2)
    assert ZeroConfig.from_dict(t3.settings) == ZeroConfig(
        stage=3, offload_optimizer="cpu", offload_params=True, clip_grad_norm=1.0
    )
    for t in (t2, t3):
        assert t.optimizer.name == "AdamW"
        assert t.optimizer.params == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
        assert t.schedule.name == "WarmupLR" and t.schedule.params["warmup_max_lr"] == 1e-3
        assert t.batch == {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        }
        assert not t.unknown
        ignored = dict(t.ignored)
        assert "always on" in ignored["zero_optimization.overlap_comm"]
        assert ignored["fp16.hysteresis"] == "fp16 is off"  # refused only when fp16 is on
    assert dict(t3.ignored)["zero_optimization.reduce_bucket_size"] == "auto: zero_plugin's default"
    # The public entry point: the same config.
    assert ZeroConfig.from_deepspeed(ZERO3, world_size=2, **TRAINER_AUTOS) == ZeroConfig.from_dict(t3.settings)


def test_precision_and_zero_plus_plus_keys():
    ds = {
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                              "zero_quantized_gradients": True, "stage3_param_persistence_threshold": 1000},
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
    }  # fmt: skip
    config = ZeroConfig.from_deepspeed(ds)
    assert (config.stage, config.param_dtype, config.reduce_dtype) == (3, torch.bfloat16, torch.float32)
    assert (config.secondary_shard_size, config.quantized_weights, config.quantized_gradients) == (2, True, True)
    assert config.persistence_threshold == 1000
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                     "hysteresis": 1, "min_loss_scale": 1}}  # fmt: skip
    config = ZeroConfig.from_deepspeed(fp16)
    assert (config.param_dtype, config.loss_scale, config.loss_scale_init) == (torch.float16, "dynamic", 4096.0)
    assert config.loss_scale_growth_interval == 500 and config.scales_loss
    assert ZeroConfig.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scale == 128.0
    assert ZeroConfig.from_deepspeed({"gradient_clipping": 0}).clip_grad_norm is None
    assert ZeroConfig.from_deepspeed({"zero3_init_flag": False}).lazy_loading is False


# -- refusals name the key and the fix -----------------------------------------------------------------
@pytest.mark.parametrize(
    "ds, named",
    [
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param.device=\"nvme\""),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "set device to 'cpu'"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
         "train_batch_size=32 is not train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=2 x world size 2"),
        ({"fp16": {"enabled": True, "hysteresis": 2}}, "fp16.hysteresis=2"),
        ({"pipeline": {"stages": 2}}, "pipeline={...}: zero_plugin is data parallel only"),
        ({"moe": {"enabled": True}}, "moe={...}"),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type=\"Lamb\""),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type=\"OneCycle\""),
        ({"gradient_clipping": "auto"}, "gradient_clipping='auto'"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled=true"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param.device -> offload_params"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(ds, named):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed(ds, world_size=2)
    assert named in str(info.value), str(info.value)


def test_every_refused_key_in_one_error():
    with pytest.raises(ValueError) as info:
        translate({"zero_optimization": {"stage": 5, "offload_optimizer": {"device": "nvme"}}, "moe": {}})
    message = str(info.value)
    assert "zero_optimization.stage=5" in message and "offload_optimizer.device" in message and "moe=" in message


def test_a_resolved_value_that_disagrees_with_the_file_is_refused():
    with pytest.raises(ValueError, match=r"gradient_clipping=0.5 vs the run's 1.0"):
        translate({"gradient_clipping": 0.5}, resolved={"gradient_clipping": 1.0})
    # As transformers' fill_only: warmup_min_lr is never compared; absent keys stay absent.
    t = translate({"zero_optimization": {"stage": 1}}, resolved=TRAINER_AUTOS)
    assert t.optimizer is None and t.settings == {"stage": 1}


def test_a_configuration_without_a_stage_is_deepspeeds_stage_0():
    from zero_plugin.integrations.deepspeed_config import merged_config

    t = translate({"gradient_clipping": 1.0})
    assert t.settings == {"stage": 0, "clip_grad_norm": 1.0} and t.defaulted == ("stage",)
    assert "default: zero_optimization.stage (absent: DeepSpeed's default 0)" in t.report()
    # zero_plugin's own --stage then decides, no conflict; a stage the file gives must agree.
    assert merged_config(t, {"stage": ("3", "--stage 3")}).stage == 3
    with pytest.raises(ValueError, match="disagree"):
        merged_config(translate({"zero_optimization": {"stage": 2}}), {"stage": ("3", "--stage 3")})


def test_unknown_keys_warn_once_naming_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = translate({"zero_optimization": {"stage": 2, "stage4_magic": 1}, "my_key": True})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "zero_optimization.stage4_magic, my_key" in messages[0]
    assert t.unknown == ("zero_optimization.stage4_magic", "my_key")


# -- DeepSpeed's schedules, step for step --------------------------------------------------------------
def _deepspeed_rate(name: str, params: dict, iteration: int, base: float) -> float:
    """DeepSpeed's documented formulas (deepspeed/runtime/lr_schedules.py), written out once more for the check."""
    if iteration < 0:
        return params.get("warmup_min_lr", 0.0) if name != "WarmupCosineLR" else 0.0
    w = max(2, params["warmup_num_steps"])
    if iteration < w:
        gamma = math.log(iteration + 1) / math.log(w) if params.get("warmup_type", "log") == "log" else iteration / w
    elif name == "WarmupDecayLR":
        gamma = max(0.0, (params["total_num_steps"] - iteration) / max(1.0, params["total_num_steps"] - w))
    else:
        gamma = 1.0
    if name == "WarmupCosineLR":
        if iteration < w:
            return base * gamma
        progress = min(1.0, (iteration - w + 1) / max(1, params["total_num_steps"] - w))
        floor = params.get("cos_min_ratio", 1e-4)
        return base * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    low, high = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", base)
    return low + (high - low) * gamma


@pytest.mark.parametrize(
    "name, params",
    [
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}),
        ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3, "total_num_steps": 10}),
        ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 10, "warmup_type": "linear"}),
    ],
)
def test_schedules_give_deepspeeds_rates(name, params):
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    scheduler = ScheduleSpec(name, params).build(optimizer)
    for step in range(12):  # optimizer step s runs at DeepSpeed's iteration s - 1 (its rate set at construction)
        want = _deepspeed_rate(name, params, step - 1, 1e-3)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), step
        optimizer.step()
        scheduler.step()


def test_schedule_autos_filled_as_the_trainer_fills_them():
    spec = ScheduleSpec("WarmupDecayLR", {"warmup_min_lr": "auto", "warmup_max_lr": 1e-3, "warmup_num_steps": "auto",
                                          "total_num_steps": "auto"})  # fmt: skip
    assert spec.resolved(total_num_steps=20, warmup_steps=0, lr=1e-3).params == {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1, "total_num_steps": 20,
    }  # fmt: skip


# -- zero-plugin config --from-deepspeed -----------------------------------------------------------------
def test_cli_prints_yaml_that_round_trips(tmp_path, capsys):
    from zero_plugin.launch.cli import main

    ds = _load(ZERO3)
    ds["zero_optimization"]["zero_quantized_weights"] = True
    ds["communication_data_type"] = "bf16"
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(ds))
    autos = ["--auto", "gradient_clipping=0.5", "--auto", "fp16.enabled=false", "--auto", "bf16.enabled=true"]
    assert main(["config", "--from-deepspeed", str(src), *autos, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "# optimizer: torch.optim.AdamW" in out and "# scheduler: DeepSpeed's WarmupLR" in out
    (tmp_path / "zero.yaml").write_text(out)
    want = ZeroConfig.from_deepspeed(src, gradient_clipping=0.5, fp16={"enabled": False}, bf16={"enabled": True})
    assert ZeroConfig.from_file(tmp_path / "zero.yaml") == want
    assert (want.stage, want.param_dtype, want.clip_grad_norm, want.quantized_weights) == (3, torch.bfloat16, 0.5, True)
    # A refused key: exit 2 and the key named.
    assert main(["config", "--from-deepspeed", str(ZERO3)]) == 2
    assert "gradient_clipping='auto'" in capsys.readouterr().err


if __name__ == "__main__":  # rewrite docs/deepspeed.md's table from the translator's
    head, _, tail = _page_parts()
    PAGE.write_text(head + markdown_table() + tail)
