"""ZeRO for the Lightning Trainer: ``Trainer(strategy="zero3")`` or ``ZeroStrategy(config=zp.ZeroConfig(...))``.

A thin adapter in the style of Lightning's ``ModelParallelStrategy``: the LightningModule is
sharded in place together with its one optimizer by ``zp.setup`` (no wrapper module, no DDP,
no ``_sync_module_states``: ``zp.setup`` broadcasts rank 0's weights); every step method runs
through the module's ``__call__`` so that stage 3 gathers the root unit.  Presets, clipping,
setup rules and the checkpoint layout live in ``lightning/common.py``, shared with Fabric.

Precision: Lightning's own plugin keeps the dtype side (``16-mixed`` / ``bf16-mixed`` autocast,
``*-true`` casts); :class:`ZeroPrecision` wraps it to run the closure, clip the sharded gradients
by their global norm, then step the engine.  Under ``16-mixed`` it also stands in for the
plugin's GradScaler with zero_plugin's synchronized loss scaler ([Note: fp16 one-flag mapping]
in ``loss_scaling.py``).

The classes are written once as bodies (``_ZeroStrategy``, ``_ZeroPrecision``, the summaries) and
built over one Lightning package's base classes by :func:`make_trainer_classes`: here for
``lightning.pytorch``, in ``lightning/pytorch_lightning.py`` for ``pytorch_lightning``
([Note: one strategy source, two Lightning packages] in ``lightning/names.py``).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Mapping, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

import zero_plugin as zp
from zero_plugin.loading.meta_init import meta_parameters

from . import common
from .names import LightningNames, trainer_names
from .processes import ZeroProcesses

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.utilities.types import ReduceOp
    from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "ZeroStrategy",
    "ZeroPrecision",
    "ZeroSummary",
    "ZeroModelSummary",
    "ZeroRichModelSummary",
    "TrainerClasses",
    "make_trainer_classes",
]

log = logging.getLogger(__name__)


class _ZeroPrecision:
    """Lightning's precision plugin for dtypes and autocast; zero_plugin for the step, clipping and (16-mixed)
    loss scaling.  ``scaler_settings``: the ZeroConfig fields that replace a 16-mixed plugin's GradScaler, or None."""

    _lightning: LightningNames  # set by make_trainer_classes, as every class body here

    def __init__(self, inner: Precision | None = None) -> None:
        names = self._lightning
        inner = names.Precision() if inner is None else inner
        # Lightning's plugins for the flags SUPPORTED_PRECISIONS lists; subclasses may change the step: exact types.
        if type(inner) not in (names.Precision, names.DoublePrecision, names.HalfPrecision, names.MixedPrecision):
            raise ValueError(
                f"ZeroStrategy: the precision plugin {type(inner).__name__} is not supported; use "
                f"Trainer(precision=...) with one of {', '.join(common.SUPPORTED_PRECISIONS)}"
            )
        self.precision = common.check_precision(str(inner.precision))
        self.scaler_settings = common.loss_scaler_settings(inner)
        self.inner = inner  # its GradScaler (16-mixed) is never called: the engine's scaler replaces it

    # -- dtypes: Lightning's plugin ------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    # -- loss scaling, step and clipping: the engine ------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        """16-mixed: scale the loss, as MixedPrecision does with its GradScaler (callbacks see the scaled loss)."""
        return super().pre_backward(common.scale_loss([module], tensor), module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Closure (forward + backward; reduction completes at the end of backward), unscale (16-mixed), clip,
        engine step.  The engine skips the step on every rank when any rank saw an inf/NaN gradient and returns
        None then, as ``GradScaler.step`` does; Lightning counts the step and steps schedulers either way."""
        closure_result = closure()
        common.unscale(optimizer)  # before on_before_optimizer_step and clipping, as MixedPrecision unscales
        self._after_closure(model, optimizer)
        names = self._lightning
        if isinstance(model, names.LightningModule) and model.automatic_optimization and closure_result is None:
            raise names.MisconfigurationException(
                "ZeroStrategy: skipping backward by returning None from "
                "training_step is not supported (every rank must take part in "
                "every step)"
            )
        return optimizer.step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        common.clip_grad_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        common.clip_grad_value(optimizer, clip_val)


class _ZeroStrategy(ZeroProcesses):
    """ZeRO stages 0-3 (zero_plugin) for the Lightning Trainer.

    Args:
        config: a ``zp.ZeroConfig``, a preset name (``"zero1"``, ``"zero2"``, ``"zero2_offload"``, ``"zero3"``,
            ``"zero3_offload"``), a dict of ZeroConfig fields, or None for ``ZeroConfig.from_env()``.
        checkpoint: ``"sharded"`` (default): every rank writes its regions into a checkpoint directory
            (``zp.save_checkpoint``); ``"full"``: rank 0 writes one Lightning-format file with the full state.
        param_source: weights for a model built on the meta device: a ``.safetensors`` file, a folder of them
            or an ``*.safetensors.index.json`` (``zp.loading.materialize.from_safetensors``), or a ``ParamSource``.
            Given, ``trainer.init_module()`` and ``configure_model`` build on meta at every stage and setup
            loads the weights (stage 3: one unit at a time); None: modules initialise themselves.
        meta_init: stage 3 only; True (default): ``configure_model`` and ``trainer.init_module()`` (unless
            ``empty_init=False``) build parameters on the meta device and setup initialises them one unit at a
            time with each module's own init; False: build them for real on every rank, as DDP does.
            See [Note: meta construction] in ``lightning/common.py``.
    """

    strategy_name = "zero"
    _lightning: LightningNames
    _zero: TrainerClasses
    _resets_seed = True  # as DDPStrategy (ZeroProcesses.setup_environment)

    def __init__(
        self,
        config: zp.ZeroConfig | str | Mapping | None = None,
        checkpoint: Literal["sharded", "full"] = "sharded",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        param_source: Any = None,
        meta_init: bool = True,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._set_options(config, checkpoint, param_source, meta_init, process_group_backend, timeout)
        self.num_nodes = 1

    # -- precision: always our wrapper ------------------------------------------------------------
    @property
    def precision_plugin(self) -> _ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = self._zero.ZeroPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, self._zero.ZeroPrecision):
            plugin = self._zero.ZeroPrecision(plugin)
        self._precision_plugin = plugin

    @property
    def engine_config(self) -> zp.ZeroConfig:
        """``config`` as the engine runs it: loss scaling on under 16-mixed, whose GradScaler it replaces."""
        return common.engine_config(self.config, self.precision_plugin.scaler_settings)

    # -- processes (root_device, setup_environment, ranks: ZeroProcesses) -----------------------------
    @property
    def is_distributed(self) -> bool:
        # Read by the connector for custom strategies: turns on the DistributedSampler.
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints are loaded into the sharded module and the ZeroOptimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer itself

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._lightning.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    # -- model and optimizer ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        _use_full_count_summaries(trainer, self._lightning, self._zero)
        module = self.lightning_module
        if not common.is_set_up(module):
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
        if trainer.state.fn == self._lightning.TrainerFn.FITTING:
            with common.full_parameters(module):  # configure_optimizers after an earlier setup
                self.setup_optimizers(trainer)
            self.optimizers = [common.shard(module, self.optimizers, self.engine_config, self.param_source)]
        else:
            common.shard_for_inference(module, self.engine_config, self.param_source)
        self.model = module
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        common.move_to_device(self.lightning_module, self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module`` and ``configure_model``: [Note: meta construction] in ``lightning/common.py``."""
        module = self.lightning_module
        set_up = module is not None and common.is_set_up(module)  # configure_model again after setup
        if set_up or not common.builds_on_meta(self.config, empty_init, self.meta_init, self.param_source):
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_parameters(), self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with common.no_sync(self.lightning_module):
            yield

    def teardown(self) -> None:
        # Unlike Strategy.teardown: no .cpu() of the module or optimizer, whose shards the engine owns.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- steps: through __call__, so stage 3 gathers the root unit ----------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        return self._forward_redirection(module, module, method, *args, **kwargs)

    # -- collectives (barrier, broadcast: ZeroProcesses) ----------------------------------------------------
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return self._reduce_tensor(tensor, group, reduce_op)

    # -- state and checkpoints ----------------------------------------------------------------------------
    def _sharded_files(self) -> bool:
        return common.uses_sharded_files(self._checkpoint)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Collective.  Full mode: the full state dict on rank 0 ({} elsewhere).  Sharded mode: {} (the
        regions are written by save_checkpoint)."""
        assert self.lightning_module is not None
        if self._sharded_files() and common.is_set_up(self.lightning_module):
            return {}
        return common.full_model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective.  Full mode: the consolidated state on rank 0 ({} elsewhere).  Sharded mode: {}."""
        if self._sharded_files():
            return {}
        return common.full_optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        if not self._sharded_files():
            common.prepare_path(path, False, self.is_global_zero, self.barrier)
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy.save_checkpoint(storage_options=...) is not supported for sharded "
                "checkpoints; use ZeroStrategy(checkpoint='full')"
            )
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with_optimizer = "optimizer_states" in checkpoint and bool(self.optimizers)
        common.save_sharded(
            path,
            self.lightning_module,
            self.optimizers[0] if with_optimizer else None,
            meta,
            is_rank0=self.is_global_zero,
            barrier=self.barrier,
            write=lambda obj, file: self.checkpoint_io.save_checkpoint(obj, file),
        )
        if not self._hinted:
            self._hinted = True
            self._lightning.rank_zero_info(common.LOAD_HINT.format(path=path))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into the sharded module (and, when fitting, the optimizer); return the rest for Lightning."""
        module = self.lightning_module
        assert module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = module._trainer is not None and module.trainer.state.fn == self._lightning.TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        if (kind := common.foreign_layout(path)) is not None:  # [Note: checkpoints of Lightning's other strategies]
            read_meta = lambda file: self.checkpoint_io.load_checkpoint(file, weights_only=weights_only)  # noqa: E731
            return common.load_foreign(path, kind, module, optimizer, read_meta)
        if common.is_sharded_checkpoint(path):
            common.load_sharded(path, module, optimizer)
            meta = self.checkpoint_io.load_checkpoint(path / common.META_FILE, weights_only=weights_only)
            meta.pop(common.RECORD, None)
            return meta
        common.check_loadable_directory(path)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        opt_states = checkpoint.get("optimizer_states") or [None]
        common.load_full(checkpoint, module, optimizer, strict=module.strict_loading, optimizer_state=opt_states[0])
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        common.register_presets(strategy_registry, cls)


# -- ModelSummary with full parameter counts ----------------------------------------------------------------------
def _full_numel(module: nn.Module) -> Callable[[nn.Parameter], int]:
    engine = common.engine_or_none(module)
    return engine.full_numel if engine is not None else (lambda p: p.numel())


class _FullCountLayerSummary:
    """Lightning's LayerSummary, counting each stage-3 parameter at its full size."""

    def __init__(self, module: nn.Module, numel: Callable[[nn.Parameter], int]) -> None:
        super().__init__(module)
        self._numel = numel

    @property
    def num_parameters(self) -> int:
        return sum(self._numel(p) for p in self._module.parameters())


class _ZeroSummary:
    """Lightning's ModelSummary, counting each stage-3 parameter at its full size, not its shard's."""

    _zero: TrainerClasses

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        self._numel = _full_numel(model)
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, Any]:
        layer = self._zero.FullCountLayerSummary
        summary = OrderedDict((name, layer(m, self._numel)) for name, m in self.named_modules)
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for each in summary.values():
            each.detach_hook()
        if self._max_depth >= 1:
            for name in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[name]
        return summary

    @property
    def total_parameters(self) -> int:
        return sum(self._numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(self._numel(p) for p in self._model.parameters() if p.requires_grad)


class _FullCountSummaryMixin:
    """The (Rich)ModelSummary callback with full parameter counts (installed automatically by ZeroStrategy)."""

    _zero: TrainerClasses

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return self._zero.ZeroSummary(pl_module, max_depth=self._max_depth)


def _use_full_count_summaries(trainer: pl.Trainer, names: LightningNames, zero: TrainerClasses) -> None:
    """Swap Lightning's stock summary callbacks (its default included) for the full-count ones.

    Lightning special-cases only DeepSpeed in ``ModelSummary._summary``; there is no strategy hook.
    """
    replacements = {names.ModelSummary: zero.ZeroModelSummary, names.RichModelSummary: zero.ZeroRichModelSummary}
    for i, callback in enumerate(trainer.callbacks):
        new_cls = replacements.get(type(callback))
        if new_cls is not None:
            trainer.callbacks[i] = new_cls(callback._max_depth, **callback._summarize_kwargs)


# -- the classes, per Lightning package ([Note: one strategy source, two Lightning packages]) ------------------------
class TrainerClasses(NamedTuple):
    ZeroStrategy: type
    ZeroPrecision: type
    ZeroSummary: type
    ZeroModelSummary: type
    ZeroRichModelSummary: type
    FullCountLayerSummary: type


@functools.cache
def make_trainer_classes(
    package: str = "lightning.pytorch", fabric: str = "lightning.fabric", module: str = __name__
) -> TrainerClasses:
    """The Trainer strategy's classes over the base classes of ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``) and its Fabric (``"lightning.fabric"`` / ``"lightning_fabric"``), named as if defined
    in ``module`` (which exports them).  Cached: one class per package, so registration stays idempotent."""
    names = trainer_names(package, fabric)

    def build(name: str, body: type, base: type) -> type:
        return type(
            name,
            (body, base),
            {
                "__module__": module,
                "__qualname__": name,
                "__doc__": body.__doc__,
                "_lightning": names,
                "_fabric_names": names.fabric,
            },
        )

    zero = TrainerClasses(
        ZeroStrategy=build("ZeroStrategy", _ZeroStrategy, names.ParallelStrategy),
        ZeroPrecision=build("ZeroPrecision", _ZeroPrecision, names.Precision),
        ZeroSummary=build("ZeroSummary", _ZeroSummary, names.Summary),
        ZeroModelSummary=build("ZeroModelSummary", _FullCountSummaryMixin, names.ModelSummary),
        ZeroRichModelSummary=build("ZeroRichModelSummary", _FullCountSummaryMixin, names.RichModelSummary),
        FullCountLayerSummary=build("FullCountLayerSummary", _FullCountLayerSummary, names.LayerSummary),
    )
    for cls in zero:
        cls._zero = zero
    return zero


ZeroStrategy, ZeroPrecision, ZeroSummary, ZeroModelSummary, ZeroRichModelSummary, FullCountLayerSummary = (
    make_trainer_classes()
)
