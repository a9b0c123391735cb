"""The private names of other libraries that zero_plugin replaces, in one table, with the versions they were
checked against.

[Note: patched upstream names]
Some integrations can only work by replacing a method or a module attribute of another library (the HF
``Trainer``'s checkpoint methods, ``from_pretrained``'s weight loading, PEFT's adapter placement, TRL's vLLM
weight sync).  Each replacement is listed in :data:`PATCHES` with the parameters the replacement relies on, the
module of ours that installs it and why; :data:`CHECKED` gives, per library, the versions the table was read
against.  Before a module installs its replacements it calls :func:`check`, which warns once, naming the
patched function, the installed version and the checked range, when a target is gone or its parameters
changed (an upgrade that would otherwise fail deep inside a training run, or silently skip our code);
``tests/unit/test_upstream_patches.py`` fails on the same findings, in a fresh process (nothing patched yet),
and checks that every name the installing modules patch is in the table.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import warnings
from typing import Any, Callable

__all__ = ["CHECKED", "PATCHES", "Patch", "check", "problems", "resolve"]


@dataclasses.dataclass(frozen=True, slots=True)
class Patch:
    """One replaced name: ``target`` (module path, then attributes), the ``parameters`` our replacement relies on
    (their names in order, as :func:`parameter_names` writes them; None for a module attribute), the module of
    ours that installs it, and why."""

    target: str
    parameters: str | None
    installed_by: str
    why: str

    @property
    def library(self) -> str:
        return self.target.split(".", 1)[0]


# Versions the table was read against (installed distribution names): (oldest, newest) checked.
CHECKED = {
    "transformers": ("5.24.0", "5.25.0"),
    "peft": ("0.21.0", "0.21.2"),
    "trl": ("1.16.0", "1.16.0"),
}

_TRAINER = "zero_plugin.integrations.hf_trainer"
_T = "transformers.trainer.Trainer."
PATCHES: tuple[Patch, ...] = (
    Patch("transformers.trainer.Accelerator", None, _TRAINER, "the Trainer builds zero_plugin's Accelerator"),
    Patch(_T + "_build_accelerator_args", "self, **kwargs", _TRAINER, "the ZeroPlugin among the arguments"),
    Patch(_T + "create_optimizer", "self, model", _TRAINER, "a DeepSpeed config's optimizer section"),
    Patch(_T + "create_scheduler", "self, num_training_steps, optimizer", _TRAINER, "its scheduler section"),
    Patch(_T + "_move_model_to_device", "self, model, device", _TRAINER, "no full model on the device"),
    Patch(_T + "create_accelerator_and_postprocess", "self", _TRAINER, "the Accelerator with the ZeroPlugin"),
    Patch(_T + "save_model", "self, output_dir, _internal_call", _TRAINER, "weights gathered by zp.full_state_dict"),
    Patch(_T + "_save_optimizer_and_scheduler", "self, output_dir", _TRAINER, "sharded optimizer state"),
    Patch(_T + "_load_optimizer_and_scheduler", "self, checkpoint", _TRAINER, "sharded optimizer state"),
    Patch(_T + "_load_from_checkpoint", "self, resume_from_checkpoint, model", _TRAINER, "sharded checkpoints"),
    Patch(_T + "_load_best_model", "self", _TRAINER, "load_best_model_at_end from the sharded folder"),
    Patch(
        _T + "_get_dataloader",
        "self, dataset, description, batch_size, sampler_fn, is_training, dataloader_key",
        _TRAINER,
        "sequence parallelism: evaluation loaders not split",
    ),
    Patch(_T + "get_resumed_dataloader", "self, dataloader, num_batches", _TRAINER, "a split loader skips batches"),
    Patch(_T + "_get_num_items_in_batch", "self, batch_samples, device", _TRAINER, "split batches' label count"),
    Patch(
        _T + "compute_loss",
        "self, model, inputs, return_outputs, num_items_in_batch",
        _TRAINER,
        "split batches' loss over the whole sequences",
    ),
    Patch(
        _T + "training_step",
        "self, model, inputs, num_items_in_batch",
        _TRAINER,
        "split micro-batches fetched ahead",
    ),
    Patch(
        _T + "evaluation_loop",
        "self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix",
        _TRAINER,
        "evaluation on whole sequences, sequence parallelism paused",
    ),
    Patch(
        "transformers.training_args.TrainingArguments.__post_init__",
        "self",
        "zero_plugin.integrations.deepspeed_config",
        "TrainingArguments(deepspeed=...) taken over without DeepSpeed",
    ),
    Patch(
        "transformers.modeling_utils.PreTrainedModel._apply",
        "self, fn, recurse",
        "zero_plugin.loading.lazy_edits",
        "a lazily loaded model stays on meta through .to() / .half()",
    ),
    Patch(
        "transformers.modeling_utils.PreTrainedModel._resize_token_embeddings",
        "self, new_num_tokens, pad_to_multiple_of, mean_resizing",
        "zero_plugin.loading.lazy_edits",
        "resize_token_embeddings on a lazily loaded model reads the real embedding first",
    ),
    Patch(
        "transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
        "model, state_dict, checkpoint_files, load_config, expected_keys",
        "zero_plugin.loading.lazy_pretrained",
        "from_pretrained stays on meta under zero_plugin.run at stage 3",
    ),
    Patch(
        "peft.tuners.tuners_utils.BaseTunerLayer._move_adapter_to_device_of_base_layer",
        "self, adapter_name, device",
        "zero_plugin.loading.lazy_pretrained",
        "adapters created on a meta base keep their initial values",
    ),
    Patch(
        "peft.tuners.tuners_utils.BaseTuner.inject_adapter",
        "self, model, adapter_name, autocast_adapter_dtype, low_cpu_mem_usage, state_dict",
        "zero_plugin.loading.lazy_pretrained",
        "adapters injected into a meta base: their snapshots restored after injection",
    ),
    Patch(
        "trl.generation.vllm_generation.VLLMGeneration._iter_named_params",
        "self",
        "zero_plugin.integrations.trl_vllm",
        "vLLM weight sync one stage-3 unit at a time",
    ),
)


def resolve(target: str) -> Any:
    """The object at ``target``: the longest importable module prefix, then attributes (``AttributeError`` /
    ``ImportError`` when it is gone).  Imports: for tests and tools, not for install functions (:func:`check`)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ImportError:
            if i == 1:
                raise
            continue
        for name in parts[i:]:
            obj = inspect.getattr_static(obj, name) if isinstance(obj, type) else getattr(obj, name)
        return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    raise ImportError(target)


def parameter_names(fn: Any) -> str:
    """``"self, output_dir, _internal_call"``: names in order, ``*args`` / ``**kwargs`` with their stars."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def _version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _finding(patch: Patch, lookup: Callable[[], Any]) -> str | None:
    """What no longer matches ``patch`` in the object ``lookup()`` returns (gone, or other parameters), or None;
    it names the patched function, the installed version and the checked range.  A target that already is
    zero_plugin's replacement is not compared."""
    oldest, newest = CHECKED[patch.library]
    where = f"{patch.library} {_version(patch.library)} (zero_plugin checked {oldest} to {newest})"
    try:
        obj = lookup()
    except (ImportError, AttributeError) as exc:
        return f"{patch.target}, which {patch.installed_by} replaces, is gone in {where}: {exc}"
    obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if patch.parameters is None or getattr(obj, "__module__", "").startswith("zero_plugin."):
        return None
    now = parameter_names(obj)
    if now == patch.parameters:
        return None
    return (
        f"{patch.target}, which {patch.installed_by} replaces, now takes ({now}) instead of ({patch.parameters}) "
        f"in {where}"
    )


def problems(library: str | None = None) -> list[str]:
    """What no longer matches the table (of ``library``'s patches, or all), resolving each target by import.
    Meant for a process where nothing is patched yet."""
    found = (
        _finding(patch, lambda patch=patch: resolve(patch.target))
        for patch in PATCHES
        if library is None or patch.library == library
    )
    return [f for f in found if f is not None]


_WARNED: set[str] = set()


def check(prefix: str, owner: Any) -> None:
    """Before patching: the table's targets under ``prefix`` (a class or module path, e.g.
    ``"transformers.trainer.Trainer"``) looked up on ``owner``, the class or module the caller already imported
    (nothing is imported here: install functions run from import hooks, while the library imports itself); one
    warning per target gone or changed, once per process ([Note: patched upstream names])."""
    for patch in PATCHES:
        name = patch.target[len(prefix) + 1 :]
        if not patch.target.startswith(prefix + ".") or "." in name:
            continue
        finding = _finding(patch, lambda name=name: inspect.getattr_static(owner, name))
        if finding is not None:
            _warn(finding)


def _warn(finding: str) -> None:
    if finding not in _WARNED:
        _WARNED.add(finding)
        warnings.warn(
            f"zero_plugin: {finding}; zero_plugin's replacement may not work with this version: install a checked "
            "version, or report it with this message",
            RuntimeWarning,
            stacklevel=4,
        )
