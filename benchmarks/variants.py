"""The contenders.  Each wraps a freshly built model and exposes the same measuring surface.

A variant is built once per round from an identical model; the runner calls
``loss(ids)``, ``backward(loss)``, ``step()`` and ``zero_grad()`` in the training loop
and the methods below to measure.  Every method that communicates is called on all ranks in the same order.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .measure import TorchCommCounter, local_tensor

__all__ = ["VARIANTS", "Variant", "SkipVariant", "make_variant"]


class SkipVariant(Exception):
    """This variant cannot run here (e.g. a stage zero_plugin has not implemented yet)."""


def _adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


class Variant:
    """Base: the raw model (for parameter names) and a counter for Python-level collectives."""

    theory_stage = 0  # which ZeRO memory formula applies

    def __init__(self, raw: nn.Module, lr: float, batch: int) -> None:
        self.raw = raw
        self.lr = lr
        self.batch = batch  # sequences per rank per step
        self.counter = TorchCommCounter()
        self.module: nn.Module = raw
        self.optimizer: torch.optim.Optimizer | None = None

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with self.counter.counting():
            yield

    def reset_comm(self) -> None:
        self.counter.reset()

    def comm(self) -> dict[str, int]:
        return {"total": self.counter.bytes}

    def comm_by_group(self) -> dict[tuple[int, ...], int]:
        """Logical bytes since the last reset by the global ranks of the group they ran on (``multinode.py``)."""
        everyone = tuple(range(dist.get_world_size()))
        out: dict[tuple[int, ...], int] = {}
        for ranks, nbytes in self.counter.by_group.items():
            out[ranks or everyone] = out.get(ranks or everyone, 0) + nbytes
        return out

    def state_groups(self) -> dict[str, list]:
        params = list(self.raw.parameters())
        return {"params": params, "grads": [p.grad for p in params], "optimizer": self._optimizer_state()}

    def _optimizer_state(self) -> list[torch.Tensor]:
        opt = self.optimizer
        return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.raw.named_parameters()}

    def teardown(self) -> None:
        self.module = self.optimizer = None


class DDPVariant(Variant):
    """torch DDP as a careful user configures it, the reference for every ratio: gradients are views into
    its buckets (``gradient_as_bucket_view=True``: no copy per gradient) and buffers are not broadcast every
    forward (``broadcast_buffers=False``: the benchmark models' only buffers are the rotary tables, identical
    on every rank).  Its all-reduce is counted by the standard Python all-reduce comm hook."""

    ddp_options = {"gradient_as_bucket_view": True, "broadcast_buffers": False}

    def __init__(self, raw: nn.Module, lr: float, batch: int) -> None:
        super().__init__(raw, lr, batch)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        counter = self.counter

        def counted_allreduce(state, bucket):
            buf = bucket.buffer()
            counter.add(2 * buf.numel() * buf.element_size())  # all-reduce of n moves 2n
            return allreduce_hook(state, bucket)

        self.module = DDP(raw, **self.ddp_options)
        self.module.register_comm_hook(state=None, hook=counted_allreduce)
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return _adamw(self.module.parameters(), self.lr)


class DefaultDDPVariant(DDPVariant):
    """torch DDP with torch's defaults (what ``accelerate launch`` gives): a second row, not the reference."""

    ddp_options: dict = {}


class ZeroRedundancyVariant(DDPVariant):
    """torch ``ZeroRedundancyOptimizer`` (ZeRO-1) over DDP."""

    theory_stage = 1

    def _make_optimizer(self) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=torch.optim.AdamW, lr=self.lr)

    def _optimizer_state(self) -> list[torch.Tensor]:
        local = self.optimizer.optim
        return [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class FSDP2Variant(Variant):
    """torch FSDP2 ``fully_shard`` per decoder layer + root, on a CPU device mesh (ZeRO-3)."""

    theory_stage = 3
    _mesh = None

    def __init__(self, raw: nn.Module, lr: float, batch: int) -> None:
        super().__init__(raw, lr, batch)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if FSDP2Variant._mesh is None:
            FSDP2Variant._mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in raw.model.layers:
            fully_shard(layer, mesh=FSDP2Variant._mesh)
        self.module = fully_shard(raw, mesh=FSDP2Variant._mesh)
        self.optimizer = _adamw(raw.parameters(), lr)

    def state_groups(self) -> dict[str, list]:
        return {k: [local_tensor(t) for t in v if t is not None] for k, v in super().state_groups().items()}

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().clone() for n, p in self.raw.named_parameters()}


class FSDP2HSDPVariant(FSDP2Variant):
    """FSDP2 HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` CPU mesh, shard groups of
    ``shard_size`` consecutive ranks (one "node"); gradients are reduce-scattered in the shard group
    and all-reduced across the replicate group (counted too: ``TorchCommCounter(all_reduce=True)``)."""

    shard_size = 2
    _meshes: dict = {}

    def __init__(self, raw: nn.Module, lr: float, batch: int) -> None:
        Variant.__init__(self, raw, lr, batch)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.counter = TorchCommCounter(all_reduce=True)
        k, world = self.shard_size, dist.get_world_size()
        if world % k or world == k:
            raise SkipVariant(f"HSDP needs a world size that is a multiple of {k} above it; got {world}")
        if k not in self._meshes:
            self._meshes[k] = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("replicate", "shard"))
        for layer in raw.model.layers:
            fully_shard(layer, mesh=self._meshes[k])
        self.module = fully_shard(raw, mesh=self._meshes[k])
        self.optimizer = _adamw(raw.parameters(), lr)


class ZeroPluginVariant(Variant):
    """zero_plugin at one stage; collectives counted by ``zp.comm_stats()``."""

    def __init__(
        self,
        raw: nn.Module,
        lr: float,
        batch: int,
        stage: int,
        offload: bool,
        package: str = "zero_plugin",
        shard_group_size: int | None = None,
        **zeropp: Any,
    ) -> None:
        super().__init__(raw, lr, batch)
        zp = importlib.import_module(package)

        self.zp = zp
        self.theory_stage = stage
        self.shard_group_size = shard_group_size
        # shard_group_size only when asked for: a baseline package of benchmarks/ab.py may predate the field
        extra = {} if shard_group_size is None else {"shard_group_size": shard_group_size}
        extra.update(zeropp)  # ZeRO++ switches (benchmarks/multinode.py), likewise only when asked for
        self.secondary_shard_size = zeropp.get("secondary_shard_size")
        config = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload else "none", **extra)
        try:
            self.module, self.optimizer = zp.setup(raw, _adamw(raw.parameters(), lr), config)
        except (NotImplementedError, ImportError) as exc:  # stage 3 before its engine exists
            raise SkipVariant(f"{type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        yield

    def reset_comm(self) -> None:
        self.zp.reset_comm_stats()

    def comm(self) -> dict[str, int]:
        return {k: v["bytes"] for k, v in self.zp.comm_stats().items() if v["bytes"]}

    def comm_by_group(self) -> dict[tuple[int, ...], int]:
        from .links import zp_groups

        world = dist.get_world_size()
        return zp_groups(self.comm(), dist.get_rank(), world, self.shard_group_size, self.secondary_shard_size)

    def state_groups(self) -> dict[str, list]:
        held = self._engine().model_state_tensors()
        params = list(self.raw.parameters())
        return {
            "params": params + held["params"],
            "grads": [p.grad for p in params] + held["grads"],
            "optimizer": held["masters"] + self._optimizer_state(),
        }

    def reported_state_bytes(self) -> int:
        """zero_plugin's own count (``zp.memory_report``), to cross-check ours."""
        return int(self.zp.memory_report(self.raw, self.optimizer)["measured"]["total"])

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        with self.zp.gathered_parameters(self.raw):
            return {n: p.detach().clone() for n, p in self.raw.named_parameters()}

    def _engine(self):
        # through api, which imports engine_of in every revision: a baseline package (benchmarks/ab.py) may
        # have its modules in another layout
        return importlib.import_module(self.zp.__name__ + ".api").engine_of(self.raw, "benchmarks")

    def teardown(self) -> None:
        # The engine registry maps model -> engine and the engine holds the model, so
        # without remove() neither is ever freed (reported upstream).
        self._engine().remove()
        super().teardown()


def _zp(stage: int, offload: bool = False, shard_group_size: int | None = None, **zeropp: Any):
    return lambda raw, lr, batch: ZeroPluginVariant(
        raw, lr, batch, stage, offload, shard_group_size=shard_group_size, **zeropp
    )


BASELINE_ENV = "ZERO_PLUGIN_BASELINE_PACKAGE"


def _zp_baseline(stage: int):
    """zero_plugin as of another revision, imported under another package name (``benchmarks/ab.py``
    exports it), so that a change's effect is measured against the code before it in the same run."""

    def make(raw: nn.Module, lr: float, batch: int) -> Variant:
        package = os.environ.get(BASELINE_ENV)
        if not package:
            raise SkipVariant(f"{BASELINE_ENV} is not set: run through python -m benchmarks.ab")
        return ZeroPluginVariant(raw, lr, batch, stage, False, package=package)

    return make


def _ds(stage: int, offload: bool = False, **zero: object):
    def make(raw: nn.Module, lr: float, batch: int) -> Variant:
        from .deepspeed_variant import DeepSpeedVariant  # imports this module: load it lazily

        return DeepSpeedVariant(raw, lr, batch, stage, offload, zero=zero)

    return make


VARIANTS = {
    "ddp": DDPVariant,
    "ddp_default": DefaultDDPVariant,
    "zero_redundancy": ZeroRedundancyVariant,
    "fsdp2": FSDP2Variant,
    "fsdp2_hsdp": FSDP2HSDPVariant,
    "zp0": _zp(0),
    "zp1": _zp(1),
    "zp2": _zp(2),
    "zp2_offload": _zp(2, offload=True),
    "zp3": _zp(3),
    "zp3_offload": _zp(3, offload=True),
    "zp3_shard2": _zp(3, shard_group_size=2),  # hierarchical sharding: shard groups of 2 (benchmarks/multinode.py)
    "zp3_hpz": _zp(3, secondary_shard_size=2),  # ZeRO++ (benchmarks/multinode.py)
    "zp3_qwz_qgz": _zp(3, quantized_weights=True, quantized_gradients=True),
    "zp3_all": _zp(3, secondary_shard_size=2, quantized_weights=True, quantized_gradients=True),
    "zp0_base": _zp_baseline(0),
    "zp1_base": _zp_baseline(1),
    "zp2_base": _zp_baseline(2),
    "zp3_base": _zp_baseline(3),
    "ds1": _ds(1),
    "ds2": _ds(2),
    "ds3": _ds(3),
    "ds2_offload": _ds(2, offload=True),
    "ds3_offload": _ds(3, offload=True),
    # ZeRO++ (benchmarks/multinode.py): hpZ (secondary weight partition in groups of 2), qwZ, qgZ, all three
    "ds3_hpz": _ds(3, zero_hpz_partition_size=2),
    "ds3_qwz": _ds(3, zero_quantized_weights=True),
    "ds3_qgz": _ds(3, zero_quantized_gradients=True),
    "ds3_zeropp": _ds(3, zero_hpz_partition_size=2, zero_quantized_weights=True, zero_quantized_gradients=True),
}
# The DeepSpeed variants are skipped (with a note in the report) where deepspeed is not installed.
DEFAULT_VARIANTS = (
    "ddp",
    "ddp_default",
    "zero_redundancy",
    "fsdp2",
    "zp0",
    "zp1",
    "zp2",
    "zp3",
    "zp2_offload",
    "zp3_offload",
    "ds1",
    "ds2",
    "ds3",
    "ds2_offload",
    "ds3_offload",
)


def make_variant(name: str, raw: nn.Module, lr: float, batch: int) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return VARIANTS[name](raw, lr, batch)
