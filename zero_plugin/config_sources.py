"""``ZeroConfig``'s sources: config files (.yaml / .json, optionally under ``zero_plugin:``), the
``ZERO_PLUGIN_<FIELD>`` environment variables, and unknown keys refused with a did-you-mean.  The text form of
each field is its kind's (``config_values.py``)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Mapping

import yaml

ENV_PREFIX = "ZERO_PLUGIN_"
ENV_CONFIG = "ZERO_PLUGIN_CONFIG"
ENV_ALIASES = {"ZERO_PLUGIN_OFFLOAD": "offload_optimizer"}
FILE_SECTION = "zero_plugin"


def check_known_keys(keys: Any, where: str, fields: tuple[str, ...], error: type[Exception] = ValueError) -> None:
    """Refuse keys not in ``fields``, suggesting the closest allowed name and listing them all."""
    unknown = [k for k in keys if k not in fields]
    if not unknown:
        return
    described = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), fields, n=1)
        described.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise error(f"{where}: unknown key(s) {', '.join(described)}; allowed: {', '.join(fields)}")


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
