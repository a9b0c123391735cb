"""The Fabric strategy for the standalone ``lightning_fabric`` package: the class statements of
``lightning/fabric.py``, with the same method mixins, over ``lightning_fabric`` bases ([Note: one strategy
source, two Lightning packages] in ``lightning/names.py``).  Importing this module imports ``lightning_fabric``;
``zero_plugin.integrations.lightning`` does so when it is installed."""

from __future__ import annotations

import lightning_fabric

from .fabric import _ZeroBackwardSyncControlMethods, _ZeroFabricStrategyMethods
from .names import fabric_names

__all__ = ["ZeroFabricStrategy"]


class ZeroBackwardSyncControl(
    _ZeroBackwardSyncControlMethods, lightning_fabric.strategies.strategy._BackwardSyncControl
):
    __doc__ = _ZeroBackwardSyncControlMethods.__doc__


class ZeroFabricStrategy(_ZeroFabricStrategyMethods, lightning_fabric.strategies.ParallelStrategy):
    __doc__ = _ZeroFabricStrategyMethods.__doc__
    _fabric_names = fabric_names("lightning_fabric")
    _sync_control = ZeroBackwardSyncControl
