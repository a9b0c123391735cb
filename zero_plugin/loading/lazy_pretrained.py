"""``from_pretrained`` without the weights: build on meta, record the files, let ``zp.setup`` fill units.

[Note: lazy from_pretrained]
transformers (5.x) already builds every model on the meta device and then reads the checkpoint in
``PreTrainedModel._load_pretrained_model``.  While :func:`install` is active that one step is
replaced: for a safetensors checkpoint it loads only the persistent buffers, leaves every parameter
on meta, marks them loaded (``_is_hf_initialized``, as transformers' loader does, so its init code
skips them exactly as it would after an eager load: the RNG stream is the same) and records the
files on the model (``materialize.record_source``).  Everything else in ``from_pretrained`` is
transformers' own: the config, ``dtype``/``torch_dtype`` (the meta parameters take it; values are
cast on fill, so bf16 files train in fp32 and vice versa), missing keys (initialised for real, as
eagerly), non-persistent buffers such as rotary ``inv_freq`` (recomputed by ``_init_weights``), tied
embeddings (one meta parameter under two names), the generation config, the hub-kernel choice (made
for the device type an eager load would have used, as transformers refuses to kernelize a meta model).
``zp.setup`` then reads one unit at a time from the recorded files (``stage3/engine.py``), or at stages
0-2 the whole model on rank 0 and broadcasts (``materialize.materialize_all``).

What cannot stay lazy takes transformers' normal path, with one warning naming the reason and the
cost: pickle (``.bin``) checkpoints, an explicit ``state_dict``, ``device_map``, quantization,
``_keep_in_fp32_modules`` dtype plans, and checkpoints whose names need transformers' renaming.
Loads after the first ``zp.setup`` of the process are not lazy either (no warning): nothing will
shard that model (an evaluation or reload copy), and a meta model cannot run unsharded.

[Note: PEFT adapters on a meta base]
PEFT creates LoRA weights for real (kaiming init from the global RNG, zeros) and then moves them to
the base layer's device -- meta -- in more than one place (``_move_adapter_to_device_of_base_layer``,
each tuner's ``_replace_module``), losing the values.  :func:`install_peft` wraps the first, which runs
right after the init, to keep a copy of the fresh adapter tensors when the base weight is on meta
(adapters are small), and ``BaseTuner.inject_adapter`` (through which ``get_peft_model``,
``PeftModel.from_pretrained``/``load_adapter`` and transformers' ``add_adapter`` all create adapters)
to give them those values back, for real, once injection is done.  Adapters are then real before
``zp.setup`` (so loading saved adapter weights into them works) and hold exactly what an eager run
draws from the same seed: the lazy load consumes the RNG as an eager one does.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from .. import upstream
from . import lazy_edits, materialize

__all__ = ["install", "install_transformers", "install_peft", "uninstall", "LazyLoadFallbackWarning"]

_ORIGINALS: dict[str, object] = {}
_WARNED: set[str] = set()


class LazyLoadFallbackWarning(UserWarning):
    """``from_pretrained`` could not stay on meta and loaded the full model in this process."""


def install() -> None:
    """Both patches below (idempotent); ``zero_plugin.run`` applies each once its module is imported."""
    install_transformers()
    install_peft()


def install_transformers() -> None:
    """Replace ``PreTrainedModel._load_pretrained_model``: see [Note: lazy from_pretrained]; and what a lazily
    loaded model needs for the edits scripts make before setup ([Note: edits before setup] in lazy_edits.py)."""
    from transformers.modeling_utils import PreTrainedModel

    if "load" not in _ORIGINALS:
        upstream.check("transformers.modeling_utils.PreTrainedModel", PreTrainedModel)  # [Note: patched upstream names]
        _ORIGINALS["load"] = PreTrainedModel.__dict__["_load_pretrained_model"]
        PreTrainedModel._load_pretrained_model = staticmethod(_load_lazily)
    lazy_edits.install()


def install_peft() -> None:
    """Wrap ``BaseTunerLayer._move_adapter_to_device_of_base_layer`` and ``BaseTuner.inject_adapter``: see
    [Note: PEFT adapters on a meta base]."""
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    if "move" not in _ORIGINALS:
        upstream.check("peft.tuners.tuners_utils.BaseTunerLayer", BaseTunerLayer)  # [Note: patched upstream names]
        upstream.check("peft.tuners.tuners_utils.BaseTuner", BaseTuner)
        _ORIGINALS["move"] = BaseTunerLayer._move_adapter_to_device_of_base_layer
        _ORIGINALS["inject"] = BaseTuner.inject_adapter
        BaseTunerLayer._move_adapter_to_device_of_base_layer = _snapshot_adapter_on_meta_base
        BaseTuner.inject_adapter = _inject_then_restore


def uninstall() -> None:
    """Undo :func:`install` (tests; ``zero_plugin.run`` keeps it for the life of the process)."""
    if "load" in _ORIGINALS:
        from transformers.modeling_utils import PreTrainedModel

        PreTrainedModel._load_pretrained_model = _ORIGINALS.pop("load")
        lazy_edits.uninstall()
    if "move" in _ORIGINALS:
        from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

        BaseTunerLayer._move_adapter_to_device_of_base_layer = _ORIGINALS.pop("move")
        BaseTuner.inject_adapter = _ORIGINALS.pop("inject")


# -- transformers ----------------------------------------------------------------------------------
def _load_lazily(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    original = _ORIGINALS["load"].__func__
    if materialize.any_set_up():
        # A load after training started is for evaluation or export (a fresh base model to reload an
        # adapter on rank 0): nothing will shard it, so it loads as usual.
        return original(model, state_dict, checkpoint_files, load_config, expected_keys)
    reason = _why_not_lazy(state_dict, checkpoint_files, load_config)
    if reason is None:
        names = _file_names(checkpoint_files)
        expected = set(model.state_dict().keys()) if expected_keys is None else set(expected_keys)
        missing, unexpected = expected - set(names), set(names) - expected
        unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
        if missing - _tied_names(model) and unexpected:
            reason = (
                f"the checkpoint's names differ from the model's (e.g. {sorted(unexpected)[0]!r}) and need "
                "transformers' renaming"
            )
    if reason is not None:
        _warn_fallback(reason)
        return original(model, state_dict, checkpoint_files, load_config, expected_keys)
    _load_buffers(model, names, missing)
    for name, param in model.named_parameters():
        if name not in missing:
            param._is_hf_initialized = True  # transformers' own mark of a loaded tensor
    materialize.record_source(model, [Path(f) for f in checkpoint_files], lazy_edits.refuse_forward(model))
    _kernelize_for_the_eager_device(model)
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    return info, None


def _kernelize_for_the_eager_device(model) -> None:
    """transformers >= 5.25 ``kernelize``s every model at the end of ``from_pretrained`` (``use_kernels``
    defaults to on) for the device type of its parameters, and refuses ``meta``.  An eager load without
    ``device_map`` leaves the parameters on the default device, so the lazy model is kernelized for that
    same device type: the forward it runs is the one the eager load would have run."""
    default = torch.get_default_device().type
    model._kernels_device = "cpu" if default == "meta" else default


def _why_not_lazy(state_dict, checkpoint_files, load_config) -> str | None:
    if state_dict is not None:
        return "from_pretrained was given a state_dict (already in memory)"
    if not checkpoint_files:
        return "no checkpoint files"
    if not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return (
            f"{Path(checkpoint_files[0]).name} is a pickle checkpoint, which cannot be read one tensor at a "
            "time (re-save it with save_pretrained, which writes safetensors)"
        )
    if load_config.device_map is not None:
        return "device_map places the weights itself"
    if load_config.hf_quantizer is not None:
        return "a quantization config transforms the weights while loading"
    if load_config.dtype_plan:
        return "the model keeps some modules in fp32 (_keep_in_fp32_modules), applied while loading"
    if getattr(load_config, "device_mesh", None) is not None:
        return "device_mesh (tensor parallel) shards the weights while loading"
    return None


def _warn_fallback(reason: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"zero_plugin: from_pretrained cannot build this model lazily on the meta device because "
        f"{reason}; it loads the full model in every process (N full copies in host RAM) before "
        "zp.setup shards it",
        LazyLoadFallbackWarning,
        stacklevel=4,
    )


def _file_names(checkpoint_files) -> dict[str, str]:
    from safetensors import safe_open

    names: dict[str, str] = {}
    for f in checkpoint_files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), str(f)))
    return names


def _tied_names(model: nn.Module) -> set[str]:
    return set(getattr(model, "all_tied_weights_keys", {}) or {})


@torch.no_grad()
def _load_buffers(model: nn.Module, names: dict[str, str], missing: set[str]) -> None:
    """Persistent buffers found in the checkpoint are small: read them now (parameters stay on meta)."""
    from safetensors import safe_open

    persistent = {k for k in model.state_dict().keys()} - {n for n, _ in model.named_parameters()}
    for key in sorted(persistent - missing):
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner)
        with safe_open(names[key], framework="pt") as handle:
            value = handle.get_tensor(key).to(module._buffers[attr].dtype)
        value._is_hf_initialized = True
        module._buffers[attr] = value


# -- PEFT ------------------------------------------------------------------------------------------
_FRESH: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


@torch.no_grad()
def _snapshot_adapter_on_meta_base(self, adapter_name, device=None):
    weight = getattr(self.get_base_layer(), "weight", None)
    if weight is not None and weight.is_meta:
        for layer_name in self.adapter_layer_names:  # lora_A, lora_B, lora_embedding_A, ...
            layer = getattr(self, layer_name, None)
            if isinstance(layer, nn.ParameterDict) and adapter_name in layer:
                _remember(layer, {adapter_name: layer[adapter_name]})
            elif isinstance(layer, nn.ModuleDict) and adapter_name in layer:
                for module in layer[adapter_name].modules():
                    _remember(module, dict(module.named_parameters(recurse=False)))
    return _ORIGINALS["move"](self, adapter_name, device)


def _remember(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    fresh = {attr: p.detach().clone() for attr, p in params.items() if not p.is_meta}
    if fresh:
        _FRESH.setdefault(module, {}).update(fresh)


@torch.no_grad()
def _inject_then_restore(self, model, *args, **kwargs):
    out = _ORIGINALS["inject"](self, model, *args, **kwargs)
    for module in model.modules():
        for attr, value in _FRESH.pop(module, {}).items():
            param = module._parameters.get(attr)
            if param is not None and param.is_meta:
                materialize.to_real(param, value.to(param.dtype))
    return out
