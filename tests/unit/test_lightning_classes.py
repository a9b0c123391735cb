"""The Lightning integration's public classes are plain ``class`` statements in the modules that export them, one set
per Lightning package, over that package's base classes ([Note: one strategy source, two Lightning packages] in
``zero_plugin/integrations/lightning/names.py``).  No process group: imports and class checks only.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pickle

import lightning.fabric
import lightning.pytorch
import pytest

from zero_plugin.integrations import lightning as zl
from zero_plugin.integrations.lightning import fabric, strategy

_TRAINER_CLASSES = ("ZeroStrategy", "ZeroPrecision", "ZeroSummary", "ZeroModelSummary", "ZeroRichModelSummary")
# module that defines the classes -> (the Lightning package whose bases they take, the classes)
_MODULES = {
    "zero_plugin.integrations.lightning.strategy": ("lightning.pytorch", _TRAINER_CLASSES),
    "zero_plugin.integrations.lightning.fabric": ("lightning.fabric", ("ZeroFabricStrategy",)),
    "zero_plugin.integrations.lightning.pytorch_lightning": ("pytorch_lightning", _TRAINER_CLASSES),
    "zero_plugin.integrations.lightning.lightning_fabric": ("lightning_fabric", ("ZeroFabricStrategy",)),
}
_PRESETS = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")


def _module(name: str):
    package, _ = _MODULES[name]
    pytest.importorskip(package)  # lightning is a dependency; the standalone packages may be absent
    return importlib.import_module(name)


@pytest.mark.parametrize("module_name", list(_MODULES))
def test_each_public_class_is_a_class_statement_of_the_module_that_exports_it(module_name):
    module = _module(module_name)
    _, names = _MODULES[module_name]
    assert set(names) == set(module.__all__)
    source = inspect.getsource(module)
    for name in names:
        cls = getattr(module, name)
        assert f"\nclass {name}(" in source, f"no `class {name}(` statement in {module_name}"
        assert inspect.getsource(cls).startswith(f"class {name}(")
        assert (cls.__module__, cls.__qualname__, cls.__name__) == (module_name, name, name)
        assert pickle.loads(pickle.dumps(cls)) is cls
        assert cls.__doc__, f"{module_name}.{name} has no docstring"
        # The methods are the mixin's, written once: the class statement only sets names.
        assert not [k for k, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, property)]


@pytest.mark.parametrize("module_name", list(_MODULES))
def test_each_strategy_subclasses_its_own_packages_parallel_strategy(module_name):
    module = _module(module_name)
    package, names = _MODULES[module_name]
    strategy_cls = getattr(module, names[0])
    own = importlib.import_module(f"{package}.strategies").ParallelStrategy
    assert issubclass(strategy_cls, own)
    others = {p for p, _ in _MODULES.values() if p != package}
    for other in others:
        if importlib.util.find_spec(other.split(".")[0]) is None:
            continue
        assert not issubclass(strategy_cls, importlib.import_module(f"{other}.strategies").ParallelStrategy)
    if names is _TRAINER_CLASSES:  # the Trainer's precision plugin and summaries: this package's too
        lightning_package = importlib.import_module(package)
        assert issubclass(module.ZeroPrecision, lightning_package.plugins.precision.Precision)
        assert issubclass(module.ZeroModelSummary, lightning_package.callbacks.ModelSummary)
        assert issubclass(module.ZeroRichModelSummary, lightning_package.callbacks.RichModelSummary)
        assert strategy_cls._precision_class is module.ZeroPrecision
        assert module.ZeroModelSummary._full_count_summary is module.ZeroSummary


@pytest.mark.parametrize(
    "unified, standalone",
    [("strategy", "pytorch_lightning"), ("fabric", "lightning_fabric")],
)
def test_the_standalone_class_statements_set_what_the_unified_ones_set(unified, standalone):
    """The two sets of class statements are kept in step: same mixins, same class attributes."""
    prefix = "zero_plugin.integrations.lightning."
    first, second = _module(prefix + unified), _module(prefix + standalone)
    for name in first.__all__:
        a, b = getattr(first, name), getattr(second, name)
        assert a.__bases__[0] is b.__bases__[0]
        assert {k for k in vars(a) if not k.startswith("__")} == {k for k in vars(b) if not k.startswith("__")}


def test_the_registries_name_each_packages_own_class():
    zl.register_strategies()  # idempotent: the import already registered them
    registries = [
        (lightning.pytorch.strategies.StrategyRegistry, strategy.ZeroStrategy),
        (lightning.fabric.strategies.STRATEGY_REGISTRY, fabric.ZeroFabricStrategy),
    ]
    for package, cls in zl.standalone_strategies().items():
        module = importlib.import_module(f"{package}.strategies")
        registries.append((getattr(module, "StrategyRegistry", None) or module.STRATEGY_REGISTRY, cls))
    assert len(registries) == 4 or importlib.util.find_spec("pytorch_lightning") is None
    for registry, cls in registries:
        for name in _PRESETS:
            assert dict.get(registry, name)["strategy"] is cls, (name, cls)
