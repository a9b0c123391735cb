"""The Trainer strategy for the standalone ``pytorch_lightning`` package: ``lightning/strategy.py``'s classes over
``pytorch_lightning`` / ``lightning_fabric`` bases ([Note: one strategy source, two Lightning packages] in
``lightning/names.py``).  Importing this module builds them; ``zero_plugin.integrations.lightning`` does so when
``pytorch_lightning`` is installed."""

from __future__ import annotations

from .strategy import make_trainer_classes

__all__ = ["ZeroStrategy", "ZeroPrecision", "ZeroSummary", "ZeroModelSummary", "ZeroRichModelSummary"]

ZeroStrategy, ZeroPrecision, ZeroSummary, ZeroModelSummary, ZeroRichModelSummary, FullCountLayerSummary = (
    make_trainer_classes("pytorch_lightning", "lightning_fabric", __name__)
)
