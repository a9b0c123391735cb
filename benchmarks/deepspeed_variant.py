"""DeepSpeed ZeRO (stages 1-3, optionally with CPU optimizer offload) as benchmark variants.

DeepSpeed runs on CPU with ``DS_ACCELERATOR=cpu`` (set here before the import when unset)
and reuses the gloo process group the runner initialised (``dist_init_required=False``).
The training loop goes through the engine: ``engine(...)``, ``engine.backward(loss)``,
``engine.step()`` (which also zeroes the gradients, so ``zero_grad`` is a no-op here).

Configuration: fp32, gradient accumulation 1, micro-batch = the runner's batch,
``gradient_clipping: 0`` (DeepSpeed clips at 1.0 by default; the other variants do not
clip).  Every other ZeRO setting keeps DeepSpeed's default, in particular
``reduce_bucket_size`` / ``allgather_bucket_size`` of 5e8 elements (one bucket for the
benchmark models), ``overlap_comm`` off for stages 1-2 and on for stage 3, and stage 3's
``stage3_param_persistence_threshold`` (1e5 elements stay replicated) and
``stage3_max_reuse_distance`` / ``stage3_prefetch_bucket_size``, which keep parameters
gathered between forward and backward for models this small (so stage 3 moves ~2Ψ,
not 3Ψ).  The optimizer is torch ``AdamW(lr)`` (torch defaults otherwise); with offload
DeepSpeed requires its own ``DeepSpeedCPUAdam``, configured with the same
hyper-parameters through the config's ``optimizer`` section.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .measure import group_ranks
from .variants import SkipVariant, Variant

__all__ = ["DeepSpeedVariant", "DeepSpeedCommCounter", "engine_held_tensors"]

# torch.optim.AdamW's defaults, written out because the offload path configures
# DeepSpeedCPUAdam through the JSON-like config rather than passing a torch optimizer.
_ADAMW_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _import_deepspeed():
    """``deepspeed`` on the CPU accelerator, or :class:`SkipVariant` saying why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        raise SkipVariant(f"deepspeed is not importable ({exc}); install the `bench` extra") from exc
    if get_accelerator().device_name() != "cpu":
        raise SkipVariant(
            f"deepspeed chose the {get_accelerator().device_name()!r} accelerator; "
            "set DS_ACCELERATOR=cpu before it is first imported"
        )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls these two by their old names; torch warns on every rank's first call.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
        "is deprecated",
        category=FutureWarning,
    )
    return deepspeed


def _load_cpu_adam() -> None:
    """Build (first use: ninja + g++, 35-60 s, then cached) and load DeepSpeed's CPU Adam op."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as exc:  # noqa: BLE001 - any build failure means this variant cannot run
        raise SkipVariant(f"DeepSpeedCPUAdam op did not build: {type(exc).__name__}: {exc}"[:300]) from exc


def _ensure_launcher_env() -> None:
    """DeepSpeed reads the launcher's variables; the runner's ranks are one node's processes."""
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))


def ds_config(stage: int, offload: bool, lr: float, micro_batch: int, extra: dict | None = None) -> dict:
    zero: dict = {"stage": stage, **(extra or {})}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": zero,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, **_ADAMW_DEFAULTS}}
    return config


class DeepSpeedVariant(Variant):
    """``deepspeed.initialize`` at one ZeRO stage; measured through the engine it returns."""

    def __init__(
        self, raw: nn.Module, lr: float, batch: int, stage: int, offload: bool, zero: dict | None = None
    ) -> None:
        super().__init__(raw, lr, batch)
        deepspeed = _import_deepspeed()
        if offload:
            _load_cpu_adam()
        _ensure_launcher_env()
        self.theory_stage = stage
        self.stage = stage
        self.counter = DeepSpeedCommCounter()
        client_optimizer = None if offload else torch.optim.AdamW(raw.parameters(), lr=lr)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=raw,
            model_parameters=raw.parameters(),
            optimizer=client_optimizer,
            config=ds_config(stage, offload, lr, batch, zero),
            dist_init_required=False,
        )
        self.module = self.engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        """``engine.step()`` already zeroed the gradients (its cost is in the step phase)."""

    def comm(self) -> dict[str, int]:
        return self.counter.by_kind()

    def state_groups(self) -> dict[str, list]:
        """Distinct storages the engine holds (see :func:`engine_held_tensors`)."""
        params = list(self.raw.parameters())
        held = engine_held_tensors(self.engine.optimizer)
        partitions = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]  # stage 3
        return {
            "params": params + partitions,
            "grads": [p.grad for p in params] + held["grads"],
            "optimizer": held["other"],
        }

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        import deepspeed

        params = list(self.raw.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.stage == 3):
            return {n: p.detach().clone() for n, p in self.raw.named_parameters()}

    def teardown(self) -> None:
        self.engine.destroy()
        _forget_root_module(self.raw)
        self.engine = None
        super().teardown()


def _forget_root_module(module: nn.Module) -> None:
    """Let the model and the engine be freed after ``engine.destroy()``.

    DeepSpeed 0.19.8's stage 3 pushes the root module onto a module-level stack
    (``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``) when it installs its
    hooks, and ``destroy()`` leaves it there; through the module's hooks and parameters
    that keeps the whole engine alive, and the next variants' peak RSS would include it.
    """
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]


def engine_held_tensors(zero_optimizer) -> dict[str, list[torch.Tensor]]:
    """Every tensor reachable from DeepSpeed's ZeRO optimizer, split into gradients and the rest.

    Walks the attributes of DeepSpeed's own objects (and of the inner torch optimizer,
    for its state) through lists, tuples and dicts, plus each tensor's ``.grad``.  A
    tensor whose attribute path mentions ``grad`` is a gradient (partitioned gradients,
    the offload gradient copies and staging buffers); everything else (fp32 master
    partitions, Adam moments, offload parameter buffers, flat parameter buffers that
    alias the model's parameters) is "other".  Left out: meta tensors (no memory) and
    ``ipg_buckets``, the gradient-reduction bucket buffers, which are communication
    staging like DDP's and zero_plugin's buckets (not counted for them either) and are
    allocated at ``reduce_bucket_size`` (5e8 elements = 2 GB of mostly untouched pages).
    """
    found: dict[str, list[torch.Tensor]] = {"grads": [], "other": []}
    _walk(zero_optimizer, "", found, set(), depth=0)
    return found


_MAX_DEPTH = 6


def _walk(obj, path: str, found: dict, seen: set[int], depth: int) -> None:
    if depth > _MAX_DEPTH or "ipg_buckets" in path:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            found["grads" if "grad" in path else "other"].append(obj)
        if obj.grad is not None:
            _walk(obj.grad, path + ".grad", found, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    elif _is_engine_object(obj) and id(obj) not in seen:
        seen.add(id(obj))
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        _walk(value, f"{path}.{key}" if isinstance(key, str) else path, found, seen, depth + 1)


def _is_engine_object(obj) -> bool:
    if isinstance(obj, (nn.Module, type)) or not hasattr(obj, "__dict__"):
        return False
    return isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith("deepspeed.")


class DeepSpeedCommCounter:
    """Logical bytes per collective kind, counted at DeepSpeed's communication backend.

    Every DeepSpeed collective goes through ``deepspeed.comm``'s backend object (``cdb``),
    whose methods call torch.distributed; the wrappers sit on that one instance, only
    inside :meth:`counting`.  The torch-level :class:`TorchCommCounter` is not used for
    DeepSpeed: it would miss ``all_reduce`` and the all-gather function the backend
    captured at start-up, and count broadcasts twice.  Counting follows the report's
    conventions (all-reduce 2n, reduce-scatter and reduce n inputs, all-gather n outputs,
    broadcast n).
    """

    # method -> (kind, argument position, keyword, factor); the argument may be a tensor list
    _METHODS = {
        "all_reduce": ("all_reduce", 0, "tensor", 2),
        "inference_all_reduce": ("all_reduce", 0, "tensor", 2),
        "all_reduce_coalesced": ("all_reduce", 0, "tensors", 2),
        "reduce": ("reduce", 0, "tensor", 1),
        "reduce_scatter_tensor": ("reduce_scatter", 1, "input_tensor", 1),
        "reduce_scatter": ("reduce_scatter", 1, "input_list", 1),
        "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 1),
        "all_gather_base": ("all_gather", 0, "output_tensor", 1),
        "all_gather": ("all_gather", 0, "tensor_list", 1),
        "all_gather_coalesced": ("all_gather", 0, "output_tensors", 1),
        "broadcast": ("broadcast", 0, "tensor", 1),
        "all_to_all_single": ("all_to_all", 1, "input", 1),
    }

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.by_group: dict[tuple[int, ...] | None, int] = {}  # by the group's global ranks (None: world)

    def reset(self) -> None:
        self.bytes = {}
        self.by_group = {}

    def by_kind(self) -> dict[str, int]:
        return {"total": sum(self.bytes.values()), **self.bytes}

    @contextlib.contextmanager
    def counting(self) -> Iterator[DeepSpeedCommCounter]:
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        patched = [name for name in self._METHODS if hasattr(backend, name)]
        for name in patched:
            setattr(backend, name, self._wrap(getattr(backend, name), self._METHODS[name]))
        try:
            yield self
        finally:
            for name in patched:
                delattr(backend, name)  # the instance attribute; the class method shows again

    def _wrap(self, fn, spec: tuple[str, int, str, int]):
        kind, index, keyword, factor = spec
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            arg = args[index] if len(args) > index else kwargs[keyword]
            tensors = arg if isinstance(arg, (list, tuple)) else [arg]
            nbytes = factor * sum(t.numel() * t.element_size() for t in tensors)
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
            ranks = group_ranks(signature.bind_partial(*args, **kwargs).arguments.get("group"))
            self.by_group[ranks] = self.by_group.get(ranks, 0) + nbytes
            return fn(*args, **kwargs)

        return counted
