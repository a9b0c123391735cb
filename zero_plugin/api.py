"""Public verbs.  Each finds the model's engine and delegates; none keeps state."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .comm.collectives import Comm
from .config import ZeroConfig
from .engines import validate
from .engines.buffers import BufferSync
from .engines.engine import engine_of, register_engine
from .engines.frozen import FrozenGuard
from .loading import materialize, quantized
from .optim.clip import clip_owned_grads
from .optim.offload import use_fast_cpu_kernels
from .optim.partition import choose_partition
from .optim.state import region_of
from .optim.whole_params import WholeParams
from .optim.zero_optimizer import ZeroOptimizer
from .sequence import offload as activation_offload
from .sequence import parallel as sequence_parallel
from .stages import build_engine, build_inference_engine

__all__ = ["setup", "rebind_optimizer", "clip_grad_norm_", "no_sync", "gathered_parameters"]


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple | None,
    config: ZeroConfig | None = None,
    group: Any = None,
    *,
    param_source: Any = None,
) -> tuple[nn.Module, Any]:
    """Shard ``model`` and ``optimizer`` in place for ``config.stage``; collective over ``group``.

    Returns the same module object and a :class:`ZeroOptimizer` wrapping ``optimizer``.  A list (or tuple) of
    optimizers over disjoint parameters (Muon for the hidden matrices, AdamW for the rest) gives a list (tuple)
    of ZeroOptimizers, each stepping its own parameters in the partition its optimizer needs ([Note: several
    optimizers] in ``engines/engine.py``).
    A model built on the meta device (``zp.materialize.empty_model``) is materialised from
    ``param_source`` (see ``zero_plugin/loading/materialize.py``), by default from the files a lazy
    ``from_pretrained`` recorded (``zero_plugin/loading/lazy_pretrained.py``); at stage 3 one unit at a time.

    ``optimizer=None``: evaluation only (a reference or teacher model), returns ``(model, None)``.  Stage 3
    shards the parameters and gathers them per unit in forward, without gradients or optimizer state
    ([Note: evaluation-only models] in ``stage3/inference.py``); stages 0-2 keep the model replicated
    (rank 0's values broadcast).  Such a model passed again with an optimizer is set up for training.
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ValueError(
            f"zp.setup: config must be a zp.ZeroConfig, got {type(config).__name__}; "
            "build one with zp.ZeroConfig(stage=...) or ZeroConfig.from_dict(...)"
        )
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if any(isinstance(opt, ZeroOptimizer) for opt in optimizers):
        raise ValueError(
            "zp.setup: this optimizer is already a ZeroOptimizer; pass the original model and optimizer once"
        )
    if not isinstance(model, nn.Module):
        raise ValueError(f"zp.setup: model must be a torch.nn.Module, got {type(model).__name__}")
    quantized.check_quantization(model)  # [Note: packed 4-bit weights]: before any collective
    if optimizer is not None:
        _release_evaluation_only(model)
    comm = Comm(group, timeout_s=config.comm.timeout_s, debug=config.debug.collectives)
    trainable = validate.trainable_parameters(model, optimizer) if optimizer is not None else []
    validate.check_ranks_agree(model, config, comm)
    # Ulysses: the attention switched and the groups made before any sharding ([Note: sequence-parallel groups])
    sequence_parallel.enable(model, comm, config.resolved_sequence_parallel_size(comm.world_size))
    quantized.prepare_quantized(model, comm, comm.device if config.stage == 3 else None)
    source = materialize.as_source(param_source)
    if source is None and materialize.has_meta_params(model):
        source = materialize.recorded_source(model)  # [Note: recorded sources] in materialize.py
    if optimizer is None:
        return _setup_for_evaluation(model, config, comm, source, group), None
    # [Note: activation offload]: refused (every rank alike) when nothing is checkpointed
    activation_offload.enable(model, config.offload.activations)
    # before any sharding: a refused optimizer changes nothing
    partitions = [choose_partition(opt, config.offload.optimizer_partition, config.stage) for opt in optimizers]
    if len(optimizers) > 1 and config.scales_loss:
        raise ValueError(
            "zp.setup: several optimizers with loss scaling (fp16) are not supported: the loss scale is one "
            "optimizer's; train in bf16/fp32 (ZeroConfig.loss_scaling=False) or combine the param groups in one optimizer"
        )
    if config.stage < 3:
        materialize.materialize_all(model, source, comm)
        validate.broadcast_module_state(model, comm)
    engine = build_engine(model, trainable, config, _engine_comm(comm, config, group), source)
    materialize.note_set_up(model)
    register_engine(model, engine)
    engine.attach_setup(
        FrozenGuard.attach(model, [s.param for s in engine.slots]),  # [Note: frozen at setup]
        BufferSync.attach(model, comm),
        _cast_inputs_of(model, config),
    )
    wrapped = [
        _wrap_optimizer(opt, engine, partition, len(optimizers) > 1) for opt, partition in zip(optimizers, partitions)
    ]
    engine.attach_optimizer(wrapped[0])
    if isinstance(optimizer, (list, tuple)):
        return model, type(optimizer)(wrapped)
    return model, wrapped[0]


def _wrap_optimizer(optimizer: torch.optim.Optimizer, engine, partition: str, several: bool) -> ZeroOptimizer:
    """Rebind one optimizer to its masters and wrap it; ``several``: one of several optimizers over the model,
    stepping its own slots only ([Note: several optimizers] in engines/engine.py)."""
    slots = None
    if several:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        slots = [s for s in engine.slots if id(s.param) in mine]
    whole = _whole_params(engine, partition, slots)
    _rebind_optimizer(optimizer, engine, whole)
    if engine.config.offload.optimizer == "cpu":
        use_fast_cpu_kernels(optimizer)
    return ZeroOptimizer(optimizer, engine, whole, slots)


def _whole_params(engine, partition: str, slots: list | None = None) -> WholeParams | None:
    """The parameter partition's whole masters of ``slots`` (None: all) ([Note: optimizer partitions] in
    optim/partition.py), or None."""
    if partition != "parameters":
        return None
    slots = engine.slots if slots is None else slots
    return WholeParams(slots, engine.comm, [engine.full_shape(s.param) for s in slots])


def _setup_for_evaluation(model: nn.Module, config: ZeroConfig, comm: Comm, source: Any, group: Any) -> nn.Module:
    """``zp.setup(model, None, config)``: [Note: evaluation-only models] in stage3/inference.py."""
    if config.stage < 3:  # replicated, as DDP leaves a model it does not train
        materialize.materialize_all(model, source, comm)
        validate.broadcast_module_state(model, comm)
        materialize.note_set_up(model)
        return model
    engine = build_inference_engine(model, config, _engine_comm(comm, config, group), source)
    materialize.note_set_up(model)
    register_engine(model, engine)
    engine.attach_setup(None, None, _cast_inputs_of(model, config))
    return model


def _engine_comm(comm: Comm, config: ZeroConfig, group: Any) -> Comm:
    """The group the engine shards over: the whole ``comm``, or with ``shard_group_size`` this rank's shard
    group, which also knows its replica group ([Note: hierarchical groups] in collectives.py)."""
    k = _agreed_shard_group_size(comm, config)
    if k is None:
        return comm
    if group is not None:
        raise ValueError(
            f"ZeroConfig.shard_group_size={config.comm.shard_group_size!r} splits the default process group; "
            "zp.setup got group=...; pass group=None or shard_group_size=None"
        )
    return comm.split(k)


def _agreed_shard_group_size(comm: Comm, config: ZeroConfig) -> int | None:
    """``shard_group_size`` resolved here; "node" reads each rank's own LOCAL_WORLD_SIZE, so the ranks
    compare what they read (setup only) and all raise together rather than split differently."""
    if config.comm.shard_group_size != "node" or config.stage == 0 or comm.world_size == 1:
        return config.resolved_shard_group_size(comm.world_size)
    try:
        mine: int | None | str = config.resolved_shard_group_size(comm.world_size)
    except ValueError as exc:
        mine = str(exc)
    seen = comm.all_gather_object(mine)
    if any(isinstance(s, str) for s in seen) or len(set(seen)) > 1:
        detail = next((s for s in seen if isinstance(s, str)), f"the ranks resolved {seen}")
        raise ValueError(f'ZeroConfig.shard_group_size="node" must give one group size on every rank: {detail}')
    return seen[0]


def _release_evaluation_only(model: nn.Module) -> None:
    """A model set up for evaluation only, now passed with an optimizer: back to full tensors first."""
    from .stage3.inference import InferenceEngine

    try:
        engine = engine_of(model, "setup")
    except ValueError:
        return
    if isinstance(engine, InferenceEngine):
        engine.release_full()


def _cast_inputs_of(model: nn.Module, config: ZeroConfig) -> Any:
    """With ``param_dtype``: the forward pre-hook casting the model's floating inputs (its handle), else None."""
    if config.precision.param_dtype is None:
        return None
    return model.register_forward_pre_hook(
        functools.partial(_cast_inputs, config.precision.param_dtype), with_kwargs=True
    )


def rebind_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
    """Give an already set-up model a new optimizer (e.g. a second ``fit``), over the same trainable parameters.

    Not collective; state in ``optimizer`` (if any) is sliced to this rank's regions.
    """
    engine = engine_of(model, "rebind_optimizer")
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError("zp.rebind_optimizer: pass the plain torch optimizer, not a ZeroOptimizer")
    trainable = validate.trainable_parameters(model, optimizer)
    wanted = {s.name for s in engine.slots}
    got = {name for name, _ in trainable}
    if wanted != got:
        raise ValueError(
            f"zp.rebind_optimizer: the optimizer must train exactly the parameters set up with the "
            f"model; missing {sorted(wanted - got)[:3]}, extra {sorted(got - wanted)[:3]}"
        )
    partition = choose_partition(optimizer, engine.config.offload.optimizer_partition, engine.config.stage)
    zero_optimizer = _wrap_optimizer(optimizer, engine, partition, several=False)
    engine.attach_optimizer(zero_optimizer)
    return zero_optimizer


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args, kwargs):
    """Mixed precision: floating-point inputs enter the model in ``param_dtype`` (as FSDP's cast_forward_inputs)."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

    return torch.utils._pytree.tree_map(cast, (args, kwargs))


def _rebind_optimizer(optimizer: torch.optim.Optimizer, engine, whole: WholeParams | None) -> None:
    """Point the user's param groups at the masters (the parameter partition: the whole masters), carrying over
    any existing state (the parameter partition: on the owner only, whole)."""
    by_param = {id(s.param): s for s in engine.slots}
    old_state = optimizer.state
    new_state: dict = type(old_state)() if not isinstance(old_state, dict) else {}
    for group in optimizer.param_groups:
        masters = []
        for p in group["params"]:
            slot = by_param[id(p)]
            i = None if whole is None else whole.index_of(slot.master)
            master = slot.master if whole is None else whole.wholes[i]
            masters.append(master)
            if p not in old_state:
                continue
            if whole is None:
                new_state[master] = {k: region_of(v, slot) for k, v in old_state[p].items()}
            elif whole.owns(i):
                new_state[master] = dict(old_state[p])
        group["params"] = masters
    optimizer.state.clear()
    optimizer.state.update(new_state)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the reduced gradients by their global norm over every rank's shard; returns that norm."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"zp.clip_grad_norm_: max_norm must be a positive number, got {max_norm!r}")
    engine = engine_of(model, "clip_grad_norm_")
    optimizer = engine.optimizer
    if optimizer is not None:
        optimizer.guard.unscale()  # fp16 loss scaling: clip the true gradients
    return clip_owned_grads(engine, max_norm, norm_type)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient reduction for the backward passes inside (gradient accumulation)."""
    with engine_of(model, "no_sync").no_sync():
        yield


@contextlib.contextmanager
def gathered_parameters(
    model_or_params: nn.Module | Iterable[nn.Parameter],
    modifier_rank: int | None = None,
    model: nn.Module | None = None,
) -> Iterator[None]:
    """Full parameters visible on every rank inside the block.

    With ``modifier_rank`` set, that rank's edits are broadcast and re-sharded on exit.
    """
    target = model if model is not None else model_or_params
    if not isinstance(target, nn.Module):
        raise ValueError("zp.gathered_parameters: pass the set-up model, or params with model=<the set-up model>")
    engine = engine_of(target, "gathered_parameters")
    params = list(model_or_params.parameters()) if isinstance(model_or_params, nn.Module) else list(model_or_params)
    with engine.gathered(params, modifier_rank):
        yield
