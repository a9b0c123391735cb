"""Functions that run inside the ranks of ``tests/unit/test_state_dict.py``: ``state_dict()`` and
``load_state_dict()`` of a set-up model ([Note: stage-3 state dicts] in zero_plugin/stage3/state_dict_hooks.py).

Module-level so the worker pool pickles them by reference; they return CPU tensors, strings and numbers and
the test file asserts.  The single-process references are built in the test file from the same seeded
models and batches.
"""

from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist
from torch import nn

import zero_plugin as zp
from tests import models

LR = 1e-2


def build(kind: str, stage: int = 3, **config) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded model set up at ``stage``: "mlp" (float64, odd shapes, 3 units + head), "llama" (tied,
    3 layers), "llama_untied" or "lora" (PEFT on the tied llama)."""
    model = make(kind)
    opt = models.two_group_adamw(model, lr=LR)
    return zp.setup(model, opt, zp.ZeroConfig(stage=stage, **config))


def make(kind: str) -> nn.Module:
    if kind == "mlp":
        return models.make_odd_mlp()
    if kind == "lora":
        return models.make_tiny_llama_lora(layers=3)
    return models.make_tiny_llama(layers=3, tie=kind == "llama")


def batches(kind: str, steps: int, world: int) -> list:
    return models.make_batches("mlp" if kind == "mlp" else "llama", steps, world, 2)


def train(model, opt, global_batches: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in global_batches:
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def entry_points_worker(kind: str, steps: int) -> dict:
    """Train, then every way torch offers to take a state dict; compare each with ``zp.full_state_dict``."""
    model, opt = build(kind)
    data = batches(kind, steps + 1, dist.get_world_size())
    train(model, opt, data[:steps])
    full = zp.full_state_dict(model, rank0_only=False)
    sd = model.state_dict()
    out = {
        "keys": list(sd),
        "state": sd,
        "full": full,
        "devices": sorted({str(v.device) for v in sd.values()}),
        "still_sharded": [n for n, p in model.named_parameters() if p.dim() != 1],
    }
    base = model.get_base_model() if kind == "lora" else model
    layer = base.blocks[1] if kind == "mlp" else base.model.layers[1]
    lname = next(n for n, m in model.named_modules() if m is layer) + "."
    out["submodule"] = _same(layer.state_dict(), {k[len(lname) :]: v for k, v in full.items() if k.startswith(lname)})
    out["prefixed"] = _same(
        layer.state_dict(prefix="p."), {"p." + k[len(lname) :]: v for k, v in full.items() if k.startswith(lname)}
    )
    kept = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    out["keep_vars"] = all(
        isinstance(kept[n], nn.Parameter) and kept[n].requires_grad == p.requires_grad for n, p in params.items()
    ) and _same(kept, full)
    out["tied_shared"] = (sd["lm_head.weight"] is sd["model.embed_tokens.weight"]) if kind == "llama" else None
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    out["saved_shapes"] = {k: tuple(v.shape) for k, v in torch.load(buffer, weights_only=True).items()}
    train(model, opt, data[steps:])  # training goes on after the calls
    out["after"] = zp.full_state_dict(model, rank0_only=False)
    return out


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].detach(), b[k]) for k in a)


def rank0_only_worker(kind: str) -> dict:
    model, _ = build(kind, state_dict_rank0_only=True)
    sd = model.state_dict()
    sub = model.model.layers[0].state_dict() if kind != "mlp" else model.blocks[0].state_dict()
    return {"state": sd, "sub_keys": list(sub), "full": zp.full_state_dict(model, rank0_only=False)}


def load_worker(stage: int, loaded: dict, steps_before: int, steps_after: int) -> dict:
    """Train, ``model.load_state_dict(loaded)`` on every rank, train on: the final full state."""
    model, opt = build("mlp", stage)
    data = batches("mlp", steps_before + steps_after, dist.get_world_size())
    train(model, opt, data[:steps_before])
    result = model.load_state_dict(loaded)
    right_after = zp.full_state_dict(model, rank0_only=False)
    train(model, opt, data[steps_before:])
    return {
        "result": (result.missing_keys, result.unexpected_keys),
        "right_after": right_after,
        "final": zp.full_state_dict(model, rank0_only=False),
    }


def strict_worker(cases: dict) -> dict:
    """Each case's outcome on the set-up model: the error message, or the returned keys."""
    model, _ = build("mlp")
    before = zp.full_state_dict(model, rank0_only=False)
    out = {}
    for name, (state, kwargs) in cases.items():
        try:
            result = model.load_state_dict(state, **kwargs)
            out[name] = ("ok", result.missing_keys, result.unexpected_keys)
        except (RuntimeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    out["after"] = zp.full_state_dict(model, rank0_only=False)
    out["before"] = before
    return out


def one_rank_worker(peer: str, verb: str, timeout_s: float) -> tuple:
    """Rank 0 calls ``verb`` alone; rank 1 does nothing ("idle") or starts a forward ("forward")."""
    model, _ = build("llama", timeout_s=timeout_s)
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        if rank == 0 and verb == "state_dict":
            model.state_dict()
        elif rank == 0:
            model.load_state_dict(models.make_tiny_llama(layers=3).state_dict())
        elif peer == "forward":
            models.loss_fn(model, models.shard_batch(batches("llama", 1, 2)[0], rank, 2))
        return ("returned", "", time.monotonic() - start)
    except RuntimeError as exc:
        return ("RuntimeError", str(exc), time.monotonic() - start)


def _peak(events) -> tuple[int, int]:
    """Live bytes at the end and at their highest over allocation (+) and free (-) events in order."""
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return live, peak


def memory_worker(layers: int) -> dict:
    """Bytes allocated on the CPU while ``model.state_dict()`` runs (the profiler's allocation and free
    events, in order), against the result it returns, the largest unit and the whole model."""
    from torch.profiler import ProfilerActivity, profile

    from zero_plugin.engines.engine import engine_of

    model = models.make_tiny_llama(layers=layers, tie=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3))
    engine = engine_of(model, "test")
    unit_bytes = [sum(sp.layout.numel * sp.local.element_size() for sp in u.params) for u in engine.units]
    model.state_dict()  # warm: first-call allocations out of the measurement
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sd = model.state_dict()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    # gloo's worker threads stage the collectives in buffers of their own, allocated and freed at times that
    # interleave with the caller's by chance: each side is counted on its own.  The caller's thread is the
    # one the result was allocated on (the largest net allocation).
    net: dict[int, int] = {}
    for e in events:
        net[e.start_thread_id()] = net.get(e.start_thread_id(), 0) + e.nbytes()
    main = max(net, key=net.get)
    live, peak = _peak(e for e in events if e.start_thread_id() == main)
    _, other_peak = _peak(e for e in events if e.start_thread_id() != main)
    result = sum(v.numel() * v.element_size() for v in sd.values())
    return {
        "peak": peak,
        "other_peak": other_peak,
        "end": live,
        "result": result,
        "units": unit_bytes,
        "model": sum(sp.layout.numel * sp.local.element_size() for sp in engine.sharded.values()),
    }
