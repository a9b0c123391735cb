"""Helpers shared by the Lightning Trainer strategy and the Fabric strategy.

Both strategies are thin adapters: this module owns the presets, the one-optimizer
setup (and re-setup) rules, clipping, the precision policy and the checkpoint layout,
so that ``lightning/strategy.py`` and ``lightning/fabric.py`` only map Lightning's hooks
onto these functions.  Nothing here imports Lightning: the same helpers serve
``lightning.pytorch`` / ``lightning.fabric`` and the standalone ``pytorch_lightning`` /
``lightning_fabric`` packages.

[Note: sharded checkpoint directory]
A sharded checkpoint (the default) is a directory::

    <path>/zero/       zp.save_checkpoint(...): every rank's regions (any stage, any world size on load);
                       the same format as the Accelerate integration's checkpoints (``common.py``)
    <path>/meta.pt     rank 0, written last (a directory without it is an interrupted save): everything
                       Lightning/Fabric saves except model and optimizer state (loops, callbacks,
                       LR schedulers, user values), torch.save format; plus the ``zero_plugin`` record
                       (``zero_plugin/ckpt/lightning_file.py``: tied parameter names, Fabric's state keys)

Lightning's own loaders (``LightningModule.load_from_checkpoint``, other strategies) open one file and
raise ``IsADirectoryError`` before we run: ``zero-plugin consolidate <path> OUT.ckpt --format lightning``
writes that file (:data:`LOAD_HINT`, logged at the first sharded save).

A full checkpoint is one file in Lightning's usual format (full ``state_dict`` and the
consolidated optimizer state), written by rank 0 and loadable without zero_plugin.

[Note: checkpoints of Lightning's other strategies]
``Trainer.fit(ckpt_path=...)`` under a ZeRO strategy also resumes what Lightning's own sharded strategies save,
at any stage and world size here (:func:`load_foreign`):

    DeepSpeedStrategy       <path>/latest ("checkpoint") + <path>/checkpoint/*_model_states.pt, *_optim_states.pt;
                            Lightning's state (loops, callbacks, lr_schedulers, ...) is DeepSpeed's client_state
    FSDPStrategy (sharded), a DCP folder: model.* (FSDPStrategy) or state_dict.* (ModelParallelStrategy) and
    ModelParallelStrategy   optimizer_0.*, with Lightning's state in <path>/meta.pt

``zp.load_checkpoint`` reads the weights and optimizer state (``ckpt/deepspeed_reader.py``, ``ckpt/dcp_source.py``);
the rest goes back to Lightning as the checkpoint dict, so loops, callbacks and LR schedulers resume as the writer
left them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.ckpt import dcp_reader, deepspeed_reader, lightning_file, regions
from zero_plugin.engines.engine import Engine, engine_of
from zero_plugin.loading import materialize
from zero_plugin.loading.meta_init import ModuleInitSource, check_initialisable, has_meta_buffers, safetensors_under

from .. import common, loss_scaling
from ..common import is_set_up

__all__ = [
    "PRESETS",
    "SUPPORTED_PRECISIONS",
    "resolve_config",
    "check_precision",
    "check_precision_plugin",
    "loss_scaler_settings",
    "engine_config",
    "scale_loss",
    "unscale",
    "engine_or_none",
    "is_set_up",
    "shard",
    "shard_for_inference",
    "rebind_optimizer",
    "zero_optimizer_of",
    "clip_grad_norm",
    "clip_grad_value",
    "full_parameters",
    "full_model_state",
    "full_optimizer_state",
    "uses_sharded_files",
    "is_sharded_checkpoint",
    "save_sharded",
    "load_sharded",
    "load_full",
    "foreign_layout",
    "load_foreign",
    "move_to_device",
    "register_presets",
    "builds_on_meta",
    "source_for",
    "check_loadable_directory",
    "LOAD_HINT",
    "RECORD",
]

# One entry per registered strategy name; each value is a full ZeroConfig, nothing else varies.
PRESETS: dict[str, zp.ZeroConfig] = {
    "zero1": zp.ZeroConfig(stage=1),
    "zero2": zp.ZeroConfig(stage=2),
    "zero2_offload": zp.ZeroConfig(stage=2, offload_optimizer="cpu"),
    "zero3": zp.ZeroConfig(stage=3),
    "zero3_offload": zp.ZeroConfig(stage=3, offload_optimizer="cpu", offload_params=True),
}
_DESCRIPTIONS = {
    "zero1": "ZeRO stage 1 (optimizer state sharded)",
    "zero2": "ZeRO stage 2 (optimizer state and gradients sharded)",
    "zero2_offload": "ZeRO stage 2 with optimizer state and step on CPU (ZeRO-Offload)",
    "zero3": "ZeRO stage 3 (parameters, gradients and optimizer state sharded)",
    "zero3_offload": "ZeRO stage 3 with optimizer state and parameter shards on CPU",
}

# Lightning precision flags whose plugin the strategies keep for dtypes/autocast; 16-mixed's GradScaler is
# replaced by zero_plugin's loss scaler (loss_scaler_settings).
SUPPORTED_PRECISIONS = ("32-true", "64-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
_FP16_FLAG = "Lightning's precision='16-mixed'"
META_FILE = lightning_file.META_FILE
SHARDS_DIR = lightning_file.SHARDS_DIR
RECORD = lightning_file.RECORD
LOAD_HINT = (
    "zero_plugin: checkpoints are sharded directories ({path}). To load one without the ZeRO strategy "
    "(LightningModule.load_from_checkpoint, fabric.load or another strategy), first write it as one "
    "file: zero-plugin consolidate {path} OUT.ckpt --format lightning"
)
_CHECKPOINT_MODES = ("sharded", "full")


# -- configuration ---------------------------------------------------------------
def resolve_config(config: zp.ZeroConfig | str | Mapping | None) -> zp.ZeroConfig:
    """A ZeroConfig from a config, a preset name, a dict of fields, or None (``ZeroConfig.from_env()``)."""
    if config is None:
        return zp.ZeroConfig.from_env()
    if isinstance(config, zp.ZeroConfig):
        return config
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(
                f"ZeroStrategy: unknown preset {config!r}; choose one of {', '.join(PRESETS)} "
                "or pass config=zp.ZeroConfig(...)"
            )
        return PRESETS[config]
    if isinstance(config, Mapping):
        return zp.ZeroConfig.from_dict(config)
    raise ValueError(
        f"ZeroStrategy: config must be a zp.ZeroConfig, a preset name or a dict; got {type(config).__name__}"
    )


def check_checkpoint_mode(mode: str) -> str:
    if mode not in _CHECKPOINT_MODES:
        raise ValueError(f"ZeroStrategy: checkpoint must be one of {_CHECKPOINT_MODES}; got {mode!r}")
    return mode


def check_precision(precision: str) -> str:
    """Raise a clear error for precision flags the engine cannot run; return the flag."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"zero_plugin: precision={precision!r} is not supported with ZeRO; choose one of "
            f"{', '.join(SUPPORTED_PRECISIONS)}"
        )
    return precision


def check_precision_plugin(plugin: Any, supported: tuple[type, ...], owner: str, flag: str) -> dict | None:
    """Refuse a precision plugin the strategies cannot run; return its :func:`loss_scaler_settings`.

    ``supported``: Lightning's own plugins for the flags of :data:`SUPPORTED_PRECISIONS`, as exact types (a
    subclass may change the step); ``owner`` and ``flag`` (``"Trainer(precision=...)"``) name the strategy and
    the argument in the message.
    """
    if type(plugin) not in supported:
        raise ValueError(
            f"{owner}: the precision plugin {type(plugin).__name__} is not supported; use {flag} with one of "
            f"{', '.join(SUPPORTED_PRECISIONS)}"
        )
    check_precision(str(plugin.precision))
    return loss_scaler_settings(plugin)


# -- fp16: Lightning's GradScaler replaced ([Note: fp16 one-flag mapping] in loss_scaling.py) ------------------
def loss_scaler_settings(plugin: Any) -> dict | None:
    """The ZeroConfig fields that take over a ``16-mixed`` plugin's GradScaler; None for other precisions.

    Its init scale (the current scale, for a scaler that has already run) and growth interval carry over; a
    disabled or absent scaler means no scaling; any other scaler, or other factors, are refused.
    """
    if str(plugin.precision) != "16-mixed":
        return None
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
        raise ValueError(
            f"zero_plugin: {_FP16_FLAG} with a {type(scaler).__name__} is not supported; zero_plugin "
            "replaces the plugin's torch.amp.GradScaler by its own synchronized loss scaler, which "
            "reproduces only torch's GradScaler (init_scale, growth_interval, enabled)"
        )
    if scaler is None or not scaler.is_enabled():  # a disabled GradScaler has no factors to read
        return loss_scaling.scaler_settings({"enabled": False})
    return loss_scaling.scaler_settings(
        {
            "init_scale": scaler.get_scale(),
            "growth_interval": scaler.get_growth_interval(),
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
        }
    )


def engine_config(config: zp.ZeroConfig, scaler_settings: dict | None) -> zp.ZeroConfig:
    """The config the engine runs: ``config``, with loss scaling on when a 16-mixed GradScaler is replaced."""
    return config if scaler_settings is None else loss_scaling.fp16_config(config, scaler_settings, _FP16_FLAG)


def scale_loss(modules: Iterable[nn.Module], loss: torch.Tensor) -> torch.Tensor:
    """fp16: ``loss`` times the loss scale of the set-up module's optimizer (one scaled backward serves one
    scaler); other precisions, or no set-up module: ``loss``."""
    trained = [m for m in modules if any(p.requires_grad for p in m.parameters())]  # not a frozen teacher
    scaling = {id(o): o for o in map(_training_optimizer, trained) if o is not None and o.guard.scaling}
    if len(scaling) > 1:
        raise ValueError(
            "zero_plugin: fp16 loss scaling with more than one set-up model: each optimizer keeps its "
            "own scale, so one scaled loss cannot serve both; pass model= to fabric.backward, use "
            "precision='bf16-mixed', or one model"
        )
    return next(iter(scaling.values())).scale_loss(loss) if scaling else loss


def unscale(optimizer: Any) -> None:
    """fp16: divide this step's reduced gradients by the loss scale (once per step; a no-op without scaling)."""
    zero_optimizer_of(optimizer).unscale_()


def _zero_optimizer_for(optimizer_or_module: Any) -> zp.ZeroOptimizer:
    if isinstance(optimizer_or_module, nn.Module):
        return engine_of(optimizer_or_module, "clip_grad_value").optimizer
    return zero_optimizer_of(optimizer_or_module)


def _training_optimizer(module: nn.Module) -> zp.ZeroOptimizer | None:
    engine = engine_or_none(module)
    return engine.optimizer


# -- engine lookup ------------------------------------------------------------------
def engine_or_none(module: nn.Module | None) -> Engine | None:
    return engine_of(module, "integrations") if is_set_up(module) else None


def zero_optimizer_of(optimizer: Any) -> zp.ZeroOptimizer:
    """The ZeroOptimizer behind a LightningOptimizer / _FabricOptimizer / ZeroOptimizer."""
    found = common.zero_optimizer_of(optimizer)
    if found is None:
        raise ValueError(
            f"zero_plugin: expected the optimizer set up by the ZeRO strategy, got {type(optimizer).__name__}"
        )
    return found


# -- setup ------------------------------------------------------------------------------
def _only_optimizer(optimizers: Iterable[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise ValueError(
            f"zero_plugin: the ZeRO strategy supports exactly one optimizer (it is sharded together with the "
            f"model); got {len(optimizers)}. Put every parameter in one optimizer with several param groups; two "
            "optimizers of different classes over one model (Muon + AdamW) run through zp.setup(model, [muon, "
            "adamw], config) or Accelerate's prepare (docs/optimizers.md), not yet through Lightning"
        )
    return optimizers[0]


# -- building on meta ([Note: meta construction]) ------------------------------------------------
# [Note: meta construction]
# Lightning builds models inside ``strategy.tensor_init_context(empty_init)`` (``trainer.init_module``,
# and ``configure_model`` with empty_init=None) or Fabric's ``module_init_context(empty_init)``.
# ``builds_on_meta`` decides, once for both strategies:
#   * empty_init=False: real parameters, as ever (the user wants eager init);
#   * stage 3 (unless ``meta_init=False``), or any stage given a ``param_source``: parameters on the
#     meta device, buffers real (``zero_plugin.loading.meta_init.meta_parameters``); setup materialises them,
#     at stage 3 one unit at a time, from the source or from each module's own init;
#   * otherwise (stages 0-2, no source) exactly Lightning's DDP: empty_init=True skips the
#     ``torch.nn.init`` calls (``_EmptyInit``: uninitialised memory, to be overwritten by a checkpoint
#     load; ``zp.setup`` broadcasts rank 0's values), None/False initialise normally.
# The meta context lives in ``tensor_init_context`` / ``module_init_context`` only: overriding
# ``model_sharded_context`` would make ``trainer.init_module`` warn that the strategy cannot support it.
def builds_on_meta(config: zp.ZeroConfig, empty_init: bool | None, meta_init: bool, param_source: Any) -> bool:
    if empty_init is False:
        return False
    return (config.stage == 3 and meta_init) or param_source is not None


def source_for(module: nn.Module, param_source: Any) -> materialize.ParamSource | None:
    """The ParamSource that fills ``module``'s meta parameters at setup; None when it has none.

    Checked on every rank before any collective, so a module that cannot be initialised fails
    everywhere with one clear error instead of one rank raising inside a broadcast.
    """
    buffer = has_meta_buffers(module)
    if buffer is not None:
        raise ValueError(
            f"zero_plugin: buffer {buffer!r} is on the meta device; the ZeRO strategies "
            "materialise parameters only. Build the model under trainer.init_module(empty_init=True) "
            "/ fabric.init_module(empty_init=True) or in configure_model (parameters on meta, "
            "buffers real) instead of under torch.device('meta')"
        )
    if not materialize.has_meta_params(module):
        if param_source is not None:
            warnings.warn(
                "zero_plugin: param_source is ignored: the model was built with real parameters "
                "(empty_init=False, or built outside init_module/configure_model)",
                stacklevel=3,
            )
        return None
    if isinstance(param_source, (str, os.PathLike)):
        return safetensors_under(param_source)
    if param_source is not None:
        return materialize.as_source(param_source)
    recorded = materialize.recorded_source(module)  # a lazy from_pretrained ([Note: recorded sources])
    if recorded is not None:
        return recorded
    check_initialisable(module)
    return ModuleInitSource(module)


def shard(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], config: zp.ZeroConfig, param_source: Any = None
) -> zp.ZeroOptimizer:
    """``zp.setup`` the module with its one optimizer; if the module already is set up, bind the new optimizer.

    Collective.  Meta-device parameters are materialised from ``source_for(module, param_source)``.
    """
    optimizer = _only_optimizer(optimizers)
    if isinstance(optimizer, zp.ZeroOptimizer):
        return optimizer
    engine = engine_or_none(module)
    if engine is None:
        return zp.setup(module, optimizer, config, param_source=source_for(module, param_source))[1]
    _check_same_config(engine, config)
    return rebind_optimizer(module, engine, optimizer)


def shard_for_inference(module: nn.Module, config: zp.ZeroConfig, param_source: Any = None) -> None:
    """Set up a module without a user optimizer (validate/test/predict, Fabric's ``setup_module``).

    A placeholder SGD(lr=0) over the trainable parameters keeps the engine the same as for
    training, so that a later ``fit`` only binds its real optimizer (``rebind_optimizer``).
    """
    if is_set_up(module):
        return
    trainable = [p for p in module.parameters() if p.requires_grad]
    zp.setup(
        module, torch.optim.SGD([{"params": trainable}], lr=0.0), config, param_source=source_for(module, param_source)
    )


def rebind_optimizer(module: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer) -> zp.ZeroOptimizer:
    """Wrap a fresh optimizer over an already sharded module (a second fit, or fit after validate)."""
    return zp.rebind_optimizer(module, optimizer)


def _check_same_config(engine: Engine, config: zp.ZeroConfig) -> None:
    if engine.config != config:
        raise ValueError(
            f"zero_plugin: this module was already sharded with stage={engine.config.stage} "
            f"({engine.config.to_dict()}); it cannot be set up again with stage={config.stage}. "
            "Use the same strategy config for every trainer, or a fresh module"
        )


@contextlib.contextmanager
def full_parameters(module: nn.Module):
    """Collective.  Inside, an already sharded stage-3 module shows full-shape parameters, so that code
    building an optimizer from shapes (``p.ndim >= 2`` groups) sees what it saw before sharding."""
    engine = engine_or_none(module)
    if engine is None or engine.config.stage < 3:
        yield
        return
    with zp.gathered_parameters(module):
        yield


def move_to_device(module: nn.Module, device: torch.device) -> None:
    """Move an unsharded module; a set-up module keeps its placement (the engine owns it), and
    meta-device parameters are left for ``zp.setup``'s materialisation."""
    if is_set_up(module) or any(p.is_meta for p in module.parameters()):
        return
    module.to(device)


# -- gradients ---------------------------------------------------------------------------
def clip_grad_norm(optimizer_or_module: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Global-norm clipping over every rank's reduced gradient shard (collective)."""
    return zp.clip_grad_norm_(_model_for(optimizer_or_module), float(max_norm), float(norm_type))


@torch.no_grad()
def clip_grad_value(optimizer_or_module: Any, clip_val: float) -> None:
    """Element-wise clipping is local, so clipping each rank's reduced shard is exact.  fp16: of the true,
    unscaled gradients, and an overflow the clamp would hide still skips the step (``check_before_clamp``)."""
    _zero_optimizer_for(optimizer_or_module).guard.check_before_clamp()
    for grad in common.owned_grads(_model_for(optimizer_or_module)):
        grad.clamp_(-float(clip_val), float(clip_val))


def _model_for(obj: Any) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    return zero_optimizer_of(obj).engine.model


# -- state -------------------------------------------------------------------------------------
def full_model_state(module: nn.Module) -> dict:
    """Collective once set up: rank 0 gets the full state dict on CPU, the others ``{}``.
    (Not set up yet: every rank's own ``state_dict()``.)"""
    if not is_set_up(module):
        return module.state_dict()
    return zp.full_state_dict(module)


def full_optimizer_state(optimizer: Any) -> dict:
    """Collective: rank 0 gets the consolidated (unsharded, torch-format) optimizer state, the others ``{}``."""
    return zero_optimizer_of(optimizer).consolidate_state_dict()


def uses_sharded_files(mode: str) -> bool:
    """``checkpoint="sharded"``: sharded directories (``zp.save_checkpoint``); ``"full"``: one file."""
    return mode == "sharded"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file()


def prepare_path(path: Path, sharded: bool, is_rank0: bool, barrier: Callable[[], None]) -> None:
    """Replace a checkpoint of the other kind at ``path``; never delete a directory that is not ours."""
    if not sharded and path.is_dir() and not is_sharded_checkpoint(path):
        raise IsADirectoryError(f"zero_plugin: the checkpoint path is an existing directory: {path}")
    if is_rank0:
        if sharded and path.is_file():
            path.unlink()
        elif not sharded and path.is_dir():
            shutil.rmtree(path)
        if sharded:
            path.mkdir(parents=True, exist_ok=True)
            (path / META_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
    barrier()


def save_sharded(
    path: Path,
    module: nn.Module,
    optimizer: Any | None,
    meta: dict,
    *,
    is_rank0: bool,
    write: Callable[[dict, Path], None],
    barrier: Callable[[], None],
) -> None:
    """Collective: see [Note: sharded checkpoint directory]; ``write(obj, file)`` is the rank-0 writer."""
    prepare_path(path, True, is_rank0, barrier)
    inner = None if optimizer is None else zero_optimizer_of(optimizer)
    zp.save_checkpoint(str(path / SHARDS_DIR), module, inner)
    if is_rank0:
        record = {**meta.get(RECORD, {}), "aliases": regions.tied_aliases(module)}
        write({**meta, RECORD: record}, path / META_FILE)
    barrier()


def check_loadable_directory(path: Path) -> None:
    """A directory that is not a complete sharded checkpoint: say so, instead of torch.load's IsADirectoryError."""
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"zero_plugin: {path} is a directory without {META_FILE}: not a complete sharded "
            "checkpoint (an interrupted save, or a folder of another kind)"
        )


def load_sharded(path: Path, module: nn.Module, optimizer: Any | None) -> None:
    """Collective: restore the model (and optimizer) regions from ``<path>/zero``, at any stage and world size."""
    inner = None if optimizer is None else zero_optimizer_of(optimizer)
    zp.load_checkpoint(str(path / SHARDS_DIR), module, inner)


def foreign_layout(path: Path) -> str | None:
    """``"deepspeed"`` or ``"dcp"`` when ``path`` is a checkpoint of Lightning's DeepSpeed or FSDP /
    ModelParallel strategy ([Note: checkpoints of Lightning's other strategies]); None otherwise (ours, a file)."""
    if deepspeed_reader.find_tag_dir(os.fspath(path)) is not None:
        return "deepspeed"
    if dcp_reader.find_layout(os.fspath(path)) is not None:
        return "dcp"
    return None


def load_foreign(
    path: Path, kind: str, module: nn.Module, optimizer: Any | None, read_meta: Callable[[Path], dict]
) -> dict:
    """Collective: load a DeepSpeed or DCP checkpoint that Lightning wrote into the set-up module (and optimizer);
    returns the rest of Lightning's checkpoint (``read_meta(file)`` reads a DCP folder's ``meta.pt``)."""
    if kind == "dcp" and not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"zero_plugin: {path} is a torch.distributed.checkpoint folder without Lightning's {META_FILE}: not a "
            "checkpoint Lightning saved, so there is no trainer state to resume. Load its weights (and optimizer "
            "state) with zp.load_checkpoint(path, model, optimizer) in the LightningModule's on_fit_start, and call "
            "fit without ckpt_path"
        )
    if kind == "deepspeed" and "loops" not in deepspeed_reader.client_state_keys(
        deepspeed_reader.find_tag_dir(os.fspath(path))
    ):
        raise ValueError(
            f"zero_plugin: the DeepSpeed checkpoint {path} was not saved by Lightning (its client_state has no "
            "'loops'), so there is no trainer state to resume. Call fit without ckpt_path and load it with "
            "zp.load_checkpoint(path, module, optimizer) in on_fit_start -- into the submodule it was saved from, "
            "when its names lack the LightningModule's attribute prefix"
        )
    inner = None if optimizer is None else zero_optimizer_of(optimizer)
    extra = zp.load_checkpoint(os.fspath(path), module, inner)
    if kind == "dcp":
        return read_meta(path / META_FILE)
    record = extra["deepspeed"]
    client = record["client_state"]
    if record["unreadable"]:
        warnings.warn(
            f"zero_plugin: the DeepSpeed checkpoint {path} holds client_state entries that are not plain values "
            f"and were not read: {record['unreadable']}",
            stacklevel=2,
        )
    return dict(client)


def load_full(
    checkpoint: dict,
    module: nn.Module,
    optimizer: Any | None,
    *,
    strict: bool = True,
    optimizer_state: dict | None = None,
) -> None:
    """Load a full Lightning checkpoint that every rank has read into a set-up module (and optimizer)."""
    state = checkpoint.get("state_dict")
    if state is not None:
        zp.load_full_state_dict(module, state, src_rank=None, strict=strict)
    if optimizer is not None and optimizer_state is not None:
        zero_optimizer_of(optimizer).load_state_dict(optimizer_state)


# -- registration ---------------------------------------------------------------------------
def register_presets(registry: Any, strategy_cls: type) -> None:
    """Register every preset name; idempotent for our class, and never overrides another library's name."""
    for name, config in PRESETS.items():
        entry = dict.get(registry, name)  # the registry's own get() instantiates the strategy
        if isinstance(entry, dict):
            if entry.get("strategy") is strategy_cls:
                continue
            if getattr(entry.get("strategy"), "__module__", "").startswith("zero_plugin."):
                registry.pop(name)  # a previous import of the same module (e.g. a reload)
            else:
                raise ValueError(
                    f"zero_plugin: strategy name {name!r} is already registered by "
                    f"{entry.get('strategy')!r}; not overriding it"
                )
        registry.register(name, strategy_cls, description=_DESCRIPTIONS[name], config=config)


@contextlib.contextmanager
def no_sync(module: nn.Module, enabled: bool = True):
    """``zp.no_sync`` when enabled and the module is set up; otherwise nothing."""
    if not enabled or not is_set_up(module):
        yield
        return
    with zp.no_sync(module):
        yield
