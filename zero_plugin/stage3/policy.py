"""Which modules are stage-3 units, and which unit owns each parameter.

Default: one unit per instance of the model's ``_no_split_modules`` classes
(transformers decoder layers), found on the model or any submodule (PEFT
wraps the transformers model).  Parameters outside every unit, and
parameters shared by modules of different units (tied embedding and LM
head), belong to the root unit, which is gathered for the whole forward.
"""
from __future__ import annotations

from torch import nn

from ..config import ZeroConfig

__all__ = ["assign_units"]


def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if value:
            names.update(str(v) for v in value)
    return names


def _matcher(model: nn.Module, config: ZeroConfig):
    if config.unit_policy is not None:
        return config.unit_policy
    wanted = config.unit_classes or tuple(_no_split_names(model))
    types = tuple(c for c in wanted if isinstance(c, type))
    names = {c for c in wanted if isinstance(c, str)}

    def match(module: nn.Module, qualname: str) -> bool:
        cls = type(module)
        return isinstance(module, types) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return match


def assign_units(model: nn.Module, config: ZeroConfig) -> tuple[list[tuple[str, nn.Module]], dict[int, int]]:
    """Return the unit modules (index 0 is the root) and a map id(param) -> unit index."""
    match = _matcher(model, config)
    units: list[tuple[str, nn.Module]] = [("<root>", model)]
    unit_of_module: dict[int, int] = {id(model): 0}
    owner: dict[int, int] = {}

    def visit(module: nn.Module, prefix: str, current: int) -> None:
        for pname, p in module.named_parameters(recurse=False):
            if p is None:
                continue
            previous = owner.get(id(p))
            owner[id(p)] = current if previous in (None, current) else 0
        for cname, child in module.named_children():
            qual = f"{prefix}.{cname}" if prefix else cname
            index = current
            if id(child) in unit_of_module:
                index = unit_of_module[id(child)]
            elif match(child, qual):
                units.append((qual, child))
                index = unit_of_module[id(child)] = len(units) - 1
            visit(child, qual, index)

    visit(model, "", 0)
    return units, owner
