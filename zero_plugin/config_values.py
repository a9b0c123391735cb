"""The kinds of value a ``ZeroConfig`` field holds.  A :class:`Kind` checks a value (coercing it: a dtype name to a
``torch.dtype``, a list to a tuple, or raising a ``ValueError`` naming the field, what it allows and what it got),
reads the field's text form (YAML strings, ``ZERO_PLUGIN_*`` variables) and writes its JSON/YAML-safe form
(``to_dict``).  Each field names its kind where it is declared (``config_groups.py``); a new kind goes here."""

from __future__ import annotations

import dataclasses
import importlib
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
_TRUE_TEXT = frozenset({"true", "1", "yes", "on"})
_FALSE_TEXT = frozenset({"false", "0", "no", "off"})
_NONE_TEXT = frozenset({"none", "null", ""})


def error(field: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"ZeroConfig.{field} must be {allowed}; got {value!r}")


def qualname(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{obj.__module__}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one field accepts.  ``check(field, value)`` returns the canonical value or raises :func:`error`;
    ``parse(text)`` reads the text form, described by ``text`` in errors (the default hands the text to ``check``,
    which then parses it itself, as dtype names); ``plain(value)`` is the JSON/YAML-safe form."""

    check: Callable[[str, Any], Any]
    parse: Callable[[str], Any] = _same
    text: str = "text"
    plain: Callable[[Any], Any] = _same

    def from_text(self, field: str, text: str) -> Any:
        try:
            return self.parse(text.strip())
        except (ValueError, ImportError, AttributeError) as exc:
            raise error(field, f"{self.text} when given as text", text) from exc


# --------------------------------------------------------------------- value checks


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


def as_offload(field: str, value: Any) -> str:
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    if isinstance(value, str) and value.strip().lower() in ("none", "cpu"):
        return value.strip().lower()
    raise error(field, '"none" or "cpu" (or None, True, False)', value)


PARTITIONS = ("auto", "elements", "parameters")


def as_partition(field: str, value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in PARTITIONS:
        return value.strip().lower()
    raise error(field, '"auto", "elements" or "parameters"', value)


def as_unit_classes(field: str, value: Any) -> tuple:
    if isinstance(value, (str, type)):
        value = (value,)
    if isinstance(value, (set, frozenset)):
        # Set order follows id-based hashes and differs between processes;
        # sorting keeps fingerprints equal across ranks.
        value = sorted(value, key=qualname)
    if not isinstance(value, (tuple, list)):
        raise error(field, "a tuple, list or set of nn.Module subclasses or class names", value)
    for entry in value:
        is_module_class = isinstance(entry, type) and issubclass(entry, torch.nn.Module)
        if not (is_module_class or (isinstance(entry, str) and entry.strip())):
            raise error(field, "entries that are nn.Module subclasses or non-empty class names", entry)
    return tuple(e.strip() if isinstance(e, str) else e for e in value)


def as_unit_policy(field: str, value: Any) -> Callable[[torch.nn.Module, str], bool] | None:
    # A class is callable too; passing one here almost always meant unit_classes.
    if value is not None and (isinstance(value, type) or not callable(value)):
        raise error(field, "a callable (module, qualified_name) -> bool, or None (classes go in unit_classes)", value)
    return value


def as_group_size(field: str, value: Any) -> int | str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "node"):
        return None if value is None else "node"
    return as_int(field, value, 1, allowed='None, "node" or an int >= 1 dividing the world size')


def as_loss_scale(field: str, value: Any) -> str | float:
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    return as_positive_float(field, value, allowed='"dynamic" or a finite number > 0')


def as_optional_bool(field: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise error(field, "True, False or None", value)
    return value


# --------------------------------------------------------------------- text forms


def _text_bool(text: str) -> bool:
    if text.lower() not in _TRUE_TEXT | _FALSE_TEXT:
        raise ValueError(text)
    return text.lower() in _TRUE_TEXT


def _text_import(path: str) -> Any:
    """Resolve "pkg.module.attr.sub" by importing the longest importable module prefix."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except (ImportError, ValueError):
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text.lower() in _NONE_TEXT else parse(text)


def _text_group_size(text: str) -> int | str:
    return "node" if text.lower() == "node" else int(text)


# --------------------------------------------------------------------- the kinds

BOOL = Kind(as_bool, _text_bool, '"true"/"false" (or 1/0, yes/no, on/off)')
OPTIONAL_BOOL = Kind(as_optional_bool, _or_none(_text_bool), '"true", "false" or none')
NONNEGATIVE = Kind(as_nonnegative_float, float, "a number")
OFFLOAD = Kind(
    as_offload,
    lambda t: _text_bool(t) if t.lower() in _TRUE_TEXT | _FALSE_TEXT else t,
    '"none", "cpu", "true" or "false"',
)
PARTITION = Kind(as_partition)
GROUP_SIZE = Kind(as_group_size, _or_none(_text_group_size), '"node", an integer or none')
LOSS_SCALE = Kind(as_loss_scale, lambda t: "dynamic" if t.lower() == "dynamic" else float(t), '"dynamic" or a number')
UNIT_CLASSES = Kind(
    as_unit_classes,
    lambda t: [c.strip() for c in t.split(",") if c.strip()],
    "comma-separated class names",
    lambda classes: [qualname(c) for c in classes],
)
UNIT_POLICY = Kind(
    as_unit_policy,
    _or_none(_text_import),
    "an importable qualified name or none",
    lambda policy: None if policy is None else qualname(policy),
)


def integer(lo: int, hi: int | None = None, allowed: str | None = None) -> Kind:
    """An int in [lo, hi] (hi None: no upper bound)."""
    return Kind(lambda field, value: as_int(field, value, lo, hi, allowed), int, "an integer")


def positive(hi: float = math.inf, optional: bool = False) -> Kind:
    """A finite float in (0, hi]; with ``optional``, None too."""
    if optional:
        return Kind(
            lambda field, value: None if value is None else as_positive_float(field, value, hi),
            _or_none(float),
            "a number or none",
        )
    return Kind(lambda field, value: as_positive_float(field, value, hi), float, "a number")


def dtype(allowed: tuple[torch.dtype, ...] = tuple(DTYPE_SHORT), optional: bool = False) -> Kind:
    """A floating ``torch.dtype`` among ``allowed``, or its name; with ``optional``, None too."""
    if optional:
        return Kind(
            lambda field, value: None if value is None else as_dtype(field, value, allowed),
            _or_none(str),
            "a dtype name or none",
            lambda value: None if value is None else DTYPE_SHORT[value],
        )
    return Kind(lambda field, value: as_dtype(field, value, allowed), plain=DTYPE_SHORT.__getitem__)
