"""The Trainer strategy for the standalone ``pytorch_lightning`` package: the class statements of
``lightning/strategy.py``, with the same method mixins, over ``pytorch_lightning`` / ``lightning_fabric`` bases
([Note: one strategy source, two Lightning packages] in ``lightning/names.py``).  Importing this module imports
``pytorch_lightning``; ``zero_plugin.integrations.lightning`` does so when it is installed."""

from __future__ import annotations

import pytorch_lightning
from pytorch_lightning.utilities.model_summary import model_summary

from .names import fabric_names, trainer_names
from .strategy import (
    _FullCountCallbackMethods,
    _FullCountLayerSummaryMethods,
    _ZeroPrecisionMethods,
    _ZeroStrategyMethods,
    _ZeroSummaryMethods,
)

__all__ = ["ZeroStrategy", "ZeroPrecision", "ZeroSummary", "ZeroModelSummary", "ZeroRichModelSummary"]


class FullCountLayerSummary(_FullCountLayerSummaryMethods, model_summary.LayerSummary):
    __doc__ = _FullCountLayerSummaryMethods.__doc__


class ZeroSummary(_ZeroSummaryMethods, model_summary.ModelSummary):
    __doc__ = _ZeroSummaryMethods.__doc__
    _layer_summary = FullCountLayerSummary


class ZeroModelSummary(_FullCountCallbackMethods, pytorch_lightning.callbacks.ModelSummary):
    __doc__ = _FullCountCallbackMethods.__doc__
    _full_count_summary = ZeroSummary


class ZeroRichModelSummary(_FullCountCallbackMethods, pytorch_lightning.callbacks.RichModelSummary):
    __doc__ = _FullCountCallbackMethods.__doc__
    _full_count_summary = ZeroSummary


class ZeroPrecision(_ZeroPrecisionMethods, pytorch_lightning.plugins.precision.Precision):
    __doc__ = _ZeroPrecisionMethods.__doc__
    _trainer_names = trainer_names("pytorch_lightning")


class ZeroStrategy(_ZeroStrategyMethods, pytorch_lightning.strategies.ParallelStrategy):
    __doc__ = _ZeroStrategyMethods.__doc__
    _trainer_names = trainer_names("pytorch_lightning")
    _fabric_names = fabric_names("lightning_fabric")
    _precision_class = ZeroPrecision
    _summary_callbacks = {
        pytorch_lightning.callbacks.ModelSummary: ZeroModelSummary,
        pytorch_lightning.callbacks.RichModelSummary: ZeroRichModelSummary,
    }
