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

The methods are written once, in mixins (``_ZeroStrategyMethods``, ``_ZeroPrecisionMethods``, the summaries),
and the classes at the end of this module put them over ``lightning.pytorch``'s base classes:
``class ZeroStrategy(_ZeroStrategyMethods, pl.strategies.ParallelStrategy)``.
``lightning/pytorch_lightning.py`` has the same class statements over ``pytorch_lightning``
([Note: one strategy source, two Lightning packages] in ``lightning/names.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_summary import model_summary
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

import zero_plugin as zp
from zero_plugin.loading.meta_init import meta_parameters

from . import common
from .names import LightningNames, fabric_names, trainer_names
from .processes import ZeroProcesses

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.utilities.types import ReduceOp
    from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "ZeroStrategy",
    "ZeroPrecision",
    "ZeroSummary",
    "ZeroModelSummary",
    "ZeroRichModelSummary",
]

log = logging.getLogger(__name__)


# -- the methods, written once ([Note: one strategy source, two Lightning packages]) ----------------------------------
class _ZeroPrecisionMethods:
    """Lightning's precision plugin for dtypes and autocast; zero_plugin for the step, clipping and (16-mixed)
    loss scaling.  ``scaler_settings``: the ZeroConfig fields that replace a 16-mixed plugin's GradScaler, or None."""

    _trainer_names: LightningNames  # set by the class statements (here and in pytorch_lightning.py), as below

    def __init__(self, inner: Precision | None = None) -> None:
        names = self._trainer_names
        inner = names.Precision() if inner is None else inner
        self.scaler_settings = common.check_precision_plugin(
            inner, names.precision_plugins, "ZeroStrategy", "Trainer(precision=...)"
        )
        self.precision = str(inner.precision)
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
        names = self._trainer_names
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


class _ZeroStrategyMethods(ZeroProcesses):
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
        sequence_parallel_size: Ulysses sequence parallelism over groups of K consecutive ranks (sets
            ``ZeroConfig.sequence_parallel_size``; None: the config's).  With K > 1 the loaders' distributed
            sampler is over the N / K data-parallel groups and their batches are split for this rank by
            ``zp.sequence_parallel_batch`` (training, validation and test alike): the steps get ``input_ids``,
            ``position_ids`` and ``shift_labels`` of this rank's slice and must compute the loss with
            ``zp.sequence_parallel_loss(logits, batch["shift_labels"], self)`` (docs/long-context.md).
    """

    strategy_name = "zero"
    _trainer_names: LightningNames
    _precision_class: type  # this package's ZeroPrecision
    _summary_callbacks: Mapping[type, type]  # this package's (Rich)ModelSummary -> ours
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
        sequence_parallel_size: int | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._set_options(
            config, checkpoint, param_source, meta_init, process_group_backend, timeout, sequence_parallel_size
        )
        self.num_nodes = 1

    # -- precision: always our wrapper ------------------------------------------------------------
    @property
    def precision_plugin(self) -> _ZeroPrecisionMethods:
        if self._precision_plugin is None:
            self._precision_plugin = self._precision_class()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, self._precision_class):
            plugin = self._precision_class(plugin)
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

    def sequence_parallel_module(self) -> nn.Module:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints are loaded into the sharded module and the ZeroOptimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer itself

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._trainer_names.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    # -- model and optimizer ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        _use_full_count_summaries(trainer, self._summary_callbacks)
        module = self.lightning_module
        if not common.is_set_up(module):
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
        if trainer.state.fn == self._trainer_names.TrainerFn.FITTING:
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
        return self._redirect(self.precision_plugin.train_step_context, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.val_step_context, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.test_step_context, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.predict_step_context, "predict_step", *args, **kwargs)

    def _redirect(self, context: Callable[[], AbstractContextManager], method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the LightningModule inside the precision plugin's ``context``, through ``__call__``."""
        module = self.lightning_module
        assert module is not None
        with context():
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
        self._save_sharded(path, self.lightning_module, self.optimizers[0] if with_optimizer else None, meta)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into the sharded module (and, when fitting, the optimizer); return the rest for Lightning."""
        module = self.lightning_module
        assert module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = module._trainer is not None and module.trainer.state.fn == self._trainer_names.TrainerFn.FITTING
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


class _FullCountLayerSummaryMethods:
    """Lightning's LayerSummary, counting each stage-3 parameter at its full size."""

    def __init__(self, module: nn.Module, numel: Callable[[nn.Parameter], int]) -> None:
        super().__init__(module)
        self._numel = numel

    @property
    def num_parameters(self) -> int:
        return sum(self._numel(p) for p in self._module.parameters())


class _ZeroSummaryMethods:
    """Lightning's ModelSummary, counting each stage-3 parameter at its full size, not its shard's."""

    _layer_summary: type  # this package's FullCountLayerSummary

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        self._numel = _full_numel(model)
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, Any]:
        summary = OrderedDict((name, self._layer_summary(m, self._numel)) for name, m in self.named_modules)
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


class _FullCountCallbackMethods:
    """The (Rich)ModelSummary callback with full parameter counts (installed automatically by ZeroStrategy)."""

    _full_count_summary: type  # this package's ZeroSummary

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return self._full_count_summary(pl_module, max_depth=self._max_depth)


def _use_full_count_summaries(trainer: pl.Trainer, replacements: Mapping[type, type]) -> None:
    """Swap Lightning's stock summary callbacks (its default included) for the full-count ones (``replacements``:
    the package's ``ModelSummary`` / ``RichModelSummary`` -> ``ZeroModelSummary`` / ``ZeroRichModelSummary``).

    Lightning special-cases only DeepSpeed in ``ModelSummary._summary``; there is no strategy hook.
    """
    for i, callback in enumerate(trainer.callbacks):
        new_cls = replacements.get(type(callback))
        if new_cls is not None:
            trainer.callbacks[i] = new_cls(callback._max_depth, **callback._summarize_kwargs)


# -- the classes over lightning.pytorch ([Note: one strategy source, two Lightning packages]) -----------------------
# pytorch_lightning.py has the same statements over pytorch_lightning; keep the two in step.
class FullCountLayerSummary(_FullCountLayerSummaryMethods, model_summary.LayerSummary):
    __doc__ = _FullCountLayerSummaryMethods.__doc__


class ZeroSummary(_ZeroSummaryMethods, model_summary.ModelSummary):
    __doc__ = _ZeroSummaryMethods.__doc__
    _layer_summary = FullCountLayerSummary


class ZeroModelSummary(_FullCountCallbackMethods, pl.callbacks.ModelSummary):
    __doc__ = _FullCountCallbackMethods.__doc__
    _full_count_summary = ZeroSummary


class ZeroRichModelSummary(_FullCountCallbackMethods, pl.callbacks.RichModelSummary):
    __doc__ = _FullCountCallbackMethods.__doc__
    _full_count_summary = ZeroSummary


class ZeroPrecision(_ZeroPrecisionMethods, pl.plugins.precision.Precision):
    __doc__ = _ZeroPrecisionMethods.__doc__
    _trainer_names = trainer_names("lightning.pytorch")


class ZeroStrategy(_ZeroStrategyMethods, pl.strategies.ParallelStrategy):
    __doc__ = _ZeroStrategyMethods.__doc__
    _trainer_names = trainer_names("lightning.pytorch")
    _fabric_names = fabric_names("lightning.fabric")
    _precision_class = ZeroPrecision
    _summary_callbacks = {
        pl.callbacks.ModelSummary: ZeroModelSummary,
        pl.callbacks.RichModelSummary: ZeroRichModelSummary,
    }
