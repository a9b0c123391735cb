"""ZeRO for Lightning Fabric: ``Fabric(strategy="zero3")`` or ``ZeroFabricStrategy(config=zp.ZeroConfig(...))``.

``fabric.setup(model, optimizer)`` shards both together with ``zp.setup`` and returns the same
module (inside Fabric's usual ``_FabricModule``) and the ``ZeroOptimizer``; ``setup_module``
alone shards for inference (a later ``setup_optimizers`` binds the real optimizer).
``fabric.backward`` is plain autograd (the engine's hooks reduce), ``fabric.clip_gradients``
clips by the global norm over every rank's shard, ``fabric.no_backward_sync`` maps to
``zp.no_sync``, and ``fabric.save`` / ``fabric.load`` use the layout in ``lightning/common.py``.
Under ``16-mixed`` zero_plugin's synchronized loss scaler stands in for the plugin's GradScaler
([Note: fp16 one-flag mapping] in ``loss_scaling.py``).

The methods are written once, in mixins (``_ZeroFabricStrategyMethods``, ``_ZeroBackwardSyncControlMethods``), and
the classes at the end of this module put them over ``lightning.fabric``'s base classes:
``class ZeroFabricStrategy(_ZeroFabricStrategyMethods, lightning.fabric.strategies.ParallelStrategy)``.
``lightning/lightning_fabric.py`` has the same class statements over ``lightning_fabric``
([Note: one strategy source, two Lightning packages] in ``lightning/names.py``).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import lightning.fabric
import torch
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

import zero_plugin as zp
from zero_plugin.loading.meta_init import meta_parameters
from zero_plugin.sequence.parallel import find_sequence_parallel

from . import common
from .names import LightningNames, fabric_names
from .processes import ZeroProcesses

if TYPE_CHECKING:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.utilities.types import ReduceOp

__all__ = ["ZeroFabricStrategy"]

_OWNER_KEY = common.RECORD  # in meta.pt: which state keys held the module and the optimizer (and tied names)


# -- the methods, written once ([Note: one strategy source, two Lightning packages]) ----------------------------------
class _ZeroBackwardSyncControlMethods:
    """Fabric's ``no_backward_sync`` as ``zp.no_sync`` (over Fabric's ``_BackwardSyncControl``)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled and not common.is_set_up(module):
            raise TypeError(
                "no_backward_sync: the module was not set up by the ZeRO strategy; "
                "call fabric.setup(model, optimizer) first"
            )
        return common.no_sync(module, enabled)


class _ZeroFabricStrategyMethods(ZeroProcesses):
    """ZeRO stages 0-3 (zero_plugin) for Lightning Fabric; see ``ZeroStrategy`` for the arguments.

    ``fabric.init_module()`` builds on the meta device at stage 3 (unless ``empty_init=False`` or
    ``meta_init=False``) and ``fabric.setup`` materialises one unit at a time: [Note: meta construction]
    in ``lightning/common.py``.
    """

    _fabric_names: LightningNames  # set by the class statements (here and in lightning_fabric.py), as below
    _sync_control: type  # this package's ZeroBackwardSyncControl

    def __init__(
        self,
        config: zp.ZeroConfig | str | Mapping | None = None,
        checkpoint: str = "sharded",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
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
            precision=precision,
        )
        self._set_options(
            config, checkpoint, param_source, meta_init, process_group_backend, timeout, sequence_parallel_size
        )
        self._backward_sync_control = self._sync_control()
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # set up here, for setup_optimizer
        self._num_nodes = 1

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else self._fabric_names.Precision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is not None:  # refused here, when Fabric hands it over, rather than at the first step
            common.check_precision_plugin(
                precision, self._fabric_names.precision_plugins, "ZeroFabricStrategy", "Fabric(precision=...)"
            )
        self._precision = precision

    @property
    def engine_config(self) -> zp.ZeroConfig:
        """``config`` as the engine runs it: loss scaling on under 16-mixed, whose GradScaler it replaces."""
        settings = None if self._precision is None else common.loss_scaler_settings(self._precision)
        return common.engine_config(self.config, settings)

    # -- processes (root_device, setup_environment, ranks: ZeroProcesses) ---------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = self._fabric_names.SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    # -- setup ------------------------------------------------------------------------------------------
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard the module and its one optimizer together (collective)."""
        optimizer = common.shard(module, optimizers, self.engine_config, self.param_source)
        self._remember(module)
        return module, [optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard for inference; ``setup_optimizers`` may bind an optimizer later."""
        common.shard_for_inference(module, self.engine_config, self.param_source)
        self._remember(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Bind an optimizer to the module ``setup_module`` sharded (the FSDP-style two-step setup)."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owners = [m for m in self._modules if params & {id(p) for p in m.parameters()}]
        if len(owners) != 1:
            raise RuntimeError(self._err_msg_joint_setup_required())
        return common.shard(owners[0], [optimizer], self.engine_config)

    def _remember(self, module: nn.Module) -> None:
        self._modules.add(module)

    def sequence_parallel_module(self) -> nn.Module:
        found = [m for m in self._modules if common.is_set_up(m)]
        found = [m for m in found if find_sequence_parallel(m) is not None]
        if len(found) != 1:
            raise ValueError(
                f"ZeroFabricStrategy(sequence_parallel_size={self.config.comm.sequence_parallel_size}): the loaders split "
                f"for the one module set up with fabric.setup; found {len(found)}: set up the model before iterating"
            )
        return found[0]

    def module_to_device(self, module: nn.Module) -> None:
        common.move_to_device(module, self.root_device)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module``: see [Note: meta construction] in ``lightning/common.py``."""
        if not common.builds_on_meta(self.config, empty_init, self.meta_init, self.param_source):
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(meta_parameters())
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    # -- gradients -----------------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """16-mixed: the loss times zero_plugin's scale, instead of MixedPrecision.backward's GradScaler."""
        if common.loss_scaler_settings(self.precision) is None:
            return super().backward(tensor, module, *args, **kwargs)
        tensor = common.scale_loss(self._modules if module is None else [module], tensor)
        self.precision.pre_backward(tensor, module)
        tensor.backward(*args, **kwargs)
        self.precision.post_backward(tensor, module)
        return None

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """16-mixed: the engine's step unscales and skips on every rank when any rank saw an inf/NaN gradient
        (returning None then, as ``GradScaler.step`` does), instead of the plugin's GradScaler."""
        if common.loss_scaler_settings(self.precision) is None:
            return super().optimizer_step(optimizer, **kwargs)
        return optimizer.step(**kwargs)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        total = common.clip_grad_norm(module, max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped (the gradients were scaled anyway). "
                "Set `error_if_nonfinite=False` to disable this error"
            )
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        common.clip_grad_value(module, clip_val)

    # -- collectives (barrier, broadcast: ZeroProcesses) ----------------------------------------------------------
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return self._reduce_tensor(tensor, group, reduce_op)

    # -- state and checkpoints ------------------------------------------------------------------------------------
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Collective: the full state dict on rank 0, ``{}`` on the others."""
        return common.full_model_state(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if not common.is_set_up(module):
            module.load_state_dict(state_dict, strict=strict)
            return
        zp.load_full_state_dict(module, state_dict, src_rank=None, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective: the consolidated optimizer state on rank 0, ``{}`` on the others."""
        return common.full_optimizer_state(optimizer)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        path = Path(self.broadcast(str(path)))
        if not common.uses_sharded_files(self._checkpoint):
            common.prepare_path(path, False, self.is_global_zero, self.barrier)
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if filter or storage_options is not None:
            raise TypeError(
                "ZeroFabricStrategy: filter= and storage_options= need a full checkpoint; use "
                "ZeroFabricStrategy(checkpoint='full')"
            )
        (module_key, module), (opt_key, optimizer) = _module_and_optimizer(state)
        meta = {
            k: (v.state_dict() if isinstance(v, self._fabric_names.Stateful) else v)
            for k, v in state.items()
            if k not in (module_key, opt_key)
        }
        meta[_OWNER_KEY] = {"module": module_key, "optimizer": opt_key}
        self._save_sharded(path, module, optimizer, meta)

    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(path)))
        if not common.is_sharded_checkpoint(path):
            common.check_loadable_directory(path)
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "ZeroFabricStrategy: a sharded checkpoint loads into objects only; pass "
                "state={'model': model, 'optimizer': optimizer, ...}"
            )
        (module_key, module), (opt_key, optimizer) = _module_and_optimizer(state)
        meta = self.checkpoint_io.load_checkpoint(path / common.META_FILE, weights_only=weights_only)
        owners = meta.pop(_OWNER_KEY, {})
        saved = set(meta) | {k for k in (owners.get("module"), owners.get("optimizer")) if k is not None}
        self._fabric_names.validate_keys_for_strict_loading(state.keys(), saved, strict=strict)
        if opt_key is not None and opt_key != owners.get("optimizer"):
            optimizer = None  # not strict, and the checkpoint has no optimizer under this key
        common.load_sharded(path, module, optimizer)
        for key in [k for k in state if k not in (module_key, opt_key) and k in meta]:
            if isinstance(state[key], self._fabric_names.Stateful):
                state[key].load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        common.register_presets(strategy_registry, cls)


def _module_and_optimizer(state: dict[str, Any]) -> tuple[tuple[Any, nn.Module], tuple[Any, Optimizer | None]]:
    """The one set-up module and (at most) one optimizer in a Fabric state dict."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1 or not common.is_set_up(modules[0][1]):
        raise ValueError(
            "ZeroFabricStrategy: a sharded checkpoint holds exactly one module set up by the strategy "
            f"and at most one optimizer; got modules {[k for k, _ in modules]} and optimizers "
            f"{[k for k, _ in optimizers]}. Use ZeroFabricStrategy(checkpoint='full') otherwise"
        )
    return modules[0], (optimizers[0] if optimizers else (None, None))


# -- the classes over lightning.fabric ([Note: one strategy source, two Lightning packages]) ------------------------
# lightning_fabric.py has the same statements over lightning_fabric; keep the two in step.
class ZeroBackwardSyncControl(
    _ZeroBackwardSyncControlMethods, lightning.fabric.strategies.strategy._BackwardSyncControl
):
    __doc__ = _ZeroBackwardSyncControlMethods.__doc__


class ZeroFabricStrategy(_ZeroFabricStrategyMethods, lightning.fabric.strategies.ParallelStrategy):
    __doc__ = _ZeroFabricStrategyMethods.__doc__
    _fabric_names = fabric_names("lightning.fabric")
    _sync_control = ZeroBackwardSyncControl
