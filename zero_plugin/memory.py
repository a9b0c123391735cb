"""Memory per rank: what this rank holds (measured) and what the ZeRO paper says it should.

Theory (arXiv 1910.02054, section 5, Figure 1), with Ψ trainable parameters,
N ranks, K bytes of optimizer state per parameter (Adam: two fp32 moments):
  stage 0: params + grads + K          (fp32 Adam: 16Ψ)
  stage 1: params + grads + K/N        (8Ψ + 8Ψ/N)
  stage 2: params + (grads + K)/N      (4Ψ + 12Ψ/N)
  stage 3: (params + grads + K)/N      (16Ψ/N)
With ``param_dtype`` lower than ``master_dtype`` the fp32 master copy is part of K
(mixed-precision Adam: 2Ψ + 2Ψ + 12Ψ).  Frozen parameters count as params only.
With hierarchical sharding (``ZeroConfig.shard_group_size=k``) N is the shard group's k: states are
sharded over k ranks and replicated across the groups, so stage 3 holds 16Ψ/k; the report's
``world_size`` is then k and ``replicas`` the number of groups.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["memory_report", "theory_bytes", "state_elements_per_param"]


def _unwrap(optimizer):
    """The optimizer that holds the state: through Accelerate/Lightning wrappers and our ZeroOptimizer."""
    for _ in range(4):
        inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def state_elements_per_param(optimizer: torch.optim.Optimizer) -> int | None:
    """Optimizer-state tensors per parameter element for known optimizers (None when unknown; 0 without one)."""
    if optimizer is None:  # an evaluation-only model
        return 0
    opt = _unwrap(optimizer)
    group = opt.param_groups[0] if opt.param_groups else {}
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(opt, (torch.optim.Adagrad,)):
        return 1
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return None


def theory_bytes(
    *,
    stage: int,
    world_size: int,
    trainable: int,
    frozen: int,
    param_bytes: int,
    master_bytes: int,
    state_per_param: int,
    mixed: bool,
    shard_is_master: bool = False,
) -> dict[str, float]:
    """Bytes per rank by category.  ``shard_is_master``: stage 3 keeps one fp32 shard that is both the
    parameter and its master (and reduces into an fp32 gradient shard): same total, other split."""
    n = world_size
    if shard_is_master:
        params = (trainable * master_bytes + frozen * param_bytes) / n
        grads = trainable * master_bytes / n
        optimizer = trainable * state_per_param * master_bytes / n
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
    k = state_per_param * master_bytes + (master_bytes if mixed else 0)
    params = (trainable + frozen) * param_bytes / (n if stage == 3 else 1)
    grads = trainable * param_bytes / (n if stage >= 2 else 1)
    optimizer = trainable * k / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


class _StorageCounter:
    """Sums each distinct storage once, attributed to the first category that names it."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = {}
        self.device_bytes: dict[tuple[str, str], int] = {}  # (device type, category) -> bytes
        self.host_bytes: dict[str, int] = {}  # category -> bytes placed on the host whatever their device

    def add(self, category: str, tensors: Iterable[torch.Tensor], on_host: bool = False) -> None:
        total = self.bytes.setdefault(category, 0)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
            if on_host:
                self.host_bytes[category] = self.host_bytes.get(category, 0) + storage.nbytes()
                continue
            slot = (t.device.type, category)
            self.device_bytes[slot] = self.device_bytes.get(slot, 0) + storage.nbytes()
        self.bytes[category] = total


def _optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    opt = _unwrap(optimizer)
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def memory_report(model, optimizer=None) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state (incl. fp32 masters), and the theory.

    ``optimizer=None``: a model set up for evaluation only (``zp.setup(model, None, config)``)."""
    from .engines.engine import engine_of

    engine = engine_of(model, "memory_report")
    held = engine.model_state_tensors()
    counter = _StorageCounter()
    counter.add("params", held["params"])
    counter.add("grads", held["grads"])
    counter.add("optimizer", list(held["masters"]) + _optimizer_state_tensors(optimizer))
    parked = engine.offloaded_states  # zp.offload_states: the host copies, placed on the host
    for category, copies in (parked.host_tensors() if parked is not None else {}).items():
        counter.add(category, copies, on_host=True)
    measured = dict(counter.bytes)
    measured["total"] = sum(measured.values())
    theory = _theory_for(engine, optimizer)
    return {
        "stage": engine.config.stage,
        "world_size": engine.comm.world_size,  # the shard group's with hierarchical sharding, as the theory's N
        "rank": engine.comm.rank,
        **({"replicas": engine.comm.dp_size // engine.comm.world_size} if engine.comm.replica is not None else {}),
        "measured": measured,
        "theory": theory,
        "placement": _placement(engine, counter, theory),
        **_counts(engine),
        **_secondary(engine),
        **({"offloaded_states": parked.summary()} if parked is not None else {}),
    }


def _secondary(engine) -> dict:
    """hpZ ([Note: secondary shards] in stage3/secondary.py): the secondary shards, held between a forward and
    its backward only, so not in ``measured`` (model states): ``held`` now, ``between`` from a forward to its
    backward (Ψ/k elements in the compute dtype, every unit released after its forward)."""
    shards = [u.secondary for u in engine.units if u.secondary is not None]
    if not shards:
        return {}
    between = sum(m.layout.local_numel * m.sp.unsharded.element_size() for s in shards for m in s.members)
    return {"secondary": {"held": sum(s.nbytes() for s in shards), "between": between, "k": shards[0].comm.world_size}}


def _offloaded(engine) -> set[str]:
    cfg = engine.config
    return ({"optimizer"} if cfg.offload.optimizer == "cpu" else set()) | ({"params"} if cfg.offload.params else set())


def _placement(engine, counter: _StorageCounter, theory: dict | None) -> dict:
    """Bytes on the compute device vs in host memory.

    On a CUDA run each storage is placed by its device.  On a CPU-only run host and device are the
    same memory; categories that offload moves to the host are reported as host.
    """
    host_cats = _offloaded(engine)
    device_is_cpu = all(key[0] == "cpu" for key in counter.device_bytes)
    out: dict[str, dict[str, float]] = {"device": {}, "host": {}}
    for (dev, category), nbytes in counter.device_bytes.items():
        where = (
            ("host" if category in host_cats else "device") if device_is_cpu else ("host" if dev == "cpu" else "device")
        )
        out[where][category] = out[where].get(category, 0) + nbytes
    for category, nbytes in counter.host_bytes.items():
        out["host"][category] = out["host"].get(category, 0) + nbytes
    for where in out:
        out[where]["total"] = sum(out[where].values())
    if theory is not None:
        out["theory"] = {
            "host": sum(v for k, v in theory.items() if k in host_cats),
            "device": sum(v for k, v in theory.items() if k not in host_cats and k != "total"),
        }
    return out


def _counts(engine) -> dict[str, int]:
    trainable = sum(s.layout.numel for s in engine.slots)
    total = sum(engine.full_numel(p) for p in engine.model.parameters())
    return {"trainable_params": trainable, "frozen_params": total - trainable}


def _theory_for(engine, optimizer) -> dict[str, float] | None:
    per = state_elements_per_param(optimizer)
    if per is None:
        return None
    counts = _counts(engine)
    cfg = engine.config
    p_dtype = cfg.precision.param_dtype or next(engine.model.parameters()).dtype
    mixed = cfg.precision.param_dtype is not None and cfg.precision.param_dtype != cfg.precision.master_dtype
    master_dtype = cfg.precision.master_dtype if mixed else p_dtype
    shard_is_master = cfg.stage == 3 and mixed and all(s.is_identity for s in engine.slots)
    return theory_bytes(
        stage=cfg.stage,
        world_size=engine.comm.world_size,
        trainable=counts["trainable_params"],
        frozen=counts["frozen_params"],
        param_bytes=p_dtype.itemsize,
        master_bytes=master_dtype.itemsize,
        state_per_param=per,
        mixed=mixed,
        shard_is_master=shard_is_master,
    )
