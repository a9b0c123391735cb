"""The Fabric strategy for the standalone ``lightning_fabric`` package: ``lightning/fabric.py``'s class over
``lightning_fabric`` bases ([Note: one strategy source, two Lightning packages] in ``lightning/names.py``).
Importing this module builds it; ``zero_plugin.integrations.lightning`` does so when ``lightning_fabric`` is
installed."""

from __future__ import annotations

from .fabric import make_fabric_strategy

__all__ = ["ZeroFabricStrategy"]

ZeroFabricStrategy = make_fabric_strategy("lightning_fabric", __name__)
