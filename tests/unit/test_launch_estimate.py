"""``zero-plugin launch`` prints the planner's memory per rank before starting the processes
(zero_plugin/launch/estimate.py).  In process: the lines come from ``estimate_lines`` with an injected
``Machine``, and ``launch`` runs with Accelerate's launcher replaced, so nothing is started.

The numbers must be ``zero_plugin.planner``'s for the same model, setting and world size; the two rows
are a full fine-tune and a frozen base ([Note: two rows at launch]).
"""

from __future__ import annotations

import argparse
import re

import pytest

from tests.models import planner_llama_config as _tiny_config
from zero_plugin import planner as zpp
from zero_plugin.config import ZeroConfig
from zero_plugin.launch import estimate as le
from zero_plugin.launch import launcher

GIB = 2**30
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


@pytest.fixture
def model_dir(tmp_path):
    _tiny_config().save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def _bytes(text: str) -> list[float]:
    """Every size printed in ``text``, in bytes."""
    return [float(v) * _UNITS[u] for v, u in re.findall(r"([0-9.]+) (GiB|MiB|KiB|B)\b", text)]


def _frozen_planner(**kwargs):
    model = zpp.resolve_model(_tiny_config())
    for p in model.parameters():
        p.requires_grad_(p.ndim == 1)
    return zpp.Planner(model, **kwargs)


def _close(printed: float, exact: float) -> bool:
    return abs(printed - exact) <= 0.005 * max(exact, 1) + 0.5  # two decimals of the printed unit


def test_lines_equal_planner_estimate_for_local_config_folder(model_dir):
    lines = le.estimate_lines(
        ["--model", model_dir, "--max_steps", "2"], ZeroConfig(stage=3), 2, le.Machine(host_bytes=64 * GIB)
    )
    full = zpp.estimate(_tiny_config(), world_size=2, stage=3, device="cpu")
    frozen = _frozen_planner(device="cpu").estimate(2, 3)
    assert frozen["params"]["trainable"] == 64 * (2 * 2 + 1) and full["peak"]["total"] > frozen["peak"]["total"]
    assert len(lines) == 4  # header, full fine-tune, frozen base, this machine; no warning
    assert lines[0].startswith(
        f"zero-plugin launch: memory per rank planned for --model {model_dir} "
        f"({full['params']['total']:,} parameters, float32; "
    )
    assert "no activations" in lines[0]
    assert lines[1].startswith("  --stage 3, 2 ranks on cpu, full fine-tune")
    assert _close(_bytes(lines[1])[-1], full["peak"]["total"])
    assert "frozen base" in lines[2] and _close(_bytes(lines[2])[-1], frozen["peak"]["total"])
    assert lines[3] == (
        "  this machine: 64.00 GiB host memory available for 2 ranks (10% kept free); skip with --no_estimate"
    )


def test_gpu_machine_prints_device_and_host_with_activations(model_dir):
    args = ["--model", model_dir, "--batch_size", "2", "--max_length=16"]
    config = ZeroConfig(stage=2, offload_optimizer="cpu")
    lines = le.estimate_lines(args, config, 4, le.Machine(host_bytes=64 * GIB, gpu_bytes=80 * GIB), ranks_per_host=2)
    assert "activations of 2 x 16 tokens per rank" in lines[0]
    assert lines[1].startswith("  --stage 2 --offload cpu, 4 ranks on cuda, full fine-tune")
    full = zpp.estimate(_tiny_config(), world_size=4, stage=2, offload=True, batch=2, seq=16, device="cuda")
    device, host = _bytes(lines[1])
    assert _close(device, full["peak"]["device"]) and _close(host, full["peak"]["host"]) and host > 0
    assert "GPU 80.00 GiB per device, 64.00 GiB host memory available for 2 ranks" in lines[3]


def _flags(row: dict) -> str:
    return f"--stage {row['stage']}" + (" --offload cpu" if row["offload"] else "")


def test_warning_names_the_setting_that_fits_when_gpu_memory_is_short(model_dir):
    """Stage 3 on 2 GPUs too small for this tiny model's stage-3 peak even with a frozen base (two
    gathered blocks outweigh the sharded rest): the warning names what ``Planner.fit`` ranks first."""
    frozen = _frozen_planner(device="cuda")
    gpu = frozen.estimate(2, 3)["peak"]["device"]  # 10% kept free: over by 10%
    assert zpp.Planner(_tiny_config()).fit(2, gpu, 64 * GIB)["best"] is None  # no full fine-tune fits
    best = frozen.fit(2, gpu, 64 * GIB)["best"]
    assert best is not None and best["stage"] != 3
    lines = le.estimate_lines(
        ["--model", model_dir], ZeroConfig(stage=3), 2, le.Machine(host_bytes=64 * GIB, gpu_bytes=gpu)
    )
    assert len(lines) == 5
    assert lines[4].startswith(
        "zero-plugin launch: WARNING: --stage 3 will not fit this machine even with a "
        f"frozen base (GPU: {le._size(gpu)} per rank, {le._size(gpu)} per device); "
    )
    assert f"; {_flags(best)} fits a frozen base (device " in lines[4]


def test_note_names_a_full_fine_tune_setting_that_fits(model_dir):
    """Stage 0 on 2 GPUs with room for a frozen base but not for a full fine-tune replicated."""
    full = zpp.Planner(_tiny_config())
    gpu = full.estimate(2, 0)["peak"]["device"]
    best = full.fit(2, gpu, 64 * GIB)["best"]
    assert best is not None and best["stage"] != 0
    lines = le.estimate_lines(
        ["--model", model_dir], ZeroConfig(stage=0), 2, le.Machine(host_bytes=64 * GIB, gpu_bytes=gpu)
    )
    assert lines[4].startswith("zero-plugin launch: note: a full fine-tune at --stage 0 will not fit (GPU: ")
    assert lines[4].endswith(
        f"it fits only if the base model is frozen (LoRA / PEFT); {_flags(best)} fits a "
        f"full fine-tune (device {le._size(best['peak']['device'])}, host "
        f"{le._size(best['peak']['host'])} per rank)"
    )


def test_note_when_only_a_frozen_base_fits(model_dir):
    frozen3 = _frozen_planner(device="cpu").estimate(2, 3)["peak"]["total"]
    host = 2 * frozen3 / 0.9 * 1.01
    lines = le.estimate_lines(["--model", model_dir], ZeroConfig(stage=3), 2, le.Machine(host_bytes=host))
    assert lines[-1].startswith("zero-plugin launch: note: a full fine-tune at --stage 3 will not fit (host: ")
    assert (
        "it fits only if the base model is frozen (LoRA / PEFT); no setting fits a full fine-tune on 2 ranks"
        in lines[-1]
    )


@pytest.mark.parametrize(
    "script_args,expected",
    [
        (["--lr", "1"], None),
        (["--model", "a", "--x", "--model=b"], "b"),
        (["--model_name_or_path", "org/name"], "org/name"),
        (["--model"], None),
        (["--modelx", "a"], None),
    ],
)
def test_find_model(script_args, expected):
    assert le.find_model(script_args) == expected


# -- through launch() ------------------------------------------------------------------------------------
@pytest.fixture
def launched(monkeypatch, capsys):
    """``launcher.launch(argv)`` with the launcher replaced: returns (exit code, stderr, [the launched args])."""
    started = []
    monkeypatch.setattr(launcher, "_run_accelerate", lambda args, env: started.append(args) or 0)
    monkeypatch.setattr(le, "_available_host_memory", lambda: 64.0 * GIB)
    monkeypatch.setattr(launcher, "_has_accelerator_devices", lambda: False)
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", "/nonexistent/default.yaml")

    def launch(*argv: str):
        code = launcher.launch(["--stage", "3", "--num_processes", "2", *argv])
        return code, capsys.readouterr().err, started

    return launch


def test_launch_prints_the_estimate_before_starting(launched, model_dir):
    code, err, started = launched("train.py", "--model", model_dir)
    assert code == 0 and len(started) == 1
    expected = le.estimate_lines(["--model", model_dir], ZeroConfig(stage=3), 2, le.Machine(64.0 * GIB))
    assert err.splitlines() == expected


@pytest.mark.parametrize(
    "argv",
    [
        ("train.py", "--lr", "1"),  # no model named
        ("--no_estimate", "train.py", "--model", "MODEL"),  # asked not to
        ("train.py", "--model", "no-such-org/no-such-model-zp"),  # not local, not in the HF cache: no network
        ("train.py", "--model", "MISSING"),  # a folder without config.json
    ],
)
def test_launch_is_silent_without_a_visible_model(launched, model_dir, tmp_path, argv):
    argv = [a.replace("MODEL", model_dir).replace("MISSING", str(tmp_path)) for a in argv]
    code, err, started = launched(*argv)
    assert code == 0 and len(started) == 1
    assert err == ""


# -- the config's hierarchical sharding and accumulation mode reach the planner ---------------------------
HIERARCHICAL = ZeroConfig(stage=3, shard_group_size=2, accumulate_full_grads=True)


def test_launch_plans_the_zero_config_file(launched, model_dir, tmp_path):
    """shard_group_size and accumulate_full_grads from --zero_config: the printed peak is the planner's for
    that config, which differs from plain stage 3's (so a launcher that dropped them would print another)."""
    (tmp_path / "zero.yaml").write_text("shard_group_size: 2\naccumulate_full_grads: true\n")
    code, err, _ = launched(
        "--num_processes", "4", "--zero_config", str(tmp_path / "zero.yaml"), "train.py", "--model", model_dir
    )
    lines = err.splitlines()
    assert code == 0 and lines[1].startswith("  --stage 3, 4 ranks on cpu (shard groups of 2), full fine-tune")
    planned = zpp.Planner(_tiny_config(), config=HIERARCHICAL, device="cpu").estimate(4, 3)["peak"]["total"]
    plain = zpp.Planner(_tiny_config(), device="cpu").estimate(4, 3)["peak"]["total"]
    assert planned > 1.2 * plain and _close(_bytes(lines[1])[-1], planned)


def test_node_shard_groups_are_the_ranks_per_machine(monkeypatch, capsys, model_dir):
    """shard_group_size="node": the children read LOCAL_WORLD_SIZE, which the launcher has not set; it plans
    num_processes // num_machines ranks per shard group instead of printing nothing."""
    args = argparse.Namespace(num_processes=4, num_machines=2)
    env = {"ZERO_PLUGIN_STAGE": "3", "ZERO_PLUGIN_SHARD_GROUP_SIZE": "node", "ZERO_PLUGIN_ACCUMULATE_FULL_GRADS": "1"}
    monkeypatch.setattr(le, "_available_host_memory", lambda: 64.0 * GIB)
    le.print_launch_estimate(["--model", model_dir], args, {}, env, False)
    expected = le.estimate_lines(["--model", model_dir], HIERARCHICAL, 4, le.Machine(64.0 * GIB), ranks_per_host=2)
    assert "(shard groups of 2)" in expected[1] and capsys.readouterr().err.splitlines() == expected


def test_sequence_parallelism_checkpointing_and_activation_offload_are_planned(model_dir):
    """The children's ``sequence_parallel_size``, the script's ``--gradient_checkpointing`` and
    ``offload_activations`` reach the planner: the printed peak is ``Planner``'s with the same arguments, not
    the whole-sequence, uncheckpointed one."""
    args = [
        "--model",
        model_dir,
        "--per_device_train_batch_size",
        "2",
        "--max_length",
        "64",
        "--gradient_checkpointing",
    ]
    config = ZeroConfig(stage=3, sequence_parallel_size=2, offload_activations="cpu")
    machine = le.Machine(host_bytes=64 * GIB, gpu_bytes=80 * GIB)
    lines = le.estimate_lines(args, config, 4, machine)
    assert "activations of 2 x 64 tokens per rank, sequence split over 2 ranks, checkpointed, offloaded" in lines[0]
    kwargs = dict(config=config, batch=2, seq=64, device="cuda", checkpointing=True)
    planned = zpp.Planner(_tiny_config(), sequence_parallel=2, offload_activations=True, **kwargs).estimate(4, 3)
    whole = zpp.Planner(_tiny_config(), **{**kwargs, "checkpointing": False}).estimate(4, 3)
    assert planned["peak"]["device"] < whole["peak"]["device"]
    device, host = _bytes(lines[1])
    assert _close(device, planned["peak"]["device"]) and _close(host, planned["peak"]["host"])
    # A value after the flag, as HF's argument parser takes it: false means no checkpointing.
    off = le.estimate_lines([*args[:-1], "--gradient_checkpointing", "false"], config, 4, machine)
    assert "checkpointed" not in off[0]
