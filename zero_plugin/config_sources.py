"""``ZeroConfig``'s sources as text: config files (.yaml / .json, optionally under ``zero_plugin:``), the
``ZERO_PLUGIN_<FIELD>`` environment variables, and the text form of each field."""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from . import config_values as values

_TRUE_TEXT = frozenset({"true", "1", "yes", "on"})
_FALSE_TEXT = frozenset({"false", "0", "no", "off"})
_NONE_TEXT = frozenset({"none", "null", ""})
ENV_PREFIX = "ZERO_PLUGIN_"
ENV_CONFIG = "ZERO_PLUGIN_CONFIG"
ENV_ALIASES = {"ZERO_PLUGIN_OFFLOAD": "offload_optimizer"}
FILE_SECTION = "zero_plugin"


def check_known_keys(keys: Any, where: str, fields: tuple[str, ...]) -> None:
    unknown = [k for k in keys if k not in fields]
    if not unknown:
        return
    described = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), fields, n=1)
        described.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ValueError(f"{where}: unknown key(s) {', '.join(described)}; allowed: {', '.join(fields)}")


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


_BOOL = (_text_bool, '"true"/"false" (or 1/0, yes/no, on/off)')
_INT, _FLOAT = (int, "an integer"), (float, "a number")
_TEXT_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "stage": _INT,
    "prefetch_depth": _INT,
    "persistence_threshold": _INT,
    "linear_slice_numel": _INT,
    "trim_each_unit_above": _FLOAT,
    "bucket_size_mb": _FLOAT,
    "timeout_s": _FLOAT,
    "loss_scale_init": _FLOAT,
    "loss_scale_growth_interval": _INT,
    "offload_params": _BOOL,
    "reshard_after_forward": _BOOL,
    "accumulate_full_grads": _BOOL,
    "trim_host_heap": _BOOL,
    "debug_collectives": _BOOL,
    "cpu_ram_efficient_loading": _BOOL,
    "lazy_loading": _BOOL,
    "check_ranks": _BOOL,
    "state_dict_rank0_only": _BOOL,
    "offload_optimizer": (
        lambda t: _text_bool(t) if t.lower() in _TRUE_TEXT | _FALSE_TEXT else t,
        '"none", "cpu", "true" or "false"',
    ),
    "param_dtype": (_or_none(str), "a dtype name or none"),
    "reduce_dtype": (_or_none(str), "a dtype name or none"),
    "unit_classes": (lambda t: [c.strip() for c in t.split(",") if c.strip()], "comma-separated class names"),
    "unit_policy": (_or_none(_text_import), "an importable qualified name or none"),
    "clip_grad_norm": (_or_none(float), "a number or none"),
    "loss_scaling": (_or_none(_text_bool), '"true", "false" or none'),
    "loss_scale": (lambda t: "dynamic" if t.lower() == "dynamic" else float(t), '"dynamic" or a number'),
    "shard_group_size": (_or_none(lambda t: "node" if t.lower() == "node" else int(t)), '"node", an integer or none'),
    "secondary_shard_size": (
        _or_none(lambda t: "node" if t.lower() == "node" else int(t)),
        '"node", an integer or none',
    ),
    "quantized_weights": _BOOL,
    "quantized_gradients": _BOOL,
    "quantization_block": _INT,
}


def parse_text(field: str, text: str) -> Any:
    if field not in _TEXT_PARSERS:
        return text  # master_dtype: the constructor parses dtype names itself.
    parse, allowed = _TEXT_PARSERS[field]
    try:
        return parse(text.strip())
    except (ValueError, ImportError, AttributeError) as exc:
        raise values.error(field, f"{allowed} when given as text", text) from exc


def read_config_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(
            f"ZeroConfig.from_file: {str(path)!r} must end in .yaml, .yml or .json; "
            f"got {path.suffix or 'no extension'!r}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"ZeroConfig.from_file: no such file: {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"ZeroConfig.from_file: cannot parse {str(path)!r}: {exc}") from exc
    if isinstance(data, Mapping) and FILE_SECTION in data:
        data = data[FILE_SECTION]
    data = {} if data is None else data  # an empty file or section means all defaults
    if not isinstance(data, Mapping):
        raise ValueError(
            f"ZeroConfig.from_file: {str(path)!r} must hold a mapping of ZeroConfig fields "
            f"(top level or under '{FILE_SECTION}:'); got {type(data).__name__}"
        )
    return dict(data)


def env_overrides(env: Mapping[str, str], fields: tuple[str, ...]) -> dict[str, str]:
    """{variable: field} for every set, non-empty ZERO_PLUGIN_<FIELD> variable (upper case only)."""
    overrides: dict[str, str] = {}
    for var in sorted(env):
        suffix = var[len(ENV_PREFIX) :]
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG or not env[var]:
            continue
        field = ENV_ALIASES.get(var) or (suffix.lower() if suffix.isupper() else None)
        if field not in fields:
            continue  # other ZERO_PLUGIN_* variables belong to the launcher and integrations
        clash = [other for other, f in overrides.items() if f == field]
        if clash:
            raise ValueError(
                f"{clash[0]} and {var} both set ZeroConfig.{field}; got "
                f"{env[clash[0]]!r} and {env[var]!r}; set only one"
            )
        overrides[var] = field
    return overrides
