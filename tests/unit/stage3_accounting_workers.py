"""Functions that run inside the ranks of ``tests/unit/test_stage3_behaviour.py``: what stage 3 holds
and moves -- the prefetch bound, memory and communication accounting.

Module-level so the worker pool pickles them by reference; the models and shared helpers are in
``stage3_behaviour_workers.py``.  Instrumentation is attached to this call's engine objects only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zero_plugin as zp
from tests import models
from tests.unit.stage3_behaviour_workers import (
    MLP_ROWS,
    DeepMLP,
    _full_params,
    _rank_world,
    _seeded,
    _setup,
    _unsharded,
    reference,
    train_steps,
)
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.param import ShardedState
from zero_plugin.stage3.unit import GatherMode

# ---------------------------------------------------------------------------------------------------------------
# prefetch bound


def _instrument_peak(engine, record: dict, phase: dict) -> None:
    """Wrap each non-root unit's unshard/wait_unshard (instance attributes) to record, per phase, the most
    non-root units that hold gathered memory at once: unsharded, or with an all-gather in flight."""
    blocks = engine.units[1:]

    def count() -> int:
        return sum(u.state is ShardedState.UNSHARDED or u.gathering for u in blocks)

    def wrap(unit, name):
        original = getattr(unit, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            key = phase["now"]
            record[key] = max(record.get(key, 0), count())
            if name == "unshard" and GatherMode.PREFETCH in (*args, *kwargs.values()):
                record["async_gathers"] = record.get("async_gathers", 0) + 1
            return result

        setattr(unit, name, wrapped)

    for unit in blocks:
        wrap(unit, "unshard")
        wrap(unit, "wait_unshard")


def prefetch_worker(prefetch_depth: int, depth: int = 6) -> dict:
    batches = models.make_batches("mlp", 3, 1, MLP_ROWS, seed=8)
    rank, world = _rank_world()
    model, opt = _setup(
        _seeded(DeepMLP, depth), zp.ZeroConfig(stage=3, prefetch_depth=prefetch_depth, reshard_after_forward=True)
    )
    engine = engine_of(model, "test")
    record, phase = {}, {"now": "other"}
    _instrument_peak(engine, record, phase)
    losses = []
    for batch in batches:
        x, target = models.shard_batch(batch, rank, world)
        phase["now"] = "forward"
        loss = F.mse_loss(model(x), target)
        phase["now"] = "backward"
        loss.backward()
        phase["now"] = "other"
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    ref, _, _ = reference(lambda: _seeded(DeepMLP, depth), batches)
    return {
        "peak": record,
        "n_blocks": len(engine.units) - 1,
        "max_abs_diff": models.max_abs_diff(_full_params(model), ref["params"]),
    }


# ---------------------------------------------------------------------------------------------------------------
# memory


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def memory_worker(kind: str) -> dict:
    """After a warm step, between backward and step: memory_report vs theory vs our own storage count.

    ``kind``: "llama" (tiny Llama, fp32; its sizes divide by 2 and 4, so no padding) or "mlp32"
    (``DeepMLP`` in fp32, whose odd sizes such as 7 x 15 leave a padded tail).
    """
    rank, world = _rank_world()
    if kind == "llama":
        batches = models.make_batches("llama", 2, world, per_rank_batch=2, seed=9)
        model = models.make_tiny_llama(layers=2)
    else:
        batches = models.make_batches("mlp", 2, world, per_rank_batch=2, seed=9, dtype=torch.float32)
        model = _seeded(DeepMLP, 6, dtype=torch.float32)
    model, opt = _setup(model)
    engine = engine_of(model, "test")
    train_steps(model, opt, batches[:1])  # Adam state exists now
    models.loss_fn(model, models.shard_batch(batches[1], rank, world)).backward()
    report = zp.memory_report(model, opt)

    sps = list(engine.sharded.values())
    seen: set = set()
    own = {
        "params": _storage_bytes([p.data for p in model.parameters()] + [sp.unsharded for sp in sps], seen),
        "grads": _storage_bytes([sp.sharded_grad for sp in sps] + [p.grad for p in model.parameters()], seen),
        "optimizer": _storage_bytes(
            [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)], seen
        ),
    }
    own["total"] = sum(own.values())
    trainable = [sp for sp in sps if sp.param.requires_grad]
    step_bytes = sum(
        s["step"].untyped_storage().nbytes() for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)
    )
    exact = {
        "params": 4 * sum(sp.layout.local_numel for sp in sps),
        "grads": 4 * sum(sp.layout.local_numel for sp in trainable),
        "optimizer": 8 * sum(sp.layout.local_numel for sp in trainable) + step_bytes,
    }
    exact["total"] = sum(exact.values())
    psi = sum(sp.layout.numel for sp in sps)
    return {
        "measured": report["measured"],
        "theory": report["theory"],
        "own": own,
        "exact": exact,
        "psi": psi,
        "padded": sum(sp.layout.padded_numel for sp in sps),
        "sixteen_psi_over_n": 16 * psi / world,
        "n_params": len(sps),
        "step_bytes": step_bytes,
        "unsharded_bytes": sum(sp.unsharded.untyped_storage().nbytes() for sp in sps),
        "param_grads": sum(p.grad is not None for p in model.parameters()),
        "unsharded_units": _unsharded(model),
    }


# ---------------------------------------------------------------------------------------------------------------
# communication volume


def _unit_bytes(unit, trainable_only: bool, padded: bool = True) -> int:
    sps = unit.trainable if trainable_only else unit.params
    return sum((sp.layout.padded_numel if padded else sp.layout.numel) * sp.unsharded.element_size() for sp in sps)


def comm_worker(kind: str, steps: int = 2, buffered: bool = False) -> dict:
    """Logical bytes per step (forward + backward + step) against the unit structure.

    ``buffered``: the rank-major layout NCCL uses (forced on gloo); otherwise gloo's in-place layout,
    where a gather is in-place broadcasts of exact regions and a reduction sums the gradients in place,
    its has-gradient flags in a float32 all-reduce of their own.  Every gather is preceded by an order
    check on the control channel, and every forward ends with one ([Note: collective order])."""
    from tests.unit.memory_comm_workers import collectives_layout

    with collectives_layout(buffered):
        return _comm_worker(kind, steps, buffered)


def _comm_worker(kind: str, steps: int, buffered: bool) -> dict:
    _, world = _rank_world()
    if kind == "llama":
        batches = models.make_batches("llama", steps + 1, world, per_rank_batch=2, seed=10)
        model = models.make_tiny_llama(layers=2)
    else:
        batches = models.make_batches("mlp", steps + 1, world, per_rank_batch=2, seed=10)
        model = _seeded(DeepMLP, 6)
    model, opt = _setup(model)
    engine = engine_of(model, "test")
    train_steps(model, opt, batches[:1])  # warm-up: records the forward order, creates Adam state
    zp.reset_comm_stats()
    train_steps(model, opt, batches[1:])
    stats = zp.comm_stats()
    root = engine.units[0]
    gathered = [u for u in engine.units if any(sp.layout.numel for sp in u.params)]  # one collective each
    reduced = [u for u in engine.units if any(sp.layout.numel for sp in u.trainable)]
    elem = next(iter(engine.sharded.values())).unsharded.element_size()
    # root and the last unit of the forward order: once per step (kept from forward into backward,
    # [Note: last unit kept] in hooks.py); every other block: forward + backward
    kept = {id(root), id(engine.runtime.forward_order[-1])}
    times = {id(u): 1 if id(u) in kept else 2 for u in engine.units}
    gathers = sum(times[id(u)] for u in gathered)
    entries = 1 + len(engine.runtime.forward_order)
    payload = {
        "all_gather": {
            "calls": gathers,
            "bytes": sum(times[id(u)] * _unit_bytes(u, False, buffered) for u in engine.units),
        },
        "reduce_scatter": {"calls": len(reduced), "bytes": sum(_unit_bytes(u, True, buffered) for u in engine.units)},
        # the step's one "some rank has inf/NaN" flag (optim/loss_scale.py, 4 bytes counted twice); in place
        # also one float32 has-gradient flag per trainable parameter of every reduced unit
        "all_reduce": {
            "calls": 1 + (0 if buffered else len(reduced)),
            "bytes": 8 + (0 if buffered else sum(2 * 4 * len(u.trainable) for u in reduced)),
        },
        # the control channel ([Note: collective order], [Note: rank-agreed reduction order]): at each unit
        # the forward enters (the root included), after the forward and at the end of backward, (3 + one per
        # unit) float64 per rank; backward gathers follow the agreed list unchecked
        "control": {"calls": entries + 2, "bytes": (entries + 2) * world * (3 + len(engine.units)) * 8},
    }
    # Collectives may carry a few metadata elements per rank besides the payload (a unit tag, one
    # has-gradient flag per parameter); at most (parameters in the unit + 4) elements per rank.
    metadata_bound = {
        "all_gather": sum(times[id(u)] * world * (len(u.params) + 4) * max(elem, 4) for u in gathered),
        "reduce_scatter": sum(world * (len(u.trainable) + 4) * elem for u in reduced),
    }
    per_step = {k: {"calls": v["calls"] / steps, "bytes": v["bytes"] / steps} for k, v in stats.items()}
    return {
        "per_step": per_step,
        "payload": payload,
        "metadata_bound": metadata_bound,
        "elem": elem,
        "psi": sum(sp.layout.numel for sp in engine.sharded.values()),
        "padded": sum(sp.layout.padded_numel for sp in engine.sharded.values()),
        "padding_bound": (world - 1) * len(engine.sharded) * elem,  # bytes, per pass over every parameter
        "root_padded_bytes": sum(_unit_bytes(u, False, buffered) for u in engine.units if id(u) in kept),
    }
