"""Run an unmodified Accelerate or ``transformers.Trainer`` script under a chosen ZeRO stage.

Parent (``zero-plugin launch``, ``zero_plugin/launch/launcher.py``): builds an ``accelerate launch`` of
``-m zero_plugin.run`` with the stage in ``ZERO_PLUGIN_*`` variables:

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
* once ``transformers.training_args`` is imported: ``TrainingArguments.__post_init__``, so that
  ``deepspeed=...`` becomes a ``ZeroConfig`` instead of a DeepSpeed plugin
  (``zero_plugin/integrations/deepspeed_config.py``, ``install``), and, when that config loads lazily (stage 3),
  the lazy ``from_pretrained`` below;
* once ``transformers.trainer`` is imported: its ``Accelerator`` name and ten ``Trainer`` methods
  (checkpoints, the DeepSpeed optimizer / schedule: ``zero_plugin/integrations/hf_trainer.py``, ``install``);
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

import importlib.abc
import importlib.util
import os
import runpy
import sys
from typing import Callable

from .config import ZeroConfig

__all__ = ["install", "main"]

_RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# -- child ------------------------------------------------------------------------------------------
def install() -> None:
    """Patch this process for zero_plugin ([Note: what zero_plugin.run patches])."""
    import accelerate
    import accelerate.accelerator

    from .integrations import deepspeed_config, hf_trainer, trl_vllm
    from .integrations.accelerate import Accelerator

    accelerate.Accelerator = Accelerator
    accelerate.accelerator.Accelerator = Accelerator
    _after_import("transformers.training_args", lambda: deepspeed_config.install(on_take_over=_install_lazy_loading))
    _after_import("transformers.trainer", hf_trainer.install)
    _after_import("trl.generation.vllm_generation", trl_vllm.install)
    _install_lazy_loading(ZeroConfig.from_env())
    # Lightning: register the zero1..zero3_offload strategy names as soon as the script imports Lightning,
    # so PL_TRAINER_STRATEGY=zero3 / LT_STRATEGY=zero3 switch an unmodified script.
    for package in ("lightning", "pytorch_lightning", "lightning_fabric"):
        _after_import(package, _lightning_registrar(package))


def _install_lazy_loading(config: ZeroConfig) -> None:
    """The lazy ``from_pretrained`` for ``config``: the environment's at start, or the one a
    ``TrainingArguments(deepspeed=...)`` resolves to (built before the model, as DeepSpeed's ZeRO-3 requires)."""
    from .loading import lazy_pretrained

    if _loads_lazily(config, int(os.environ.get("RANK", "0"))):
        _after_import("transformers.modeling_utils", lazy_pretrained.install_transformers)
        _after_import("peft.tuners.tuners_utils", lazy_pretrained.install_peft)


def _loads_lazily(config: ZeroConfig, rank: int) -> bool:
    """Stage 3 shards anyway: every rank builds on meta.  Stages 0-2 hold full parameters, so only
    ``cpu_ram_efficient_loading`` (rank 0 reads, zp.setup broadcasts) spares the other ranks' reads.
    ``lazy_loading=False`` turns both off."""
    return config.loading.lazy and (config.stage == 3 or (config.loading.cpu_ram_efficient and rank != 0))


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

        release_groups()  # empty zero_plugin's cache of groups (held weakly)


if __name__ == "__main__":
    main()
