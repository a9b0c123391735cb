"""Accelerate integration: an ``accelerate.Accelerator`` whose ``prepare`` shards with ``zp.setup``.

    from zero_plugin.integrations.accelerate import Accelerator, ZeroPlugin
    accelerator = Accelerator(zero_plugin=ZeroPlugin(zp.ZeroConfig(stage=3)))   # or ZERO_PLUGIN_* variables
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Accelerate special-cases DeepSpeed and FSDP in a handful of methods; those (and only those) are
overridden here, everything else (data loaders, schedulers, ``gather``, ``unwrap_model``,
``save_model``, trackers) is inherited.  ``zero_plugin.run`` swaps this class in for
``accelerate.Accelerator`` so that unmodified scripts run under a chosen stage.

[Note: model and optimizer are prepared together]
``zp.setup`` shards a model and rebinds its optimizer to this rank's masters in one collective
step, so ``prepare`` must see both: the optimizer is set up before Accelerate's own per-object
preparation runs, whatever the argument order.  No DDP wrapper is added; the model is sharded
in place and stays the same object.

[Note: no full model on the device] Stages 0-2 keep full parameters on the device, so their real
parameters move there before ``zp.setup`` (the shards are created where the parameters live; meta
ones, from a lazy load, are created there by ``materialize.materialize_all``).  Stage 3 must not: a
model larger than one device could never be prepared.  Only the buffers move (small, never sharded);
``stage3/engine.py`` ``_shard_one`` moves each parameter to the compute device as it shards it, one
unit at a time, so the device holds the shards plus one parameter's full tensor at most.

[Note: sequence-parallel data loaders]
With ``ZeroConfig.sequence_parallel_size=K`` > 1 the K consecutive ranks of a group train on the same sequences,
each on its 1/K of every sequence's tokens (docs/long-context.md).  So ``prepare_data_loader`` shards the data
over the N / K data-parallel groups instead of the N processes (Accelerate's own sharding, with
``num_processes=N / K`` and ``process_index=rank // K``), and the prepared loader yields
``zp.sequence_parallel_batch``'s split: ``input_ids``, ``position_ids`` and ``shift_labels`` of this rank's slice.
The split needs the model's sequence-parallel group, which exists only once the model is prepared (the HF
Trainer prepares its loader first), so the loader finds it at iteration time: the one model this accelerator set
up.  The script's loss must then be ``zp.sequence_parallel_loss`` (or ``zp.tiled_lm_loss(...,
sequence_parallel=model)``), never the model's own ``labels=`` loss on a slice.  A loader for whole sequences
(evaluation inside ``zp.sequence_parallel_of(model).paused()``) is prepared with
``prepare_data_loader(loader, sequence_parallel=False)`` (or inside :meth:`Accelerator.whole_sequence_loaders`):
it is sharded over all N processes, as without sequence parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Iterable, Iterator, Mapping

import accelerate.accelerator
import torch
from accelerate.data_loader import prepare_data_loader as _accelerate_prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

import zero_plugin as zp
from zero_plugin.config import ZeroConfig
from zero_plugin.engines.engine import engine_of
from zero_plugin.loading import materialize
from zero_plugin.sequence.parallel import find_sequence_parallel
from zero_plugin.stage3.inference import InferenceEngine

from . import common, loss_scaling

__all__ = ["Accelerator", "SequenceParallelDataLoader", "ZeroPlugin"]

# Captured at import, before zero_plugin.run rebinds ``accelerate.Accelerator`` to the subclass below.
_AccelerateAccelerator = accelerate.accelerator.Accelerator

_REPLACED_BACKENDS = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}
_REPLACED_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin")
_PAIR_HINT = "prepare them in one call: model, optimizer = accelerator.prepare(model, optimizer)"


@dataclasses.dataclass(frozen=True)
class ZeroPlugin:
    """zero_plugin's counterpart of Accelerate's ``DeepSpeedPlugin``: one :class:`zp.ZeroConfig`."""

    config: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.config, ZeroConfig):
            raise ValueError(f"ZeroPlugin.config must be a zp.ZeroConfig, got {type(self.config).__name__}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeroPlugin:
        """From the ``ZERO_PLUGIN_*`` variables (see ``ZeroConfig.from_env``)."""
        return cls(ZeroConfig.from_env(environ))

    @classmethod
    def coerce(cls, value: Any) -> ZeroPlugin:
        """A ZeroPlugin from a ZeroPlugin, a ZeroConfig, a mapping of ZeroConfig fields, or None (environment)."""
        if value is None:
            return cls.from_env()
        if isinstance(value, ZeroPlugin):
            return value
        if isinstance(value, ZeroConfig):
            return cls(value)
        if isinstance(value, Mapping):
            return cls(ZeroConfig.from_dict(value))
        raise ValueError(
            f"Accelerator(zero_plugin=...) must be a ZeroPlugin, a zp.ZeroConfig or a dict of "
            f"ZeroConfig fields; got {type(value).__name__}"
        )


class Accelerator(_AccelerateAccelerator):
    """``accelerate.Accelerator`` that shards with zero_plugin instead of wrapping in DDP.

    ``zero_plugin``: a :class:`ZeroPlugin`, a ``zp.ZeroConfig`` or a dict of its fields;
    default: ``ZeroConfig.from_env()``.  Every other argument is Accelerate's.
    """

    def __init__(self, *args: Any, zero_plugin: Any = None, **kwargs: Any) -> None:
        self.zero_plugin = ZeroPlugin.coerce(zero_plugin)  # a bad config fails before any process group work
        given = [name for name in _REPLACED_PLUGINS if kwargs.get(name) is not None]
        if given:
            raise ValueError(
                f"zero_plugin's Accelerator replaces DeepSpeed/FSDP/Megatron sharding; remove "
                f"{', '.join(given)} (choose the ZeRO stage with ZeroConfig instead)"
            )
        self._split_loaders = True  # [Note: sequence-parallel data loaders]
        super().__init__(*args, **kwargs)
        self._check_launch()
        self._route_fp16()

    @property
    def zero_config(self) -> ZeroConfig:
        return self.zero_plugin.config

    def _check_launch(self) -> None:
        backend = _REPLACED_BACKENDS.get(self.distributed_type)
        if backend is not None:
            raise ValueError(
                f"zero_plugin's Accelerator was launched with {backend} ({self.distributed_type}); "
                "zero_plugin replaces it: launch without --use_deepspeed/--use_fsdp, e.g. "
                "`zero-plugin launch --stage 3 ...`"
            )
        started = int(os.environ.get("WORLD_SIZE", "1"))
        if started > 1 and self.num_processes == 1:
            raise RuntimeError(
                f"{started} processes were started (WORLD_SIZE={started}) but Accelerate set up a single-process "
                f"run ({self.distributed_type}), so each process would train alone. On a machine without GPUs set "
                "ACCELERATE_USE_CPU=true (gloo), or launch with `zero-plugin launch`, which does that for you."
            )

    def _route_fp16(self) -> None:
        """``mixed_precision="fp16"`` (argument, ``accelerate launch --mixed_precision fp16`` or config file):
        parameters as they are, autocast fp16, and zero_plugin's synchronized loss scaler instead of Accelerate's
        GradScaler ([Note: fp16 one-flag mapping] in ``loss_scaling.py``)."""
        if self.mixed_precision != "fp16":
            return
        kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
        settings = loss_scaling.scaler_settings(kwargs)
        self.zero_plugin = ZeroPlugin(
            loss_scaling.fp16_config(self.zero_config, settings, "Accelerate's mixed_precision='fp16'")
        )
        self.scaler = None  # Accelerate's own GradScaler (made on accelerator devices) is never used
        self.native_amp = True  # autocast fp16 on every device; Accelerate alone skips it on CPU

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        """Accelerate's ``prepare``; each trainable model is sharded with its optimizer first.

        See [Note: model and optimizer are prepared together].
        """
        args = list(args)
        placements = device_placement or [None] * len(args)
        for model_index, optimizer_indices in self._pairs_to_set_up(args):
            optimizers = [args[j] for j in optimizer_indices]
            wrapped = self._set_up(args[model_index], optimizers, placements[model_index])
            for j, zero_optimizer in zip(optimizer_indices, wrapped):
                args[j] = zero_optimizer
        return super().prepare(*args, device_placement=device_placement)

    def _pairs_to_set_up(self, args: list[Any]) -> list[tuple[int, list[int]]]:
        """(model index, optimizer indices) of each trainable model not yet set up and the optimizers over its
        parameters: one, or several over disjoint parameters (Muon + AdamW: [Note: several optimizers] in
        ``engines/engine.py``)."""
        fresh_optimizers = {
            i: a
            for i, a in enumerate(args)
            if isinstance(a, torch.optim.Optimizer) and common.zero_optimizer_of(a) is None
        }
        pairs = []
        for i, obj in enumerate(args):
            if not isinstance(obj, nn.Module) or _set_up_for_training(obj) or not _has_trainable(obj):
                continue
            ids = {id(p) for p in obj.parameters()}
            owners = [
                j
                for j, opt in fresh_optimizers.items()
                if all(id(p) in ids for g in opt.param_groups for p in g["params"])
            ]
            if not owners:
                raise ValueError(
                    f"zero_plugin: prepare() got a trainable {type(obj).__name__} and no optimizer over its "
                    f"parameters; zp.setup shards a model together with its optimizers, so {_PAIR_HINT}"
                )
            pairs.append((i, owners))
            for j in owners:
                del fresh_optimizers[j]
        if fresh_optimizers:
            raise ValueError(
                f"zero_plugin: prepare() got an optimizer whose model is not in the same call; {_PAIR_HINT}"
            )
        return pairs

    def _set_up(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], device_placement: bool | None):
        place = self.device_placement if device_placement is None else device_placement
        if place and self.device.type != "cpu":
            place_before_setup(model, self.device, self.zero_config.stage)
        _, zero_optimizers = zp.setup(model, optimizers if len(optimizers) > 1 else optimizers[0], self.zero_config)
        return zero_optimizers if len(optimizers) > 1 else [zero_optimizers]

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """No DDP wrapper: a set-up model only gets Accelerate's autocast / compile (its evaluation mode).

        A model without trainable parameters, or prepared with ``evaluation_mode=True`` (TRL's reference and
        teacher models, the Trainer's evaluation before training), is set up for evaluation only: sharded at
        stage 3 (``zp.setup(model, None, config)``, [Note: evaluation-only models] in
        ``zero_plugin/stage3/inference.py``), replicated at stages 0-2 (a lazily loaded one is loaded in
        full there: it would stay on meta).
        """
        if common.is_set_up(model):
            device_placement = False  # placed before sharding, see _set_up
        elif not evaluation_mode and _has_trainable(model):
            raise ValueError(f"zero_plugin: prepare_model() alone cannot shard a trainable model; {_PAIR_HINT}")
        elif self.zero_config.stage == 3:
            self._set_up_for_evaluation(model, device_placement)
            device_placement = False
        elif materialize.load_in_full(model):
            warnings.warn(
                "zero_plugin: a lazily loaded model was prepared without an optimizer at stage "
                f"{self.zero_config.stage}, so it is not sharded; every process has now loaded it in "
                "full from its files (stage 3 shards it)",
                stacklevel=2,
            )
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def _set_up_for_evaluation(self, model: nn.Module, device_placement: bool | None) -> None:
        place = self.device_placement if device_placement is None else device_placement
        if place and self.device.type != "cpu":
            place_before_setup(model, self.device, 3)
        zp.setup(model, None, self.zero_config)

    # -- data loaders under sequence parallelism ---------------------------------------------------
    @property
    def sequence_parallel_size(self) -> int:
        """K, the ranks that share each sequence (``ZeroConfig.sequence_parallel_size``, checked against the world
        size here)."""
        return self.zero_config.resolved_sequence_parallel_size(self.num_processes)

    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
        sequence_parallel: bool | None = None,
    ):
        """Accelerate's, except with ``sequence_parallel_size`` K > 1: sharded over the data-parallel groups and
        split per rank ([Note: sequence-parallel data loaders]).  ``sequence_parallel=False``: whole sequences,
        sharded over all processes (default: True when K > 1, unless inside :meth:`whole_sequence_loaders`)."""
        split = self._split_loaders if sequence_parallel is None else sequence_parallel
        if self.sequence_parallel_size == 1 or not split or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = self.device_placement
        k = self.sequence_parallel_size
        if self.dispatch_batches or (self.dispatch_batches is None and device_placement and _iterable(data_loader)):
            raise ValueError(
                f"zero_plugin: sequence_parallel_size={k} with dispatch_batches (Accelerate's default for an "
                "IterableDataset) is not supported: its process 0 hands batches out over all processes, not the "
                "data-parallel groups; pass DataLoaderConfiguration(dispatch_batches=False) (TrainingArguments("
                "accelerator_config={'dispatch_batches': False})) so that each group reads its own shard"
            )
        prepared = _accelerate_prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes // k,
            process_index=self.process_index // k,
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return SequenceParallelDataLoader(prepared, self)

    @contextlib.contextmanager
    def whole_sequence_loaders(self) -> Iterator[None]:
        """Data loaders prepared inside the block are not split (``prepare_data_loader(sequence_parallel=False)``):
        evaluation loaders whose whole sequences run inside ``zp.sequence_parallel_of(model).paused()``."""
        before, self._split_loaders = self._split_loaders, False
        try:
            yield
        finally:
            self._split_loaders = before

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0):
        """Accelerate's, keeping a sequence-parallel loader's data-parallel shard and split."""
        if isinstance(dataloader, SequenceParallelDataLoader):
            return SequenceParallelDataLoader(super().skip_first_batches(dataloader.loader, num_batches), self)
        return super().skip_first_batches(dataloader, num_batches)

    def sequence_parallel_model(self) -> nn.Module:
        """The one model this accelerator set up with sequence parallelism, whose group the loaders split for."""
        found = [m for m, _ in self._zero_pairs() if find_sequence_parallel(m) is not None]
        found += [m for m in self._models if find_sequence_parallel(m) is not None and m not in found]
        if len(found) != 1:
            raise ValueError(
                f"zero_plugin: a sequence-parallel data loader (sequence_parallel_size={self.sequence_parallel_size}) "
                f"needs exactly one model prepared by this Accelerator with sequence parallelism; found {len(found)}: "
                "prepare the model and its optimizer (accelerator.prepare(model, optimizer, ...)) before iterating"
            )
        return found[0]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        """An ``AcceleratedOptimizer`` over the ``ZeroOptimizer`` (which already placed its state)."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        zero_optimizer = common.zero_optimizer_of(optimizer)
        if zero_optimizer is None:
            raise ValueError(f"zero_plugin: prepare_optimizer() alone cannot shard an optimizer; {_PAIR_HINT}")
        prepared = _ZeroAcceleratedOptimizer(zero_optimizer, device_placement=False, scaler=None)
        self._optimizers.append(prepared)
        return prepared

    # -- training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` scaled by 1/gradient_accumulation_steps; zero_plugin's hooks reduce the gradients."""
        if not self._zero_pairs():
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)  # LOMO's argument; not an autograd one
        self._scale(loss / self.gradient_accumulation_steps).backward(**kwargs)

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: ``loss`` times the loss scale (one scaled backward serves one set-up model's scaler)."""
        scaling = [o for _, o in self._zero_pairs() if common.zero_optimizer_of(o).guard.scaling]
        if len(scaling) > 1:
            raise ValueError(
                "zero_plugin: fp16 loss scaling with more than one set-up model per Accelerator is not "
                "supported (each optimizer keeps its own scale, so one scaled loss cannot serve both); "
                "use mixed_precision='bf16', or one model"
            )
        return common.zero_optimizer_of(scaling[0]).scale_loss(loss) if scaling else loss

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """``zp.no_sync`` for a set-up model (``accumulate`` enters this while ``sync_gradients`` is False)."""
        if not common.is_set_up(model):
            with super().no_sync(model):
                yield
            return
        with zp.no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        """Global norm over every rank's shard of the reduced gradients (``zp.clip_grad_norm_``)."""
        parameters = list(parameters)
        model = self._zero_model_of(parameters, "clip_grad_norm_")
        if model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return zp.clip_grad_norm_(model, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp the reduced gradients this rank owns (elementwise, so shards clamp like the whole)."""
        parameters = list(parameters)
        model = self._zero_model_of(parameters, "clip_grad_value_")
        if model is None:
            return super().clip_grad_value_(parameters, clip_value)
        for set_up, optimizer in self._zero_pairs():
            if set_up is model:
                # clamp true values, as Accelerate does; an overflow the clamp hides still skips the step
                common.zero_optimizer_of(optimizer).guard.check_before_clamp()
        for grad in common.owned_grads(model):
            grad.clamp_(-clip_value, clip_value)
        return None

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """fp16: divide this step's reduced gradients by the loss scale (once per step; ``clip_grad_norm_`` does it
        itself).  ``optimizer``: one prepared optimizer, a list of them, or None for every one."""
        pairs = self._zero_pairs()
        if not pairs:
            return super().unscale_gradients(optimizer)
        chosen = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        chosen_ids = {id(common.zero_optimizer_of(o)) for o in chosen if o is not None}
        for _, prepared in pairs:
            zero_optimizer = common.zero_optimizer_of(prepared)
            if optimizer is None or id(zero_optimizer) in chosen_ids:
                zero_optimizer.unscale_()

    # -- state ------------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Collective for a set-up model: rank 0 gets full CPU tensors, other ranks ``{}`` (``zp.full_state_dict``)."""
        if common.is_set_up(model):
            return zp.full_state_dict(model)
        return super().get_state_dict(model, unwrap=unwrap)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Accelerate's ``save_state``; each set-up model and its optimizer go to ``zero_plugin_<i>/``.

        Collective.  Schedulers, samplers, RNG states and custom objects are saved by Accelerate as usual.
        """
        pairs = self._zero_pairs()
        if not pairs:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

        def save_zero(models: list, weights: list, out_dir: str) -> None:
            for i, (model, optimizer) in enumerate(pairs):
                common.save_sharded(os.path.join(out_dir, f"zero_plugin_{i}"), model, optimizer)

        with self._zero_objects_hidden(pairs), _hook(self.register_save_state_pre_hook(save_zero)):
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        """Inverse of :meth:`save_state`; collective.  Reshards when ``zp.load_checkpoint`` is available.  Also
        reads a ``save_state`` directory written under DeepSpeed ZeRO (:func:`_sharded_folder`)."""
        pairs = self._zero_pairs()
        if not pairs:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

        def load_zero(models: list, in_dir: str) -> None:
            for i, (model, optimizer) in enumerate(pairs):
                common.load_sharded(_sharded_folder(in_dir, i), model, optimizer)

        with self._zero_objects_hidden(pairs), _hook(self.register_load_state_pre_hook(load_zero)):
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def free_memory(self, *objects: Any):
        """Accelerate's ``free_memory``; set-up models among ``objects`` also lose zero_plugin's hooks."""
        for obj in objects:
            zero_optimizer = common.zero_optimizer_of(obj)
            model = zero_optimizer.engine.model if zero_optimizer is not None else obj
            if common.is_set_up(model):
                common.release(model)
        return super().free_memory(*objects)

    # -- helpers ------------------------------------------------------------------------------------
    def _zero_pairs(self) -> list[tuple[nn.Module, AcceleratedOptimizer]]:
        """(model, prepared optimizer) for every optimizer this accelerator prepared over a ZeroOptimizer."""
        pairs = []
        for optimizer in self._optimizers:
            zero_optimizer = common.zero_optimizer_of(optimizer)
            if zero_optimizer is not None:
                pairs.append((zero_optimizer.engine.model, optimizer))
        return pairs

    def _zero_model_of(self, parameters: list[torch.Tensor], verb: str) -> nn.Module | None:
        """The set-up model these parameters belong to (None if none); they must cover its trainable ones."""
        given = {id(p) for p in parameters}
        for model, _ in self._zero_pairs():
            ids = {id(p) for p in model.parameters()}
            if not given & ids:
                continue
            trainable = {id(p) for p in model.parameters() if p.requires_grad}
            if not given <= ids or not trainable <= given:
                raise ValueError(
                    f"zero_plugin: {verb} over a subset of a sharded model's parameters is not "
                    f"supported (the norm is global over all shards); pass model.parameters()"
                )
            return model
        return None

    @contextlib.contextmanager
    def _zero_objects_hidden(self, pairs: list) -> Iterator[None]:
        """Hide set-up models and their optimizers from Accelerate's generic save/load of state dicts."""
        models, optimizers = self._models, self._optimizers
        hidden_models = {id(m) for m, _ in pairs}
        hidden_optimizers = {id(o) for _, o in pairs}
        self._models = [m for m in models if id(m) not in hidden_models and not common.is_set_up(m)]
        self._optimizers = [o for o in optimizers if id(o) not in hidden_optimizers]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers


class _ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` whose ``step_was_skipped`` reports zero_plugin's skip (inf/NaN on any rank), so
    Accelerate's scheduler wrapper and the HF Trainer treat it as they treat a GradScaler's skip."""

    def step(self, closure=None):
        skipped_before = self.optimizer.skipped_steps
        result = super().step(closure)
        if self.gradient_state.sync_gradients:
            self._is_overflow = self.optimizer.skipped_steps > skipped_before
        return result


class SequenceParallelDataLoader(zp.SequenceParallelLoader):
    """An Accelerate-prepared loader (sharded over the data-parallel groups) whose batches are split for this rank
    ([Note: sequence-parallel data loaders]) for the accelerator's model, looked up at the first batch (the HF
    Trainer prepares the model after the loader); ``len``, ``set_epoch``, the sampler and the rest pass through."""

    def __init__(self, loader: Any, accelerator: Accelerator) -> None:
        super().__init__(loader, accelerator.sequence_parallel_model)


def _iterable(data_loader: Any) -> bool:
    return isinstance(getattr(data_loader, "dataset", None), torch.utils.data.IterableDataset)


@torch.no_grad()
def place_before_setup(model: nn.Module, device: torch.device, stage: int) -> None:
    """Move what ``zp.setup`` expects on ``device`` there, without a full model on it at stage 3 ([Note: no full
    model on the device])."""
    if stage < 3 and not any(p.is_meta for p in model.parameters()):
        model.to(device)
        return
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
        if stage < 3:
            for param in module._parameters.values():
                if param is not None and not param.is_meta and param.device != device:
                    param.data = param.data.to(device)


def _set_up_for_training(model: nn.Module) -> bool:
    """Set up with an optimizer; a model set up for evaluation only may still be paired with one."""
    return common.is_set_up(model) and not isinstance(engine_of(model, "prepare"), InferenceEngine)


def _has_trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


@contextlib.contextmanager
def _hook(handle) -> Iterator[None]:
    try:
        yield
    finally:
        handle.remove()


def _sharded_folder(in_dir: str, i: int) -> str:
    """The folder of the ``i``-th model's state in a ``save_state`` directory: ours (``zero_plugin_<i>/``), or
    what Accelerate's ``save_state`` wrote under DeepSpeed (``pytorch_model/``, ``pytorch_model_<i>/``), which
    ``zp.load_checkpoint`` reads as well."""
    ours = os.path.join(in_dir, f"zero_plugin_{i}")
    deepspeed = os.path.join(in_dir, "pytorch_model" if i == 0 else f"pytorch_model_{i}")
    return deepspeed if not os.path.isdir(ours) and os.path.isdir(deepspeed) else ours
