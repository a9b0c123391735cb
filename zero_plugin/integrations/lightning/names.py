"""The Lightning names the ZeRO strategies are built from, for either distribution of Lightning.

[Note: one strategy source, two Lightning packages]
Lightning ships the same code as the unified ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``)
and as the standalone ``pytorch_lightning`` / ``lightning_fabric``, whose classes are distinct: a strategy must
subclass the ``ParallelStrategy`` of the package the user's Trainer or Fabric comes from.  So the strategies'
methods are written once, in mixins that reach Lightning only through ``self._lightning`` (the
:class:`LightningNames` loaded from one package), and a factory per strategy
(``strategy.make_trainer_classes``, ``fabric.make_fabric_strategy``) puts the mixin over that
package's base classes, once per package (cached).  Nothing rewrites or re-executes source: the unified
package's classes are built when ``strategy`` / ``fabric`` are imported, the standalone
packages' by the two-line modules ``pytorch_lightning`` / ``lightning_fabric``.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

__all__ = ["LightningNames", "fabric_names", "trainer_names"]


class LightningNames(SimpleNamespace):
    """The names below, loaded from one package, as attributes; ``package`` is its name (and, for the Trainer's,
    ``fabric`` the :class:`LightningNames` of its Fabric)."""


# Shared by both packages (the plugins Lightning's precision flags choose; see SUPPORTED_PRECISIONS).
_PRECISIONS = {
    name: f"plugins.precision.{name}" for name in ("Precision", "DoublePrecision", "HalfPrecision", "MixedPrecision")
}
_COMMON = {
    **_PRECISIONS,
    "ParallelStrategy": "strategies.parallel.ParallelStrategy",
    "SubprocessScriptLauncher": "strategies.launchers.subprocess_script._SubprocessScriptLauncher",
    "rank_zero_info": "utilities.rank_zero.rank_zero_info",
}
# What both strategies use from lightning.fabric / lightning_fabric.
_FABRIC_PATHS = {
    **_COMMON,
    "BackwardSyncControl": "strategies.strategy._BackwardSyncControl",
    "Stateful": "utilities.types._Stateful",
    "validate_keys_for_strict_loading": "strategies.strategy._validate_keys_for_strict_loading",
    "distributed_is_initialized": "utilities.distributed._distributed_is_initialized",
    "default_process_group_backend_for_device": "utilities.distributed._get_default_process_group_backend_for_device",
    "init_dist_connection": "utilities.distributed._init_dist_connection",
    "sync_ddp_if_available": "utilities.distributed._sync_ddp_if_available",
    "group": "utilities.distributed.group",
    "reset_seed": "utilities.seed.reset_seed",
    "rank_zero_only": "utilities.rank_zero.rank_zero_only",
}
# What the Trainer strategy uses from lightning.pytorch / pytorch_lightning.
_TRAINER_PATHS = {
    **_COMMON,
    "LightningModule": "LightningModule",
    "TrainerFn": "trainer.states.TrainerFn",
    "MisconfigurationException": "utilities.exceptions.MisconfigurationException",
    "LayerSummary": "utilities.model_summary.model_summary.LayerSummary",
    "Summary": "utilities.model_summary.model_summary.ModelSummary",
    "ModelSummary": "callbacks.ModelSummary",
    "RichModelSummary": "callbacks.RichModelSummary",
}


def _load(package: str, paths: dict[str, str], **extra: Any) -> LightningNames:
    def attr(path: str) -> Any:
        module, _, name = f"{package}.{path}".rpartition(".")
        return getattr(importlib.import_module(module), name)

    return LightningNames(package=package, **{field: attr(path) for field, path in paths.items()}, **extra)


@functools.cache
def fabric_names(package: str = "lightning.fabric") -> LightningNames:
    return _load(package, _FABRIC_PATHS)


@functools.cache
def trainer_names(package: str = "lightning.pytorch", fabric: str = "lightning.fabric") -> LightningNames:
    return _load(package, _TRAINER_PATHS, fabric=fabric_names(fabric))
