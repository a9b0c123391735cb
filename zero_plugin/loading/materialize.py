"""Models bigger than one rank: build on the meta device, fill unit by unit.

``zp.setup(model, optimizer, config, param_source=...)`` accepts a model whose
parameters live on the meta device.  At stage 3 each unit's parameters are
allocated full-size one unit at a time, filled from ``param_source``, sharded
and freed, so no rank ever holds more than one unit unsharded.  Sources:

* :func:`from_safetensors` -- a ``.safetensors`` file, a folder of them, or an
  ``*.safetensors.index.json`` (the layout ``save_pretrained`` writes);
* :func:`from_init_fn` -- ``fn(module)`` run on each module that directly owns
  parameters, e.g. ``model._init_weights`` of a transformers model;
* a callable ``(name, tensor) -> None`` that fills ``tensor`` in place.

:func:`empty_model` builds any model with parameters on meta and real buffers
(rotary tables etc.); :func:`pretrained_on_meta` does it for a transformers
checkpoint folder and returns the matching safetensors source.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import tensor_file

__all__ = [
    "ParamSource",
    "empty_model",
    "from_safetensors",
    "from_init_fn",
    "pretrained_on_meta",
    "as_source",
    "record_source",
    "recorded_source",
]


class ParamSource:
    """Fills full-size parameter tensors of one unit."""

    def fill(self, owners: list[tuple[nn.Module, str, str, torch.Tensor]]) -> None:
        """``owners``: (module, attribute name, qualified name, empty full tensor) per parameter."""
        raise NotImplementedError


class _TensorFnSource(ParamSource):
    def __init__(self, fn: Callable[[str, torch.Tensor], None]) -> None:
        self.fn = fn

    def fill(self, owners) -> None:
        for _, _, name, full in owners:
            self.fn(name, full)


class _SafetensorsSource(ParamSource):
    def __init__(
        self, path: str | os.PathLike | list[Path], prefix_map: Callable[[str], list[str]] | None = None
    ) -> None:
        self.files = list(path) if isinstance(path, list) else _safetensors_files(Path(path))
        self.where: dict[str, tensor_file.TensorEntry] = {}
        for f in self.files:
            self.where.update(tensor_file.header(Path(f)))
        self.prefix_map = prefix_map or _candidate_keys

    def fill(self, owners) -> None:
        for module, attr, name, full in owners:
            key = next((k for k in self.prefix_map(name) if k in self.where), None)
            if key is None:
                raise KeyError(
                    f"zero_plugin: parameter {name!r} is not in {[str(f) for f in self.files]}; "
                    "the checkpoint does not match the model"
                )
            entry = self.where[key]
            if entry.shape != tuple(full.shape):
                raise ValueError(
                    f"zero_plugin: {key!r} in {entry.path} has shape {entry.shape}, "
                    f"the model expects {tuple(full.shape)}"
                )
            casts = _CASTS.get(module, {}).get(attr)
            if casts is None:
                tensor_file.read_into(entry, full)  # [Note: reading without a second copy]
            else:
                _read_through_casts(entry, full, casts)


def _read_through_casts(entry: tensor_file.TensorEntry, full: torch.Tensor, casts: list[torch.dtype]) -> None:
    """[Note: casts on meta]: read as loaded (``casts[0]``), then round through each later dtype, as eagerly."""
    value = torch.empty(full.shape, dtype=casts[0])
    tensor_file.read_into(entry, value)
    for dtype in casts[1:]:
        value = value.to(dtype)
    full.copy_(value)


class _InitFnSource(ParamSource):
    def __init__(self, fn: Callable[[nn.Module], None]) -> None:
        self.fn = fn

    def fill(self, owners) -> None:
        modules = {}
        for module, attr, _, full in owners:
            to_real(getattr(module, attr), full)
            modules[id(module)] = module
        for module in modules.values():
            self.fn(module)
        for module, attr, _, full in owners:
            data = getattr(module, attr).data
            if data.data_ptr() != full.data_ptr():
                full.copy_(data)


# PEFT's wrappers of a base module: LoRA's ``base_layer``, ``modules_to_save``'s copies of the original.
_PEFT_SEGMENTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def _candidate_keys(name: str) -> list[str]:
    # PEFT and task wrappers prefix names; checkpoints may or may not carry them.
    keys = [name]
    for prefix in ("base_model.model.", "module.", "_orig_mod."):
        if name.startswith(prefix):
            keys.append(name[len(prefix) :])
    return keys + [_PEFT_SEGMENTS.sub("", k) for k in keys]


def _safetensors_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"zero_plugin: no checkpoint at {path}")
    if path.is_file() and path.name.endswith(".json"):
        index = json.loads(path.read_text())
        return sorted({path.parent / f for f in index["weight_map"].values()})
    if path.is_file():
        return [path]
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        return _safetensors_files(index[0])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"zero_plugin: no *.safetensors files in {path}")
    return files


def from_safetensors(path: str | os.PathLike) -> ParamSource:
    return _SafetensorsSource(path)


def from_init_fn(fn: Callable[[nn.Module], None]) -> ParamSource:
    return _InitFnSource(fn)


def as_source(source) -> ParamSource | None:
    if source is None or isinstance(source, ParamSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        return from_safetensors(source)
    if callable(source):
        return _TensorFnSource(source)
    raise ValueError(f"zp.setup: param_source must be a path, a ParamSource or a callable; got {type(source).__name__}")


def empty_model(build: Callable[[], nn.Module]) -> nn.Module:
    """Run ``build()`` with parameters created on the meta device (buffers stay real)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    if hasattr(model, "tie_weights"):  # transformers models tie embeddings after init; on meta they come apart
        model.tie_weights()
    return model


def pretrained_on_meta(name_or_path: str | os.PathLike, **config_kwargs) -> tuple[nn.Module, ParamSource]:
    """A transformers causal LM from a local checkpoint folder, on meta, plus its weights as a source."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    model = empty_model(lambda: AutoModelForCausalLM.from_config(cfg))
    return model, from_safetensors(name_or_path)


# [Note: recorded sources] ``lazy_pretrained`` records, per module it built on meta, the files its
# parameters live in; ``zp.setup(model)`` without ``param_source`` finds them on ``model`` or on a module
# inside it (a PEFT or task wrapper), and maps the wrapper's names back to the module's own.  A record ends
# when the module is set up or loaded in full; ``on_release`` then runs (the lazy model's own hooks go).
_RECORDED: weakref.WeakKeyDictionary[nn.Module, list[Path]] = weakref.WeakKeyDictionary()
_ON_RELEASE: weakref.WeakKeyDictionary[nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()

# [Note: casts on meta] ``.half()`` / ``.to(dtype)`` of a meta parameter changes only its dtype: the eager
# model would have rounded its loaded values through every dtype on the way.  The dtypes a meta parameter
# passed through (the one it was loaded in first) are kept here and replayed on the values read for it, so
# ``model.to(torch.bfloat16).float()`` before setup trains on the same bf16-rounded weights as eagerly.
# Keyed by owning module and attribute: a parameter takes no weak reference (``to_real`` swaps it).
_CASTS: weakref.WeakKeyDictionary[nn.Module, dict[str, list[torch.dtype]]] = weakref.WeakKeyDictionary()


def record_source(module: nn.Module, files: list[Path], on_release: Callable[[], None] | None = None) -> None:
    """Remember that ``module``'s meta parameters are in the safetensors ``files``."""
    _RECORDED[module] = list(files)
    if on_release is not None:
        _ON_RELEASE[module] = on_release


def is_recorded(module: nn.Module) -> bool:
    """``module`` itself was loaded lazily and is neither set up nor loaded in full yet."""
    return module in _RECORDED


def note_cast(module: nn.Module, attr: str, old: torch.dtype, new: torch.dtype) -> None:
    """The meta parameter ``module.<attr>`` was cast from ``old`` to ``new`` ([Note: casts on meta])."""
    _CASTS.setdefault(module, {}).setdefault(attr, [old]).append(new)


def _release(module: nn.Module) -> None:
    _RECORDED.pop(module, None)
    release = _ON_RELEASE.pop(module, None)
    if release is not None:
        release()


_SET_UP = [False]


def recorded_source(model: nn.Module) -> ParamSource | None:
    """The files recorded for ``model`` or the first module inside it that has some, named as ``model`` names
    them; None when nothing was recorded."""
    for prefix, module in model.named_modules():
        files = _RECORDED.get(module)
        if files is not None:
            return _SafetensorsSource(files, _strip_prefix(prefix))
    return None


def note_set_up(model: nn.Module) -> None:
    """``zp.setup`` consumed ``model``'s recorded files (if any); see ``lazy_pretrained._why_not_lazy``."""
    _SET_UP[0] = True
    for module in model.modules():
        _release(module)


def any_set_up() -> bool:
    """True once ``zp.setup`` has run in this process."""
    return _SET_UP[0]


def _strip_prefix(prefix: str) -> Callable[[str], list[str]]:
    head = f"{prefix}." if prefix else ""

    def keys(name: str) -> list[str]:
        inner = name[len(head) :] if head and name.startswith(head) else name
        return list(dict.fromkeys([inner, _PEFT_SEGMENTS.sub("", inner)]))

    return keys


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def owners_of(model: nn.Module, params: list[nn.Parameter]) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, qualified name) of the first registration of each parameter."""
    wanted = {id(p) for p in params}
    found: dict[int, tuple[nn.Module, str, str]] = {}
    for mname, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if id(p) in wanted and id(p) not in found:
                found[id(p)] = (module, attr, f"{mname}.{attr}" if mname else attr)
    return [found[id(p)] for p in params]


@torch.no_grad()
def materialize_all(model: nn.Module, source: ParamSource | None, comm) -> None:
    """Stages 0-2 keep full parameters anyway: fill every meta parameter on rank 0 (then broadcast)."""
    meta = [p for p in model.parameters() if p.is_meta]
    if not meta:
        return
    if source is None:
        raise ValueError(
            f"zp.setup: parameter {owners_of(model, meta[:1])[0][2]!r} is on the meta device; pass "
            "param_source= so it can be materialised"
        )
    # Stages 0-2 compute on the device: NCCL broadcasts there (the CPU under gloo).
    device = comm.device if comm.device.type == "cuda" else None
    fulls = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in meta]
    if comm.rank == 0:
        source.fill([(m, a, n, f) for (m, a, n), f in zip(owners_of(model, meta), fulls)])
    for p, f in zip(meta, fulls):
        to_real(p, f)


@torch.no_grad()
def load_in_full(model: nn.Module) -> bool:
    """Fill the meta parameters of a lazily loaded model from its recorded files, in this process alone
    (a model nothing will shard, e.g. a frozen one prepared for evaluation); True when it filled any."""
    filled = load_params(model, list(model.parameters()))
    if filled:
        for module in model.modules():
            _release(module)
    return filled


@torch.no_grad()
def load_params(model: nn.Module, params: list[nn.Parameter]) -> bool:
    """Fill those of ``params`` still on meta from ``model``'s recorded files, in this process alone (the
    embedding a vocabulary resize is about to read); True when it filled any."""
    meta = list({id(p): p for p in params if p.is_meta}.values())
    source = recorded_source(model)
    if not meta or source is None:
        return False
    fulls = [torch.empty(p.shape, dtype=p.dtype) for p in meta]
    source.fill([(m, a, n, f) for (m, a, n), f in zip(owners_of(model, meta), fulls)])
    for p, f in zip(meta, fulls):
        to_real(p, f)
    return True


def to_real(param: nn.Parameter, full: torch.Tensor) -> None:
    """Give a meta parameter real storage while keeping its Python object (optimizer, PEFT, ties)."""
    torch.utils.swap_tensors(param, nn.Parameter(full, requires_grad=param.requires_grad))
