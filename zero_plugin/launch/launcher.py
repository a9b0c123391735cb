"""``zero-plugin launch``, the parent: an ``accelerate launch`` of ``-m zero_plugin.run`` (the child, in
``zero_plugin/run.py``) with the ZeRO configuration in ``ZERO_PLUGIN_*`` variables, validated before any process
starts; [Note: Accelerate on a CPU-only machine] in ``zero_plugin/run.py``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import yaml

from ..config import ZeroConfig

__all__ = ["launch"]

_SECTION = "zero_plugin"
_REPLACED = {"use_deepspeed": "DeepSpeed", "use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM", "tpu": "TPU"}
_REPLACED_TYPES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM", "XLA": "TPU"}


def _launch_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "zero-plugin launch"
    parser.formatter_class = argparse.HelpFormatter  # Accelerate's hides groups it does not know
    parser.description = (
        "Run an unmodified Accelerate / transformers.Trainer script under zero_plugin: "
        "accelerate launch [options] -m zero_plugin.run script.py [args]."
    )
    group = parser.add_argument_group(
        "zero_plugin", "ZeRO configuration (else ZERO_PLUGIN_* variables, or a zero_plugin: section of --config_file)"
    )
    group.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (ZERO_PLUGIN_STAGE)")
    group.add_argument("--offload", choices=("none", "cpu"), help="optimizer offload (ZERO_PLUGIN_OFFLOAD)")
    group.add_argument("--zero_config", help="YAML/JSON file of ZeroConfig fields")
    group.add_argument(
        "--no_estimate",
        action="store_true",
        help="do not print the planner's memory per rank for "
        "the script's --model before launching (zero_plugin/launch/estimate.py)",
    )
    return parser


def launch(argv: list[str]) -> int:
    """``zero-plugin launch``: returns the exit code."""
    args = _launch_parser().parse_args(argv)
    temp_files: list[str] = []
    try:
        args.config_file, section, accelerate_settings = _split_accelerate_config(args.config_file, temp_files)
        env = _zero_environment(args, section)
        script_args = list(args.training_script_args)
        _prepare_accelerate_args(args, accelerate_settings, env)
    except ValueError as exc:
        print(f"zero-plugin launch: {exc}", file=sys.stderr)
        return 2
    if not args.no_estimate:
        from .estimate import print_launch_estimate

        print_launch_estimate(script_args, args, accelerate_settings, env, _has_accelerator_devices())
    try:
        return _run_accelerate(args, env)
    finally:
        for path in temp_files:
            os.unlink(path)


def _zero_environment(args: argparse.Namespace, section: str | None) -> dict[str, str]:
    """ZERO_PLUGIN_* variables for the children, validated here so that a mistake fails before launching."""
    env: dict[str, str] = {}
    if section is not None and args.zero_config:
        raise ValueError(
            f"both --zero_config {args.zero_config!r} and a '{_SECTION}:' section in {section!r} "
            "configure zero_plugin; keep one"
        )
    config_file = args.zero_config or section
    if config_file:
        env["ZERO_PLUGIN_CONFIG"] = os.path.abspath(config_file)
    if args.stage is not None:
        env["ZERO_PLUGIN_STAGE"] = str(args.stage)
    if args.offload is not None:
        env["ZERO_PLUGIN_OFFLOAD"] = args.offload
    try:
        ZeroConfig.from_env({**os.environ, **env})
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"invalid zero_plugin configuration: {exc}") from None
    return env


def _split_accelerate_config(path: str | None, temp_files: list[str]) -> tuple[str | None, str | None, dict]:
    """(config file for Accelerate, file holding a ``zero_plugin:`` section or None, Accelerate's settings).

    Accelerate rejects unknown keys, so a config carrying a ``zero_plugin:`` section is copied
    without it into a temporary file for Accelerate; the children read the section from the original.
    """
    from accelerate.commands.config.config_args import default_config_file

    source = path if path is not None else (default_config_file if os.path.isfile(default_config_file) else None)
    if source is None:
        return None, None, {}
    if not os.path.isfile(source):
        raise ValueError(f"--config_file {source!r}: no such file")
    is_json = source.endswith(".json")
    with open(source, encoding="utf-8") as f:
        try:
            data = json.load(f) if is_json else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ValueError(f"--config_file {source!r}: cannot parse: {exc}") from None
    data = data if isinstance(data, dict) else {}
    rest = {k: v for k, v in data.items() if k != _SECTION}
    if _SECTION not in data:
        return path, None, rest
    fd, copy = tempfile.mkstemp(prefix="zero_plugin_accelerate_", suffix=".json" if is_json else ".yaml")
    temp_files.append(copy)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(rest, f) if is_json else yaml.safe_dump(rest, f)
    return copy, source, rest


def _prepare_accelerate_args(args: argparse.Namespace, defaults: dict, env: dict[str, str]) -> None:
    """Refuse DeepSpeed/FSDP, apply [Note: Accelerate on a CPU-only machine], run the script via zero_plugin.run."""
    for flag, name in _REPLACED.items():
        if getattr(args, flag, False):
            raise ValueError(f"--{flag} asks Accelerate for {name}, which zero_plugin replaces; drop it")
    dist_type = str(defaults.get("distributed_type", "NO")).split(".")[-1].upper()
    if dist_type in _REPLACED_TYPES and not args.multi_gpu:
        raise ValueError(
            f"the Accelerate config sets distributed_type: {dist_type}, which zero_plugin replaces; "
            "use MULTI_GPU / MULTI_CPU / NO"
        )
    num_processes = args.num_processes if args.num_processes is not None else defaults.get("num_processes")
    if not _has_accelerator_devices():
        if num_processes is None:
            args.num_processes = num_processes = 1
        if int(num_processes) > 1 and args.mpirun_hostfile is None:
            args.multi_gpu, args.cpu = True, False
            env["ACCELERATE_USE_CPU"] = "true"
    script = (["-m"] if args.module else []) + [args.training_script]
    args.training_script_args = script + list(args.training_script_args)
    args.training_script, args.module, args.no_python = "zero_plugin.run", True, False


def _has_accelerator_devices() -> bool:
    import torch

    for name in ("cuda", "xpu", "npu", "mlu"):
        backend = getattr(torch, name, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            return True
    return False


def _run_accelerate(args: argparse.Namespace, env: dict[str, str]) -> int:
    import subprocess

    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(env)  # Accelerate's launchers copy os.environ into the children's environment
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # simple (single-process) launcher
        return exc.returncode or 1
    except ChildFailedError as exc:  # torchrun (multi-process) launcher
        print(f"zero-plugin launch: a process failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return 0
