"""Functions that run inside the ranks of ``tests/parity/test_parity_hsdp.py`` (hierarchical sharding).

Module-level so the worker pool pickles them by reference; arguments and results are plain Python or
CPU tensors.  The model and optimizer builders are ``tests/parity/workers.py``'s, which the single-process
reference in the parent uses too.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from tests.parity import workers
from tests.unit import memory_comm_workers
from zero_plugin.engines.engine import engine_of


def _config(stage: int, k, offload: bool = False, **extra) -> zp.ZeroConfig:
    return zp.ZeroConfig(stage=stage, shard_group_size=k, offload_optimizer="cpu" if offload else "none", **extra)


def _setup(kind: str, stage: int, k, offload: bool = False, buffered: bool = False):
    model = workers.build_model(kind)
    with memory_comm_workers.collectives_layout(buffered):
        return zp.setup(model, workers.build_optimizer(model), _config(stage, k, offload))


def _step(model, opt, micro_batches: list, max_norm: float) -> tuple[float, float]:
    """One optimizer step: accumulation (all but the last micro-batch under no_sync), clip, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = 0.0
    for i, micro in enumerate(micro_batches):
        sync = contextlib.nullcontext() if i == len(micro_batches) - 1 else zp.no_sync(model)
        with sync:
            value = models.loss_fn(model, models.shard_batch(micro, rank, world))
            (value / len(micro_batches)).backward()
        loss += value.item() / len(micro_batches)
    norm = float(zp.clip_grad_norm_(model, max_norm))
    opt.step()
    opt.zero_grad()
    return loss, norm


def parity_worker(
    kind: str, stage: int, k, batches: list, steps: int, accum: int, max_norm: float, offload=False, buffered=False
) -> dict:
    """Train ``steps`` steps; losses, clip norms, the full state dict on every rank, the replica groups'
    agreement on the owned gradients of one more backward."""
    model, opt = _setup(kind, stage, k, offload, buffered)
    losses, norms = [], []
    for step in range(steps):
        loss, norm = _step(model, opt, batches[step * accum : (step + 1) * accum], max_norm)
        losses.append(loss)
        norms.append(norm)
    engine = engine_of(model, "test")
    return {
        "losses": losses,
        "clip_norms": norms,
        "full": zp.full_state_dict(model, rank0_only=False),
        "full_rank0": zp.full_state_dict(model),
        "optim_full": opt.consolidate_state_dict(),
        "shard_rank": engine.comm.rank,
        "shard_world": engine.comm.world_size,
        "dp_size": engine.comm.dp_size,
    }


def with_local_world_size(local: int, fn, *args):
    """LOCAL_WORLD_SIZE as torchrun sets it, for shard_group_size="node"."""
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    try:
        return fn(*args)
    finally:
        if previous is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous


def _expected_replica_bytes(engine) -> int:
    """[Note: sum across replicas]: per reduction record, one all-reduce (2x logical) of this rank's regions
    (in place; the padded row when buffered) plus one flag per member, in the reduction dtype."""
    total = 0
    for members in _reduction_records(engine):
        es = _reduce_itemsize(engine, members)
        if engine.comm.gathers_regions_in_place:
            numel = sum(m.layout.local_numel for m in members)
        else:
            numel = sum(m.layout.shard_numel for m in members)
        total += 2 * es * (numel + len(members))
    return total


def _reduction_records(engine) -> list[list]:
    if engine.config.stage == 3:
        from zero_plugin.stage3.unit import _by_dtype

        return [
            g
            for u in engine.units
            for g in _by_dtype(u.trainable, lambda sp, u=u: u.reduce_dtype or sp.unsharded.dtype).values()
        ]
    return [b.slots for b in engine.reducer.buckets]


def _reduce_itemsize(engine, members) -> int:
    dtype = engine.config.effective_reduce_dtype or members[0].param.dtype
    return dtype.itemsize


def _expected_shard_bytes_stage12(engine) -> int:
    """In place, one synced backward + clip + step: reduce-scatter of Ψ, the flags (float32, all-reduced),
    the clip norm's all-reduce (one float64), all-gather of Ψ."""
    psi = sum(s.layout.numel for s in engine.slots)
    es = next(iter(engine.slots)).param.dtype.itemsize
    flags = sum(len(b.slots) for b in engine.reducer.buckets)
    return psi * es + 2 * 4 * flags + 16 + psi * es


def comm_worker(kind: str, stage: int, k, batch, max_norm: float, buffered: bool = False) -> dict:
    """comm_stats of one step with one synced micro-batch (setup and a warm-up step not counted)."""
    model, opt = _setup(kind, stage, k, buffered=buffered)
    _step(model, opt, [batch], max_norm)  # the first forward of stage 3 records its order
    zp.reset_comm_stats()
    _step(model, opt, [batch], max_norm)
    stats = zp.comm_stats()
    engine = engine_of(model, "test")
    out = {"stats": stats, "expected_replica": _expected_replica_bytes(engine) if engine.comm.replica else None}
    if stage < 3 and engine.comm.gathers_regions_in_place:
        out["expected_shard"] = _expected_shard_bytes_stage12(engine)
    out["local_psi"] = sum(s.layout.local_numel for s in engine.slots)
    return out


def memory_worker(stage: int, k, offload: bool = False) -> dict:
    """memory_report after step, zero_grad, backward (the fp32 ~295k model of tests/unit)."""
    model = memory_comm_workers.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zp.setup(model, opt, _config(stage, k, offload))
    memory_comm_workers._backward(model, seed=0)
    opt.step()
    opt.zero_grad()
    memory_comm_workers._backward(model, seed=1)
    return zp.memory_report(model, opt)


def checkpoint_worker(kind: str, stage: int, k, batches: list, max_norm: float, path: str, phase: str) -> dict:
    """``phase`` "save": one step, save, return the full state; "load": load into a fresh setup, return the
    full state and the state after one more step (which the parent compares across settings)."""
    model, opt = _setup(kind, stage, k)
    if phase == "save":
        _step(model, opt, batches[:1], max_norm)
        if dist.get_rank() == 0 and os.path.exists(path):
            shutil.rmtree(path)
        zp.save_checkpoint(path, model, opt, extra={"step": 1})
        dist.barrier()
        files = sorted(os.listdir(path)) if dist.get_rank() == 0 else None
        return {"full": zp.full_state_dict(model, rank0_only=False), "files": files}
    extra = zp.load_checkpoint(path, model, opt)
    loaded = zp.full_state_dict(model, rank0_only=False)
    _step(model, opt, batches[1:2], max_norm)
    return {"extra": extra, "full": loaded, "after": zp.full_state_dict(model, rank0_only=False)}


def node_disagreement_worker() -> str:
    """LOCAL_WORLD_SIZE 2 on ranks 0-1 and 4 on ranks 2-3: setup must raise on every rank, before any split."""
    local = 2 if dist.get_rank() < 2 else 4
    try:
        with_local_world_size(local, _setup, "mlp", 2, "node")
    except ValueError as exc:
        return str(exc)
    return "no error"


def evaluation_worker(batch) -> dict:
    """Stage 3 for evaluation only (``zp.setup(model, None, config)``) with shard groups of 2: the output
    and the parameter bytes held (the shard of a group of 2, not of 4)."""
    x = models.shard_batch(batch, dist.get_rank(), dist.get_world_size())[0]
    want = workers.build_model("mlp")(x)
    model, _ = zp.setup(workers.build_model("mlp"), None, _config(3, 2))
    got = model(x)
    held = sum(sp.local.numel() for sp in engine_of(model, "test").sharded.values())
    return {"diff": (got - want).abs().max().item(), "held": held, "shard_world": engine_of(model, "t").comm.world_size}
