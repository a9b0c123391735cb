"""The Lightning names the ZeRO strategies' methods use, loaded from either distribution of Lightning.

[Note: one strategy source, two Lightning packages]
Lightning ships the same code as the unified ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``)
and as the standalone ``pytorch_lightning`` / ``lightning_fabric``, whose classes are distinct: a strategy must
subclass the ``ParallelStrategy`` of the package the user's Trainer or Fabric comes from.  So every public class
is a plain ``class`` statement per package -- ``class ZeroStrategy(_ZeroStrategyMethods, pl.strategies.ParallelStrategy)``
in ``strategy.py`` over ``lightning.pytorch`` and again in ``pytorch_lightning.py`` over ``pytorch_lightning``
(likewise ``fabric.py`` / ``lightning_fabric.py``) -- and its methods are written once, in the mixin
(``_ZeroStrategyMethods``, ...) it puts first.  A mixin reaches Lightning only through its class's
``_trainer_names`` / ``_fabric_names`` (a :class:`LightningNames` loaded here from that class's package) and its
sibling classes of the same package through class attributes (``_precision_class``, ``_summary_callbacks``, ...),
all set in the class statement.  Nothing builds classes at run time or rewrites source: the unified package's
classes are defined when ``strategy`` / ``fabric`` are imported, the standalone packages' when
``pytorch_lightning`` / ``lightning_fabric`` are (``zero_plugin.integrations.lightning`` does so when those
packages are installed).
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

__all__ = ["LightningNames", "fabric_names", "trainer_names"]


class LightningNames(SimpleNamespace):
    """The names below, loaded from one package, as attributes; ``package`` is its name and ``precision_plugins``
    the tuple of Lightning's own precision plugin classes the strategies accept."""


# Shared by both packages (the plugins Lightning's precision flags choose; see SUPPORTED_PRECISIONS).
_PRECISIONS = {
    name: f"plugins.precision.{name}" for name in ("Precision", "DoublePrecision", "HalfPrecision", "MixedPrecision")
}
_COMMON = {
    **_PRECISIONS,
    "SubprocessScriptLauncher": "strategies.launchers.subprocess_script._SubprocessScriptLauncher",
}
# What both strategies use from lightning.fabric / lightning_fabric (ZeroProcesses and the Fabric strategy).
_FABRIC_PATHS = {
    **_COMMON,
    "Stateful": "utilities.types._Stateful",
    "validate_keys_for_strict_loading": "strategies.strategy._validate_keys_for_strict_loading",
    "distributed_is_initialized": "utilities.distributed._distributed_is_initialized",
    "default_process_group_backend_for_device": "utilities.distributed._get_default_process_group_backend_for_device",
    "init_dist_connection": "utilities.distributed._init_dist_connection",
    "sync_ddp_if_available": "utilities.distributed._sync_ddp_if_available",
    "group": "utilities.distributed.group",
    "reset_seed": "utilities.seed.reset_seed",
    "rank_zero_only": "utilities.rank_zero.rank_zero_only",
    "rank_zero_info": "utilities.rank_zero.rank_zero_info",
}
# What the Trainer strategy's methods use from lightning.pytorch / pytorch_lightning.
_TRAINER_PATHS = {
    **_COMMON,
    "LightningModule": "LightningModule",
    "TrainerFn": "trainer.states.TrainerFn",
    "MisconfigurationException": "utilities.exceptions.MisconfigurationException",
}


def _load(package: str, paths: dict[str, str]) -> LightningNames:
    def attr(path: str) -> Any:
        module, _, name = f"{package}.{path}".rpartition(".")
        return getattr(importlib.import_module(module), name)

    names = {field: attr(path) for field, path in paths.items()}
    return LightningNames(package=package, precision_plugins=tuple(names[p] for p in _PRECISIONS), **names)


@functools.cache
def fabric_names(package: str = "lightning.fabric") -> LightningNames:
    return _load(package, _FABRIC_PATHS)


@functools.cache
def trainer_names(package: str = "lightning.pytorch") -> LightningNames:
    return _load(package, _TRAINER_PATHS)
