"""Lightning integration: importing this module registers the ZeRO strategy names.

    import zero_plugin.integrations.lightning            # registers zero1, zero2, zero2_offload, zero3, zero3_offload
    trainer = lightning.pytorch.Trainer(strategy="zero3")
    fabric = lightning.fabric.Fabric(strategy="zero3")
    trainer = Trainer(strategy=ZeroStrategy(config=zp.ZeroConfig(stage=3, prefetch_depth=2), checkpoint="full"))

The names are registered for the unified ``lightning`` package and, when installed, for the
standalone ``pytorch_lightning`` / ``lightning_fabric`` packages, whose strategy base classes
are distinct: their classes are class statements with the same method mixins over those packages' bases, in
``lightning/pytorch_lightning.py`` / ``lightning/lightning_fabric.py`` (importable directly:
``from zero_plugin.integrations.lightning.pytorch_lightning import ZeroStrategy``); see
[Note: one strategy source, two Lightning packages] in ``lightning/names.py``.

``register_strategies()`` is for launchers (``python -m zero_plugin.run``): with the names
registered, ``PL_TRAINER_STRATEGY=zero3`` selects ZeRO in a script whose Trainer does not pass
``strategy=`` itself.  Note that Lightning's own launcher re-runs ``sys.argv`` for ranks > 0, so
a launcher that registers the names must also start the ranks itself (torchrun-style, setting
``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), or the re-run ranks will not know them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Iterable

from . import common
from .fabric import ZeroFabricStrategy
from .strategy import (
    ZeroModelSummary,
    ZeroPrecision,
    ZeroRichModelSummary,
    ZeroStrategy,
    ZeroSummary,
)

__all__ = [
    "ZeroStrategy",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroSummary",
    "ZeroModelSummary",
    "ZeroRichModelSummary",
    "PRESETS",
    "register_strategies",
    "standalone_strategies",
]

PRESETS = common.PRESETS

# standalone package -> (the module that defines its strategy class, that class's name)
_STANDALONE = {
    "pytorch_lightning": (f"{__package__}.pytorch_lightning", "ZeroStrategy"),
    "lightning_fabric": (f"{__package__}.lightning_fabric", "ZeroFabricStrategy"),
}


def standalone_strategies(packages: Iterable[str] = tuple(_STANDALONE)) -> dict[str, type]:
    """``{"pytorch_lightning": ZeroStrategy, "lightning_fabric": ZeroFabricStrategy}`` for the installed ones."""
    out = {}
    for package in packages:
        module, name = _STANDALONE[package]
        if importlib.util.find_spec(package) is not None:
            out[package] = getattr(importlib.import_module(module), name)
    return out


def register_strategies(packages: Iterable[str] | None = None) -> None:
    """Register the preset names with Lightning's strategy registries (idempotent).

    ``packages``: any of ``"lightning"`` (Trainer and Fabric), ``"pytorch_lightning"``, ``"lightning_fabric"``;
    None = every installed one.  A launcher that knows which one the script imports can skip the others.
    """
    packages = ("lightning", *_STANDALONE) if packages is None else tuple(packages)
    unknown = [p for p in packages if p != "lightning" and p not in _STANDALONE]
    if unknown:
        raise ValueError(
            f"register_strategies: unknown package(s) {unknown}; choose from {['lightning', *_STANDALONE]}"
        )
    if "lightning" in packages:
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry

        ZeroStrategy.register_strategies(StrategyRegistry)
        ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    for package, cls in standalone_strategies([p for p in packages if p in _STANDALONE]).items():
        registry_module = importlib.import_module(f"{package}.strategies")
        registry = getattr(registry_module, "StrategyRegistry", None) or registry_module.STRATEGY_REGISTRY
        cls.register_strategies(registry)


register_strategies()
