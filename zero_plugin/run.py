"""Run an unmodified Accelerate or ``transformers.Trainer`` script under a chosen ZeRO stage.

Parent (``zero-plugin launch``): builds an ``accelerate launch`` of ``-m zero_plugin.run`` with the
stage in ``ZERO_PLUGIN_*`` variables:

    zero-plugin launch --stage 3 [--offload cpu] [--zero_config FILE] [accelerate launch options] train.py [args]

Child (``python -m zero_plugin.run train.py [args]``, what every launched process runs): swaps
zero_plugin's Accelerator in for ``accelerate.Accelerator`` (see [Note: what zero_plugin.run patches])
and runs the script as ``__main__``.  It also works under a plain launcher:

    ZERO_PLUGIN_STAGE=3 accelerate launch --multi_gpu --num_processes 2 -m zero_plugin.run train.py
    (without GPUs also ACCELERATE_USE_CPU=true, see the note below)

[Note: Accelerate on a CPU-only machine]
``accelerate launch --num_processes N`` without GPUs starts ONE process (its simple launcher needs
mpirun for N CPU processes); ``--multi_gpu`` starts N processes through torchrun, but each runs alone
unless ``ACCELERATE_USE_CPU=true``, which makes Accelerate initialise gloo (MULTI_CPU).  So for N > 1
CPU processes the launcher passes ``--multi_gpu`` (dropping ``--cpu``, which excludes it) and sets
``ACCELERATE_USE_CPU=true``.  The child refuses to run when Accelerate's simple launcher was asked for
several processes but started one, and the Accelerator refuses when torchrun started several
processes that each set up a single-process run.

[Note: exit without finalisation] After a successful script and the process-group teardown, run the
``atexit`` handlers, flush every open file, and leave with ``os._exit(0)``.  Interpreter finalisation
destroys leftover C++ objects of torch / gloo in arbitrary order, and a gloo thread still joinable
then aborts the process ("terminate called without an active exception", exit -6) after the work
succeeded: seen on rank 1 of the LoRA Trainer tests in 2 of 4 full test runs even with the barrier
and the group destroyed.  Skipping finalisation loses nothing the handlers and flushes keep.

[Note: what zero_plugin.run patches]  In this process only, and nothing in torch:
* ``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator`` -> zero_plugin's subclass;
* once ``transformers.trainer`` is imported: its ``Accelerator`` name and six ``Trainer``
  checkpoint methods (``zero_plugin/integrations/hf_trainer.py``, ``install``);
* once ``trl.generation.vllm_generation`` is imported: ``VLLMGeneration._iter_named_params``, the weights
  GRPO / RLOO push to vLLM, gathered one unit at a time at stage 3 (``zero_plugin/integrations/trl_vllm.py``);
* once Lightning is imported: the zero strategy names are registered (nothing is patched);
* at stage 3 (every rank), or at stages 0-2 with ``cpu_ram_efficient_loading`` (ranks other than 0),
  unless ``lazy_loading`` is off: once ``transformers.modeling_utils`` is imported,
  ``PreTrainedModel._load_pretrained_model``, so that a safetensors ``from_pretrained`` builds on meta
  and records its files (anything else loads as usual, with one warning), and ``PreTrainedModel._apply`` /
  ``_resize_token_embeddings`` for the edits scripts make before setup
  (``zero_plugin/loading/lazy_edits.py``); once ``peft.tuners.tuners_utils`` is imported,
  ``BaseTunerLayer._move_adapter_to_device_of_base_layer``, so that adapters created on a meta base
  keep their initial values (``zero_plugin/loading/lazy_pretrained.py``, both Notes there).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys
import tempfile
from typing import Callable

import yaml

from .config import ZeroConfig

__all__ = ["install", "main", "launch"]

_RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_SECTION = "zero_plugin"
_REPLACED = {"use_deepspeed": "DeepSpeed", "use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM", "tpu": "TPU"}
_REPLACED_TYPES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM", "XLA": "TPU"}


# -- child ------------------------------------------------------------------------------------------
def install() -> None:
    """Patch this process for zero_plugin ([Note: what zero_plugin.run patches])."""
    import accelerate
    import accelerate.accelerator

    from .integrations import hf_trainer, trl_vllm
    from .integrations.accelerate import Accelerator
    from .loading import lazy_pretrained

    accelerate.Accelerator = Accelerator
    accelerate.accelerator.Accelerator = Accelerator
    _after_import("transformers.trainer", hf_trainer.install)
    _after_import("trl.generation.vllm_generation", trl_vllm.install)
    if _loads_lazily(ZeroConfig.from_env(), int(os.environ.get("RANK", "0"))):
        _after_import("transformers.modeling_utils", lazy_pretrained.install_transformers)
        _after_import("peft.tuners.tuners_utils", lazy_pretrained.install_peft)
    # Lightning: register the zero1..zero3_offload strategy names as soon as the script imports Lightning,
    # so PL_TRAINER_STRATEGY=zero3 / LT_STRATEGY=zero3 switch an unmodified script.
    for package in ("lightning", "pytorch_lightning", "lightning_fabric"):
        _after_import(package, _lightning_registrar(package))


def _loads_lazily(config: ZeroConfig, rank: int) -> bool:
    """Stage 3 shards anyway: every rank builds on meta.  Stages 0-2 hold full parameters, so only
    ``cpu_ram_efficient_loading`` (rank 0 reads, zp.setup broadcasts) spares the other ranks' reads.
    ``lazy_loading=False`` turns both off."""
    return config.lazy_loading and (config.stage == 3 or (config.cpu_ram_efficient_loading and rank != 0))


def _lightning_registrar(package: str) -> Callable[[], None]:
    def register() -> None:
        from .integrations.lightning import register_strategies

        register_strategies([package])

    return register


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after module ``name`` is executed (transformers imports it lazily).  It finds the
    module's own spec and hands it back with its loader wrapped in :class:`_ThenCall`; no code is changed."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall(importlib.abc.Loader):
    """The module's loader, then ``callback``; the module keeps the real loader as ``__loader__``."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)  # optional for loaders (PEP 451)
        return None if create is None else create(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback()


def _after_import(name: str, callback: Callable[[], None]) -> None:
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


def _check_processes_started() -> None:
    """See [Note: Accelerate on a CPU-only machine]: the simple launcher sets MASTER_ADDR for N > 1."""
    launched_by_accelerate = "ACCELERATE_USE_CPU" in os.environ
    if launched_by_accelerate and "MASTER_ADDR" in os.environ and not any(v in os.environ for v in _RANK_VARIABLES):
        raise SystemExit(
            "zero_plugin.run: accelerate launch was asked for several processes but started only this one (on a "
            "machine without GPUs its simple launcher needs mpirun). Use `zero-plugin launch --num_processes N "
            "...`, or `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N -m zero_plugin.run "
            "...`."
        )


def main(argv: list[str] | None = None) -> None:
    """Child entry point: ``python -m zero_plugin.run [-m module | script.py] [args...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    is_module = bool(argv) and argv[0] == "-m"
    if is_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m zero_plugin.run [-m module | script.py] [script args...]")
    _check_processes_started()
    try:
        ZeroConfig.from_env()  # a bad configuration stops here, before the script's imports
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"zero_plugin.run: invalid zero_plugin configuration: {exc}") from None
    install()
    target, script_args = argv[0], argv[1:]
    sys.argv = [target, *script_args]
    if not is_module and not os.path.isfile(target):
        raise SystemExit(f"zero_plugin.run: no such script: {target!r}")
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` would
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    _shut_down_process_group()
    _exit_after_success()


def _exit_after_success() -> None:
    """Run the ``atexit`` handlers, flush open files, ``os._exit(0)`` ([Note: exit without finalisation])."""
    import atexit
    import gc
    import io

    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a weakref.proxy whose object is gone raises ReferenceError
        # (bitsandbytes / PEFT keep such proxies, seen after a QLoRA script)
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001 - a stream that cannot flush has nothing we can save
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)


def _shut_down_process_group() -> None:
    """Destroy the default process group the script left behind (Trainer and Accelerate scripts rarely do).

    Without it, a rank that finishes while another still works (rank 0 saving or evaluating alone) exits
    with gloo's worker threads alive, and the C++ runtime aborts at interpreter exit ("terminate called
    without an active exception"), turning a successful run into exit code -6.  The barrier first makes
    every rank leave the group together (no rank destroys it while a peer may still issue a collective) and
    flushes pending async work.  Neither stopped that abort on its own (seen once each with and without the
    barrier); what does is leaving without interpreter finalisation ([Note: exit without finalisation]).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()  # tear gloo down together: a rank still working (rank 0 saving) keeps its peers' pairs
        except Exception:  # noqa: BLE001 - a peer that failed has gone; destroy anyway
            pass
        dist.destroy_process_group()
        from .comm.groups import release_groups

        release_groups()  # zero_plugin's cached groups also hold the default group


# -- parent -----------------------------------------------------------------------------------------
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
        from .launch.estimate import print_launch_estimate

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


if __name__ == "__main__":
    main()
