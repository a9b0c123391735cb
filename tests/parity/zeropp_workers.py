"""Functions that run inside the ranks of ``tests/parity/test_zeropp.py`` (ZeRO++ qwZ / qgZ / hpZ).

Module-level so the worker pool pickles them by reference; arguments and results are plain Python or CPU
tensors.  Model and optimizer builders are ``tests/parity/workers.py``'s.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from tests.parity import hsdp_workers, workers
from tests.unit import memory_comm_workers
from zero_plugin.comm import quantize, quantized
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.unit import _by_dtype


def _setup(kind: str, buffered: bool = False, **config):
    model = workers.build_model(kind)
    with memory_comm_workers.collectives_layout(buffered):
        return zp.setup(model, workers.build_optimizer(model), zp.ZeroConfig(stage=3, **config))


def train_worker(kind: str, batches: list, steps: int, buffered: bool = False, **config) -> dict:
    """``steps`` steps; losses and every rank's full parameters after each step.  ``local_world_size`` in
    ``config``: LOCAL_WORLD_SIZE as torchrun sets it, for ``secondary_shard_size="node"``."""
    local = config.pop("local_world_size", None)
    if local is not None:
        run = functools.partial(train_worker, **config)
        return hsdp_workers.with_local_world_size(local, run, kind, batches, steps, buffered)
    model, opt = _setup(kind, buffered, **config)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, params = [], [zp.full_state_dict(model, rank0_only=False)]
    for step in range(steps):
        loss = models.loss_fn(model, models.shard_batch(batches[step], rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append(zp.full_state_dict(model, rank0_only=False))
    return {"losses": losses, "params": params}


def _local_full_grads(kind: str, batch) -> dict[str, torch.Tensor]:
    """This rank's own gradients (one unsharded copy of the model on its slice of the batch), every rank's."""
    model = workers.build_model(kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([dict(model.named_parameters())[n].grad.reshape(-1) for n in names])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    out, offset = {}, 0
    for n in names:
        numel = dict(model.named_parameters())[n].numel()
        out[n] = torch.stack([e[offset : offset + numel] for e in every])  # (world, numel)
        offset += numel
    return out


def qgz_bound_worker(kind: str, batch, block: int, broken_scale: bool = False) -> dict:
    """One synced backward with qgZ: per parameter, this rank's reduced shard against the exact average, and
    the bound of [Note: qgZ reduction] (sum over source ranks of their block scale / 2, over N).
    ``broken_scale``: the engine quantizes with half the scale (clipping), which must break the bound."""
    model, opt = _setup(kind, quantized_gradients=True, quantization_block=block)
    engine = engine_of(model, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    if broken_scale:
        original = quantize.quantize_into
        quantized.quantize.quantize_into = lambda p, f, b, scales=None: original(
            p, f, b, quantize.block_scales(f, b) / 2
        )
    try:
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
    finally:
        if broken_scale:
            quantized.quantize.quantize_into = original
    every = _local_full_grads(kind, batch)
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for unit in engine.units:
        for group in _by_dtype(unit.trainable, lambda sp: sp.unsharded.dtype).values():
            rows = []  # every source rank's row for this destination (this rank), as the engine laid it out
            for src in range(world):
                chunks = []
                for sp in group:
                    g = every[name_of[id(sp.param)]][src]
                    padded = torch.zeros(sp.layout.padded_numel, dtype=g.dtype)
                    padded[: g.numel()] = g
                    chunks.append(padded.view(world, -1)[rank])
                rows.append(torch.cat(chunks))
            scales = torch.stack(
                [quantize.block_scales(r, block).double().repeat_interleave(block)[: r.numel()] for r in rows]
            )
            bound_row = scales.sum(0) / 2 / world
            offset = 0
            for sp in group:
                n = name_of[id(sp.param)]
                lo, hi = sp.layout.bounds()
                exact = every[n].mean(0)[lo:hi]
                got = sp.sharded_grad.reshape(-1)
                out[n] = {
                    "err": (got - exact).abs(),
                    "bound": bound_row[offset : offset + hi - lo],
                }
                offset += sp.layout.shard_numel
    return out


def qwz_gather_worker(kind: str, block: int, buffered: bool = False) -> dict:
    """Every unit gathered with qwZ: per parameter, |gathered - exact| and the bound scale / 2 of the block
    of its rank's row ([Note: qwZ gather]); the exact full values come from full_state_dict (not quantized)."""
    model, opt = _setup(kind, buffered, quantized_weights=True, quantization_block=block)
    engine = engine_of(model, "test")
    world = dist.get_world_size()
    exact = zp.full_state_dict(model, rank0_only=False)
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for unit in engine.units:
        unit.unshard()
        for group in _by_dtype(unit.params, lambda sp: sp.unsharded.dtype).values():
            for src in range(world):
                chunks = []
                for sp in group:
                    padded = torch.zeros(sp.layout.padded_numel, dtype=torch.float64)
                    padded[: sp.layout.numel] = exact[name_of[id(sp.param)]].reshape(-1)
                    chunks.append(padded.view(world, -1)[src])
                row = torch.cat(chunks)
                bound_row = quantize.block_scales(row, block).double().repeat_interleave(block)[: row.numel()] / 2
                offset = 0
                for sp in group:
                    n = name_of[id(sp.param)]
                    lo, hi = sp.layout.bounds(src)
                    got = sp.param.data.reshape(-1)[lo:hi].double()
                    want = exact[n].reshape(-1)[lo:hi].double()
                    entry = out.setdefault(n, {"err": [], "bound": []})
                    entry["err"].append((got - want).abs())
                    entry["bound"].append(bound_row[offset : offset + hi - lo])
                    offset += sp.layout.shard_numel
        unit.reshard()
    with zp.gathered_parameters(model):  # exact: the shards themselves
        gathered_exact = all(torch.equal(p.detach(), exact[n].to(p.dtype)) for n, p in model.named_parameters())
    return {n: {k: torch.cat(v) for k, v in e.items()} for n, e in out.items()} | {"gathered_exact": gathered_exact}


def comm_worker(kind: str, batch, buffered: bool = False, **config) -> dict:
    """One step's comm_stats, and the bytes the formula gives from the records the engine launched."""
    model, opt = _setup(kind, buffered, **config)
    launched = []
    originals = (quantized.gather_quantized, quantized.reduce_quantized)

    def gather(*a, **kw):
        launched.append(originals[0](*a, **kw))
        return launched[-1]

    def reduce(*a, **kw):
        launched.append(originals[1](*a, **kw))
        return launched[-1]

    quantized.gather_quantized, quantized.reduce_quantized = gather, reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        zp.reset_comm_stats()
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        stats = zp.comm_stats()
    finally:
        quantized.gather_quantized, quantized.reduce_quantized = originals
    gathers = sum(world * r.row_bytes for r in launched if isinstance(r, quantized.QuantizedGather))
    reduces = [r for r in launched if isinstance(r, quantized.QuantizedReduce)]
    return {
        "stats": stats,
        "gather_bytes": gathers,
        "all_to_all_bytes": sum(r.sent.numel() for r in reduces),
        "flag_bytes": sum(2 * 4 * len(r.members) for r in reduces),
        "n_gathers": sum(isinstance(r, quantized.QuantizedGather) for r in launched),
        "n_reduces": len(reduces),
    }


def secondary_memory_worker(kind: str, batch) -> dict:
    """hpZ's ``memory_report()["secondary"]`` before a step, between its forward and backward, after it."""
    model, opt = _setup(kind, secondary_shard_size=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = zp.memory_report(model, opt)["secondary"]
    loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
    during = zp.memory_report(model, opt)["secondary"]
    loss.backward()
    after = zp.memory_report(model, opt)["secondary"]
    psi = sum(sp.layout.numel for u in engine_of(model, "test").units for sp in u.params)  # params are shards now
    return {"before": before, "during": during, "after": after, "psi": psi}
