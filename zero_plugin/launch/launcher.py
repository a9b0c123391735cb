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
from .allocator import ALLOCATORS, DEFAULT, preload_environment

__all__ = ["launch"]

_SECTION = "zero_plugin"
_REPLACED = {"use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM", "tpu": "TPU"}
_REPLACED_TYPES = {"FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM", "XLA": "TPU"}
# accelerate launch's DeepSpeed options, read by _take_deepspeed (deepspeed_config.from_accelerate)
_DEEPSPEED_FLAGS = (
    "deepspeed_config_file",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_init_flag",
    "zero3_save_16bit_model",
)


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
    group.add_argument(
        "--sequence_parallel_size",
        type=int,
        help="ranks per Ulysses sequence-parallel group, K (ZERO_PLUGIN_SEQUENCE_PARALLEL_SIZE; docs/long-context.md)",
    )
    group.add_argument("--zero_config", help="YAML/JSON file of ZeroConfig fields")
    group.add_argument(
        "--allocator",
        default=DEFAULT,
        metavar="{" + ",".join([DEFAULT, *ALLOCATORS]) + ",PATH}",
        help="the ranks' host memory allocator, preloaded (LD_PRELOAD) into every process started: tcmalloc "
        "holds less memory than glibc's at DDP's speed on the CPU (zero_plugin/launch/allocator.py, docs/tuning.md); "
        "default glibc",
    )
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
        env.update(preload_environment(args.allocator, os.environ))
        _take_deepspeed(args, accelerate_settings, env, temp_files)
        script_args = list(args.training_script_args)
        _check_trainer_deepspeed(script_args, env)
        _prepare_accelerate_args(args, accelerate_settings, env)
        _check_sequence_parallel(args, env)
    except ValueError as exc:
        print(f"zero-plugin launch: {exc}", file=sys.stderr)
        return 2
    if "LD_PRELOAD" in env:
        print(f"zero-plugin launch: every process preloads {env['LD_PRELOAD']} (--allocator {args.allocator})")
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
    if args.sequence_parallel_size is not None:
        env["ZERO_PLUGIN_SEQUENCE_PARALLEL_SIZE"] = str(args.sequence_parallel_size)
    try:
        ZeroConfig.from_env({**os.environ, **env})
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"invalid zero_plugin configuration: {exc}") from None
    return env


def _check_sequence_parallel(args: argparse.Namespace, env: dict[str, str]) -> None:
    """``sequence_parallel_size`` (flag, variable or file) must divide the processes started, checked before any
    starts; a launch whose process count is left to Accelerate's GPU defaults is checked by each process."""
    if args.num_processes is not None:
        ZeroConfig.from_env({**os.environ, **env}).resolved_sequence_parallel_size(int(args.num_processes))


def _split_accelerate_config(path: str | None, temp_files: list[str]) -> tuple[str | None, str | None, dict]:
    """(config file for Accelerate, file holding a ``zero_plugin:`` section or None, Accelerate's settings).

    Accelerate rejects unknown keys, so a config carrying a ``zero_plugin:`` section is copied
    without it into a temporary file for Accelerate; the children read the section from the original.  A
    ``distributed_type: DEEPSPEED`` config is copied as a plain multi-process one (its ``deepspeed_config:``
    is read by ``_take_deepspeed``, from the settings returned).
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
    for_accelerate = _without_deepspeed(rest)
    if _SECTION not in data and for_accelerate == rest:
        return path, None, rest
    fd, copy = tempfile.mkstemp(prefix="zero_plugin_accelerate_", suffix=".json" if is_json else ".yaml")
    temp_files.append(copy)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(for_accelerate, f) if is_json else yaml.safe_dump(for_accelerate, f)
    return copy, source if _SECTION in data else None, rest


def _distributed_type(settings: dict) -> str:
    return str(settings.get("distributed_type", "NO")).split(".")[-1].upper()


def _without_deepspeed(settings: dict) -> dict:
    """Accelerate's settings with DeepSpeed replaced by plain processes (zero_plugin shards instead)."""
    if _distributed_type(settings) != "DEEPSPEED":
        return settings
    out = {k: v for k, v in settings.items() if k != "deepspeed_config"}
    out["distributed_type"] = "MULTI_GPU" if _has_accelerator_devices() else "MULTI_CPU"
    return out


def _take_deepspeed(args: argparse.Namespace, settings: dict, env: dict[str, str], temp_files: list[str]) -> None:
    """An Accelerate DEEPSPEED config or ``--use_deepspeed`` (with ``--deepspeed_config_file`` or the other
    DeepSpeed flags) becomes the children's ``ZeroConfig`` (``integrations/deepspeed_config.py``): checked against
    zero_plugin's own settings, written as ``ZERO_PLUGIN_CONFIG``, and printed once, here."""
    from ..config_deepspeed import translate
    from ..integrations import deepspeed_config as ds

    from_config = _distributed_type(settings) == "DEEPSPEED"
    if not (args.use_deepspeed or from_config):
        return
    flags = {name: getattr(args, name, None) for name in _DEEPSPEED_FLAGS}
    data, autos, name = ds.from_accelerate(settings.get("deepspeed_config") or {} if from_config else {}, flags)
    sections = [s for s in ("optimizer", "scheduler") if s in data]
    if sections:
        raise ValueError(
            f"DeepSpeed config {name}: zero-plugin launch applies the {' and '.join(sections)} section(s) only "
            "through the HF Trainer (TrainingArguments(deepspeed=...), the script's --deepspeed); for an "
            "Accelerate script remove them and build the optimizer / scheduler in the script"
        )
    autos.update(ds.precision_autos(args.mixed_precision or settings.get("mixed_precision")))
    processes = args.num_processes if args.num_processes is not None else settings.get("num_processes", 1)
    machines = args.num_machines if args.num_machines is not None else settings.get("num_machines", 1)
    translation = translate(data, resolved=autos, world_size=int(processes) * int(machines), name=name)
    config = ds.merged_config(translation, ds.explicit_settings({**os.environ, **env}))
    fd, path = tempfile.mkstemp(prefix="zero_plugin_from_deepspeed_", suffix=".yaml")
    temp_files.append(path)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(ds.to_yaml(config, translation))
    env["ZERO_PLUGIN_CONFIG"] = path
    accumulation = translation.batch.get("gradient_accumulation_steps")
    if accumulation is not None:
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(accumulation)
    print(ds.report(translation, config), file=sys.stderr, flush=True)
    args.use_deepspeed = False
    for flag in _DEEPSPEED_FLAGS:
        setattr(args, flag, None)


def _check_trainer_deepspeed(script_args: list[str], env: dict[str, str]) -> None:
    """A Trainer script's ``--deepspeed FILE.json``: what can be refused before its ``TrainingArguments`` exist
    (nvme offload, an unknown stage, a setting that disagrees with zero_plugin's own) is refused here, before
    any process starts; each process translates the file again with the arguments' values
    (``integrations/deepspeed_config.py``).  A file that cannot be read is left to the script."""
    from ..config_deepspeed import translate
    from ..integrations import deepspeed_config as ds

    path = _option_value(script_args, "--deepspeed")
    if path is None or not path.endswith(".json") or not os.path.isfile(path):
        return
    translation = translate(path, warn_unknown=False, later_autos=True)
    ds.merged_config(translation, ds.explicit_settings({**os.environ, **env}))


def _option_value(argv: list[str], option: str) -> str | None:
    """The value of ``option VALUE`` or ``option=VALUE`` in ``argv`` (the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(option + "="):
            value = arg[len(option) + 1 :]
    return value


def _prepare_accelerate_args(args: argparse.Namespace, defaults: dict, env: dict[str, str]) -> None:
    """Refuse FSDP / Megatron-LM / TPU, apply [Note: Accelerate on a CPU-only machine], run the script via
    zero_plugin.run (DeepSpeed was taken over by ``_take_deepspeed``)."""
    for flag, name in _REPLACED.items():
        if getattr(args, flag, False):
            raise ValueError(f"--{flag} asks Accelerate for {name}, which zero_plugin replaces; drop it")
    dist_type = _distributed_type(defaults)
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
