"""What an offline export needs to know about the model, captured when a checkpoint is saved.

``zero-plugin consolidate`` runs in one process without the model's code or weights loaded, so
``index.json`` carries, under ``"export"``:

* ``hf_config``: the transformers config of the (base) model, as ``config.json`` would hold it, and
  ``prefix``: what the saved parameter names carry in front of the base model's own names (a
  ``PeftModel`` adds ``base_model.model.``);
* ``peft``: per adapter, its ``adapter_config.json`` content and the name each of its saved parameters
  takes in ``adapter_model.safetensors`` -- computed by PEFT itself (``get_peft_model_state_dict``)
  at save time, so the export follows whatever naming the installed PEFT uses.

Models without a transformers config or PEFT adapters get ``{}``: their checkpoints still consolidate
to plain safetensors.
"""

from __future__ import annotations

import enum
import json
import warnings
from typing import Any

import torch
from torch import nn

from ..state_dict import raw_state_dict

__all__ = ["describe_model"]


def describe_model(model: nn.Module) -> dict[str, Any]:
    """The ``export`` record; a model this cannot describe still saves (with a warning): only
    ``consolidate --format hf`` needs the record."""
    try:
        # built on rank 0 alone: no collective state_dict() ([Note: stage-3 state dicts] in ``state_dict_hooks.py``)
        with raw_state_dict(model):
            return _describe(model)
    except Exception as exc:  # noqa: BLE001 - a checkpoint must not fail over export metadata
        warnings.warn(
            f"zp.save_checkpoint: could not record the model's transformers/PEFT configuration "
            f"({type(exc).__name__}: {exc}); `zero-plugin consolidate --format hf` will not be able "
            "to export this checkpoint (--format safetensors still can)",
            stacklevel=3,
        )
        return {}


def _describe(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    adapters = getattr(model, "peft_config", None)
    is_peft = isinstance(adapters, dict) and hasattr(model, "get_base_model")
    base = model.get_base_model() if is_peft else model
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        hf = json.loads(config.to_json_string(use_diff=False))
        hf["architectures"] = [type(base).__name__]
        out["hf_config"] = hf
        out["prefix"] = _prefix(model, base)
    if is_peft:
        peft = _peft_keys(model, adapters)
        if peft:
            out["peft"] = peft
    return out


def _prefix(model: nn.Module, base: nn.Module) -> str:
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name + "."
    return ""


def _peft_keys(model: nn.Module, adapters: dict) -> dict[str, Any]:
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        return {}
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    out = {}
    for adapter, cfg in adapters.items():
        markers = {n: torch.empty(0) for n in names}  # distinct objects: PEFT's output maps back by identity
        by_id = {id(t): n for n, t in markers.items()}
        exported = get_peft_model_state_dict(model, state_dict=markers, adapter_name=adapter)
        keys = {by_id[id(t)]: key for key, t in exported.items() if id(t) in by_id}
        if keys:
            out[adapter] = {"config": _adapter_config(model, cfg), "keys": keys}
    return out


def _adapter_config(model: nn.Module, cfg: Any) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT's ``save_pretrained`` writes it: marked for inference, and the base
    class recorded when there is no task type."""
    config = _jsonable(cfg.to_dict())
    config["inference_mode"] = True
    base = model.get_base_model()
    if config.get("task_type") is None:
        config["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return config


def _jsonable(value: Any) -> Any:
    """``adapter_config.json`` content: sets become sorted lists (as PEFT writes them), enums their value."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
