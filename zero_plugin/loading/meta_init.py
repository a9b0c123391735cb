"""Build a model with parameters on the meta device, then initialise it module by module.

:func:`meta_parameters` is the construction side: inside it every parameter a module
registers is replaced by a meta tensor of the same shape, dtype and ``requires_grad``,
while buffers stay real (rotary tables, position ids computed in ``__init__`` keep their
values).  It uses torch's module parameter-registration hook, no patching of torch.

:class:`ModuleInitSource` is the fill side, a :class:`~zero_plugin.loading.materialize.ParamSource`
for ``zp.setup(..., param_source=...)``: stage 3 materialises one unit at a time, and for each
module owning parameters of that unit it runs the module's own initialisation.

[Note: meta ties]
A parameter registered while it is already on meta is kept as it is, so ``b.weight = a.weight``
(a tied LM head, transformers' ``tie_weights``) registers the same object twice and the tie
survives; accelerate's ``init_empty_weights`` wraps it in a new Parameter and unties it.

[Note: which init]
The initialisation of a module is what eager construction would have run on it, in this order:
  1. a PEFT LoRA adapter (``lora_A`` / ``lora_B`` of a tuner layer): the layer's
     ``reset_lora_parameters(adapter, init_lora_weights)`` with the adapter's config value
     (True or "gaussian"; other schemes read the base weights and cannot run per unit);
  2. a module inside a transformers ``PreTrainedModel``: the innermost such model's
     ``_init_weights(module)`` (what ``post_init`` applies; ``nn.Linear.reset_parameters``
     would draw kaiming instead of ``normal(0, initializer_range)``);
  3. the module's own ``reset_parameters()`` (every torch layer; Lightning's FSDP rule).
A module with meta parameters and none of these is refused before any rank materialises
anything (:func:`check_initialisable`), naming the module and the fixes.
Random values come from rank 0's generator, drawn unit by unit (zp.setup broadcasts them), so
they are deterministic for a given seed but not the values eager construction draws, which
runs the modules in construction order: pass a safetensors ``param_source`` for exact weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils._python_dispatch import TorchDispatchMode

from .materialize import ParamSource, _candidate_keys, _SafetensorsSource, to_real

__all__ = ["meta_parameters", "ModuleInitSource", "check_initialisable", "has_meta_buffers", "safetensors_under"]

_LORA_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
_PEFT_INITS = (True, False, "gaussian")


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.is_meta:  # [Note: meta ties]
        return None
    meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    return meta


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Parameters registered inside are created on the meta device; buffers stay real."""
    handle = register_module_parameter_registration_hook(_to_meta)
    try:
        yield
    finally:
        handle.remove()


def has_meta_buffers(model: nn.Module) -> str | None:
    """The name of the first buffer on meta, or None."""
    return next((name for name, b in model.named_buffers() if b.is_meta), None)


# -- which init runs on a module ([Note: which init]) -------------------------------------------------
def _ancestors(root: nn.Module) -> dict[int, tuple[str, list[tuple[str, nn.Module]]]]:
    """id(module) -> (qualified name, [(child attribute, ancestor)] from the root down)."""
    out: dict[int, tuple[str, list[tuple[str, nn.Module]]]] = {id(root): ("", [])}

    def visit(module: nn.Module, prefix: str, chain: list[tuple[str, nn.Module]]) -> None:
        for cname, child in module.named_children():
            if id(child) in out:
                continue
            qual = f"{prefix}.{cname}" if prefix else cname
            out[id(child)] = (qual, chain + [(cname, module)])
            visit(child, qual, chain + [(cname, module)])

    visit(root, "", [])
    return out


def _peft_init(module: nn.Module, chain: list[tuple[str, nn.Module]]):
    """(key, fn) for a LoRA adapter (``tuner.lora_A[adapter]``, or a ``lora_embedding_A`` ParameterDict)."""
    for depth in (len(chain) - 1, len(chain) - 2):
        if depth < 0:
            continue
        attr, tuner = chain[depth]
        if attr in _LORA_DICTS and callable(getattr(tuner, "reset_lora_parameters", None)):
            names = [chain[depth + 1][0]] if depth + 1 < len(chain) else list(module.keys())
            return _lora_reset(chain, tuner, names)
    return None


def _lora_reset(chain: list[tuple[str, nn.Module]], tuner: nn.Module, names: list[str]):
    configs = next((m.peft_config for _, m in reversed(chain) if isinstance(getattr(m, "peft_config", None), dict)), {})
    inits = {n: getattr(configs.get(n), "init_lora_weights", True) for n in names}
    bad = [v for v in inits.values() if v not in _PEFT_INITS]
    if bad:
        return (
            "error",
            f"LoRA init_lora_weights={bad[0]!r} reads the base weights, which are not materialised when the adapter is",
        )

    def reset() -> None:
        for n in names:
            tuner.reset_lora_parameters(n, inits[n])

    return ((id(tuner), tuple(names)), reset)


def _transformers_init(module: nn.Module, chain: list[tuple[str, nn.Module]]):
    """The innermost enclosing PreTrainedModel's ``_init_weights`` (``module`` itself included)."""
    for candidate in [module] + [parent for _, parent in reversed(chain)]:
        init = getattr(candidate, "_init_weights", None)
        if callable(init) and hasattr(candidate, "config"):
            return ((id(module), "hf"), lambda: init(module))  # noqa: B023 (returned in the same iteration)
    return None


def initialiser(root: nn.Module, module: nn.Module, where=None):
    """(dedup key, zero-argument init) for ``module``; ("error", reason) or None when there is none."""
    where = where or _ancestors(root)
    _, chain = where[id(module)]
    found = _peft_init(module, chain)
    if found is None:
        found = _transformers_init(module, chain)
    if found is None and callable(getattr(module, "reset_parameters", None)):
        found = ((id(module), "reset"), module.reset_parameters)
    return found


class _Writes(TorchDispatchMode):
    """Records the storages that in-place / out= ops write (a dry run of an init on meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg, value in zip(
            func._schema.arguments, list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args) :]]
        ):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self.written.add(value.untyped_storage()._cdata)
        return func(*args, **kwargs)


def _uninitialised(module: nn.Module, fn) -> list[str]:
    """The meta parameters of ``module`` that ``fn`` leaves unwritten, found by running it on meta."""
    meta = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta]
    with _Writes() as writes, torch.no_grad():
        fn()
    return [n for n, p in meta if p.untyped_storage()._cdata not in writes.written]


def check_initialisable(root: nn.Module) -> None:
    """Raise ValueError, on every rank alike, if some module's meta parameters have no init ([Note: which init]).

    Each init is dry-run on the meta parameters (no values, no random draws): an init that exists but
    leaves a parameter unwritten (transformers' ``_init_weights`` skips module types it does not know)
    is refused as well.
    """
    where = _ancestors(root)
    for module in root.modules():
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            continue
        found = initialiser(root, module, where)
        reason = None
        if found is None:
            reason = (
                f"{type(module).__name__} has no reset_parameters() and is not inside a transformers "
                "PreTrainedModel (_init_weights)"
            )
        elif found[0] == "error":
            reason = found[1]
        else:
            missed = _uninitialised(module, found[1])
            if missed:
                reason = f"its init ({_describe(found)}) does not write {missed}"
        if reason is not None:
            name = where[id(module)][0] or "<root>"
            raise ValueError(
                f"zero_plugin: module {name!r} ({type(module).__name__}) has parameters on the meta device and "
                f"no way to initialise them: {reason}. Fix one of: give {type(module).__name__} a "
                "reset_parameters() method that initialises its own parameters; pass the weights with "
                "ZeroStrategy(..., param_source='<model>.safetensors or folder'); or build the module with real "
                "parameters (trainer.init_module(empty_init=False) / fabric.init_module(empty_init=False), or "
                "ZeroStrategy(..., meta_init=False) for configure_model)"
            )


def _describe(found) -> str:
    kind = found[0][1] if isinstance(found[0][1], str) else "reset_lora_parameters"
    return {"hf": "the transformers model's _init_weights", "reset": "reset_parameters()"}.get(kind, kind)


class ModuleInitSource(ParamSource):
    """Fills a unit's parameters by running each owning module's own init ([Note: which init])."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._where = _ancestors(root)

    @torch.no_grad()
    def fill(self, owners) -> None:
        inits: dict = {}
        for module, attr, _, full in owners:
            full.zero_()  # a parameter its module's init leaves alone is zero, not uninitialised memory
            to_real(getattr(module, attr), full)
        for module, _, _, _ in owners:
            key, fn = initialiser(self.root, module, self._where)
            inits.setdefault(key, fn)
        for fn in inits.values():
            fn()
        for module, attr, _, full in owners:
            data = getattr(module, attr).data
            if data.data_ptr() != full.data_ptr():  # an init that rebinds .data instead of writing in place
                full.copy_(data)


def _suffix_keys(name: str) -> list[str]:
    """The name, then without each leading component in turn: a LightningModule holds the model under an
    attribute (``self.net``) whose name the checkpoint, saved from the model itself, does not carry."""
    parts = name.split(".")
    return [k for i in range(len(parts)) for k in _candidate_keys(".".join(parts[i:]))]


def safetensors_under(path) -> ParamSource:
    """``zp.materialize.from_safetensors`` that also finds a parameter's key with its wrapper's prefixes removed."""
    return _SafetensorsSource(path, prefix_map=_suffix_keys)
