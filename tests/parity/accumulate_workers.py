"""Model, data, reference and rank functions of ``tests/parity/test_accumulate.py``.

Stage-3 gradient accumulation with and without ``ZeroConfig.accumulate_full_grads`` ([Note: deferred
reduction] in zero_plugin/stage3/accumulate.py), on ``uneven_workers.UnevenModel`` (float64, widths 15 and
7: every parameter padded on 2 and 3 ranks), with parameters used unevenly across micro-batches and ranks
(``block_modes``).  The single-process reference replays every rank's slice of every micro-batch with the
decisions that rank made: its gradient is ``(1/N) sum_r sum_i grad L_ri / A``, what data-parallel
accumulation gives; a parameter no rank used in any micro-batch of a step gets no gradient.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_plugin as zp
from tests.parity.uneven_workers import OUT, ROWS_PER_RANK, WIDTH, build_model, rank_slice
from tests.unit.memory_comm_workers import collectives_layout, deferred_reads
from zero_plugin.comm.collectives import Comm

STEPS, ACCUM, MAX_NORM = 3, 3, 0.3


def block_modes(rank: int, world: int, step: int, micro: int) -> tuple[str, str, str]:
    """Block 0 ignores its weights on the last rank in micro-batch 2; block 1's expert is used where
    rank + micro-batch is even; block 2's expert only in micro-batch 1, and in no micro-batch of step 1
    (no gradient on any rank: the optimizer must skip it)."""
    b0 = "skip" if rank == world - 1 and micro == 2 else "full"
    b1 = "full" if (rank + micro) % 2 == 0 else "dense"
    b2 = "full" if micro == 1 and step != 1 else "dense"
    return (b0, b1, b2)


def make_data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + world)
    rows = world * ROWS_PER_RANK
    return [
        (
            torch.randn(rows, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(rows, OUT, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS * ACCUM)
    ]


def _optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(world: int) -> dict:
    model = build_model()
    opt = _optimizer(model)
    data, norms = make_data(world), []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = data[step * ACCUM + micro]
            losses = [
                F.mse_loss(model(rank_slice(x, r), block_modes(r, world, step, micro)), rank_slice(y, r))
                for r in range(world)
            ]
            (sum(losses) / world / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


@contextlib.contextmanager
def count_reductions():
    """Every reduction ``Comm`` issues, by tag (stage 3 tags a unit's reduction with the unit's name)."""
    seen: Counter = Counter()
    originals = {name: getattr(Comm, name) for name in ("reduce_scatter", "reduce_in_place")}

    def wrap(fn):
        def counting(self, *args, **kwargs):
            seen[kwargs.get("tag", "")] += 1
            return fn(self, *args, **kwargs)

        return counting

    for name, fn in originals.items():
        setattr(Comm, name, wrap(fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(Comm, name, fn)


def train_worker(config: dict, buffered: bool | str) -> dict:
    """Train ``STEPS`` steps of ``ACCUM`` micro-batches (all but the last under ``zp.no_sync``), clip, step.
    Returns the full parameters, the clip norms and each step's reductions by unit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    with collectives_layout(buffered):
        model, opt = zp.setup(model, _optimizer(model), zp.ZeroConfig(stage=3, **config))
    data, norms, reductions = make_data(world), [], []
    for step in range(STEPS):
        with count_reductions() as seen, deferred_reads(buffered):
            for micro in range(ACCUM):
                x, y = data[step * ACCUM + micro]
                sync = contextlib.nullcontext() if micro == ACCUM - 1 else zp.no_sync(model)
                with sync:
                    out = model(rank_slice(x, rank), block_modes(rank, world, step, micro))
                    (F.mse_loss(out, rank_slice(y, rank)) / ACCUM).backward()
            norms.append(float(zp.clip_grad_norm_(model, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        reductions.append(dict(seen))
    full = zp.full_state_dict(model, rank0_only=False)
    return {"params": {n: full[n] for n, _ in model.named_parameters()}, "norms": norms, "reductions": reductions}


def _backward(model, world: int, rank: int, micro: int) -> None:
    x, y = make_data(world)[micro]
    out = model(rank_slice(x, rank), block_modes(rank, world, 0, micro))
    F.mse_loss(out, rank_slice(y, rank)).backward()


def behaviour_worker() -> dict:
    """Kept gradients in memory_report; clip and step before the synced backward raise; zero_grad
    discards them (the next step then sees only the gradients after it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    model, opt = zp.setup(model, _optimizer(model), zp.ZeroConfig(stage=3, accumulate_full_grads=True))
    before = zp.memory_report(model, opt)["measured"]["grads"]
    with zp.no_sync(model):
        _backward(model, world, rank, 0)
    kept = zp.memory_report(model, opt)["measured"]["grads"]
    errors = {}
    for verb, call in (("clip", lambda: zp.clip_grad_norm_(model, 1.0)), ("step", opt.step)):
        try:
            call()
        except RuntimeError as exc:
            errors[verb] = str(exc)
    opt.zero_grad()
    after_zero_grad = zp.memory_report(model, opt)["measured"]["grads"]
    zp.reset_comm_stats()
    _backward(model, world, rank, 1)  # synced: only this backward's gradients
    reduced_bytes = zp.comm_stats()["reduce_scatter"]["bytes"]
    grads = {sp.name: sp.sharded_grad.clone() for sp in _sharded(model) if sp.sharded_grad is not None}
    opt.step()
    return {
        "before": before,
        "kept": kept,
        "after_zero_grad": after_zero_grad,
        "errors": errors,
        "reduced_bytes": reduced_bytes,
        "grads": grads,
        "numel": sum(p.numel() for p in build_model().parameters()),
    }


def _sharded(model):
    from zero_plugin.engines.engine import engine_of

    return engine_of(model, "test").sharded.values()


def fresh_grads_worker() -> dict:
    """The shard gradients of one synced backward of micro-batch 1, without accumulation: what
    ``behaviour_worker`` must see after its zero_grad."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    model, opt = zp.setup(model, _optimizer(model), zp.ZeroConfig(stage=3))
    _backward(model, world, rank, 1)
    return {sp.name: sp.sharded_grad.clone() for sp in _sharded(model) if sp.sharded_grad is not None}


def mixed_worker(keep: bool) -> dict:
    """bf16 parameters reduced in fp32: ``ACCUM`` micro-batches of step 0; this rank's shard gradients and
    the gradient bytes held after the first ``no_sync`` backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model().float()
    config = zp.ZeroConfig(stage=3, param_dtype="bf16", reduce_dtype="fp32", accumulate_full_grads=keep)
    model, opt = zp.setup(model, _optimizer(model), config)
    held = None
    for micro in range(ACCUM):
        sync = contextlib.nullcontext() if micro == ACCUM - 1 else zp.no_sync(model)
        with sync:
            x, y = make_data(world)[micro]
            out = model(rank_slice(x, rank).float(), block_modes(rank, world, 0, micro))
            (F.mse_loss(out.float(), rank_slice(y, rank).float()) / ACCUM).backward()
        if micro == 0:
            held = zp.memory_report(model, opt)["measured"]["grads"]
    grads = {sp.name: sp.sharded_grad.clone() for sp in _sharded(model) if sp.sharded_grad is not None}
    return {"grads": grads, "held": held}
