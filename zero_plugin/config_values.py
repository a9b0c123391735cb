"""The value checks of ``ZeroConfig``'s fields: each coerces a value (a dtype name to a ``torch.dtype``, a list to a
tuple) or raises a ``ValueError`` naming the field, what it allows and what it got."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import torch

DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def error(field: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"ZeroConfig.{field} must be {allowed}; got {value!r}")


def qualname(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{obj.__module__}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def as_int(field: str, value: Any, lo: int, hi: int | None = None, allowed: str | None = None) -> int:
    # bool subclasses int, but stage=True is always a mistake.
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < lo or (hi is not None and value > hi):
        raise error(field, allowed or (f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"), value)
    return int(value)


def as_positive_float(field: str, value: Any, hi: float = math.inf, allowed: str | None = None) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 < value <= hi:
        bound = "" if hi == math.inf else f" and <= {hi:g}"
        raise error(field, allowed or f"a finite number > 0{bound}", value)
    return float(value)


def as_nonnegative_float(field: str, value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise error(field, "a finite number >= 0", value)
    return float(value)


def as_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise error(field, "a bool (True or False)", value)
    return value


def as_dtype(field: str, value: Any, allowed: tuple[torch.dtype, ...] = tuple(DTYPE_SHORT)) -> torch.dtype:
    dtype = DTYPE_NAMES.get(value.strip().lower()) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = ", ".join(DTYPE_SHORT[d] for d in allowed)
        raise error(field, f"one of {names} (a floating torch.dtype or its name)", value)
    return dtype


def as_offload(value: Any) -> str:
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    if isinstance(value, str) and value.strip().lower() in ("none", "cpu"):
        return value.strip().lower()
    raise error("offload_optimizer", '"none" or "cpu" (or None, True, False)', value)


def as_unit_classes(value: Any) -> tuple:
    if isinstance(value, (str, type)):
        value = (value,)
    if isinstance(value, (set, frozenset)):
        # Set order follows id-based hashes and differs between processes;
        # sorting keeps fingerprints equal across ranks.
        value = sorted(value, key=qualname)
    if not isinstance(value, (tuple, list)):
        raise error("unit_classes", "a tuple, list or set of nn.Module subclasses or class names", value)
    for entry in value:
        is_module_class = isinstance(entry, type) and issubclass(entry, torch.nn.Module)
        if not (is_module_class or (isinstance(entry, str) and entry.strip())):
            raise error("unit_classes", "entries that are nn.Module subclasses or non-empty class names", entry)
    return tuple(e.strip() if isinstance(e, str) else e for e in value)


def as_unit_policy(value: Any) -> Callable[[torch.nn.Module, str], bool] | None:
    # A class is callable too; passing one here almost always meant unit_classes.
    if value is not None and (isinstance(value, type) or not callable(value)):
        allowed = "a callable (module, qualified_name) -> bool, or None (classes go in unit_classes)"
        raise error("unit_policy", allowed, value)
    return value


def as_group_size(field: str, value: Any) -> int | str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "node"):
        return None if value is None else "node"
    return as_int(field, value, 1, allowed='None, "node" or an int >= 1 dividing the world size')


def as_loss_scale(value: Any) -> str | float:
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    return as_positive_float("loss_scale", value, allowed='"dynamic" or a finite number > 0')
