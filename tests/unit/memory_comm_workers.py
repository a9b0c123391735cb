"""Functions that run inside the ranks of ``tests/unit/test_memory_comm.py``."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from zero_plugin.comm import stats as comm_counters
from zero_plugin.engines.engine import engine_of

# Odd sizes (padding on 2-4 ranks) and ~295k parameters, so padding is negligible next to Ψ.
SIZES = (257, 509, 255, 131)
ROWS_PER_RANK = 4


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = []
        for d_in, d_out in zip(SIZES[:-1], SIZES[1:]):
            layers += [nn.Linear(d_in, d_out), nn.Tanh()]
        return nn.Sequential(*layers[:-1])


def numel_of_model() -> tuple[int, list[int]]:
    sizes = [p.numel() for p in build_model().parameters()]
    return sum(sizes), sizes


def _config(stage: int, mixed: bool, **extra) -> zp.ZeroConfig:
    return zp.ZeroConfig(stage=stage, param_dtype="bf16" if mixed else None, **extra)


def _setup(stage: int, mixed: bool, **extra):
    model = build_model()
    return zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _config(stage, mixed, **extra))


def _backward(model, seed: int) -> None:
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(ROWS_PER_RANK, SIZES[0], generator=gen).to(dtype)
    y = torch.randn(ROWS_PER_RANK, SIZES[-1], generator=gen).to(dtype)
    F.mse_loss(model(x), y).backward()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = _storage_key(t)
        if t.untyped_storage().nbytes() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def independent_count(model, opt) -> int:
    """Bytes of every distinct storage reachable from the model, the optimizer and the engine's grad shards."""
    tensors = []
    for p in model.parameters():
        tensors += [p] + ([p.grad] if p.grad is not None else [])
    for group in opt.param_groups:
        for p in group["params"]:
            tensors += [p] + ([p.grad] if p.grad is not None else [])
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += engine_of(model, "x").model_state_tensors()["grads"]
    return _unique_bytes(tensors)


def all_live_tensors() -> list[torch.Tensor]:
    """Every live Python tensor object (after a collection), meta tensors left out; also read by
    layout_footprint_workers.py."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated torch.distributed.reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]


def _live_tensor_bytes(baseline: list[torch.Tensor]) -> int:
    """Bytes of every distinct storage held by a live Python tensor object, except the baseline's.

    The caller keeps ``baseline`` alive, so none of its storage addresses can be reused meanwhile.
    """
    exclude = {_storage_key(t) for t in baseline}
    return _unique_bytes(t for t in all_live_tensors() if _storage_key(t) not in exclude)


def _unexplained(baseline: list[torch.Tensor], model, opt) -> list[str]:
    """Live tensors outside the baseline and outside the independent count (diagnostics for a failure)."""
    known = {_storage_key(t) for t in baseline}
    for p in model.parameters():
        known.add(_storage_key(p))
        if p.grad is not None:
            known.add(_storage_key(p.grad))
    for group in opt.param_groups:
        for p in group["params"]:
            known.add(_storage_key(p))
    for state in opt.state.values():
        known.update(_storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    known.update(_storage_key(t) for t in engine_of(model, "x").model_state_tensors()["grads"])
    out = []
    for t in all_live_tensors():
        if _storage_key(t) not in known and t.untyped_storage().nbytes() > 4096:
            refs = [type(r).__name__ for r in gc.get_referrers(t)][:8]
            out.append(f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes()} B, referrers {refs}")
            known.add(_storage_key(t))
    return out


SMALL_BYTES = 256  # far below any buffer a gloo work holds (a bucket's payload)


def memory_worker(stage: int, mixed: bool) -> dict:
    """Report after step, zero_grad, backward (optimizer state exists; stage 2 holds its grad shards)."""
    baseline = all_live_tensors()
    model, opt = _setup(stage, mixed)
    _backward(model, seed=0)
    opt.step()
    opt.zero_grad()
    _backward(model, seed=1)
    report = zp.memory_report(model, opt)
    independent = independent_count(model, opt)
    # A gloo work object that just completed may still hold its input tensors for a moment in the
    # worker thread (and torch keeps the Python wrapper alive while C++ holds the tensor): let go of
    # them before counting.  A tensor the engine really keeps stays, and the assertion catches it.  Up to
    # SMALL_BYTES more is not waited for: at stage 0 the reducer holds one float32 inf/NaN flag per bucket
    # until the step ([Note: finite check in the average] in comm/layout.py), so "live <= independent" never
    # held there and every run waited the whole 2 s, gathering every live object 40 times (~12 s per test).
    for _ in range(40):
        live = _live_tensor_bytes(baseline)
        if live <= independent + SMALL_BYTES:
            break
        time.sleep(0.05)
    return {
        "report": report,
        "independent": independent,
        "live": live,
        "unexplained": _unexplained(baseline, model, opt),
        "full_grads": sum(p.grad is not None for p in model.parameters()),
    }


def comm_worker(stage: int, mixed: bool, bucket_size_mb: float, buffered: bool = False) -> dict:
    """comm_stats() after each phase of one accumulation step: no_sync backward, backward, clip, step."""
    with collectives_layout(buffered):
        model, opt = _setup(stage, mixed, bucket_size_mb=bucket_size_mb)
    zp.reset_comm_stats()
    phases = {}
    with zp.no_sync(model):
        _backward(model, seed=0)
    phases["no_sync_backward"] = _take_stats()
    _backward(model, seed=1)
    phases["backward"] = _take_stats()
    zp.clip_grad_norm_(model, 1.0)
    phases["clip"] = _take_stats()
    opt.step()
    opt.zero_grad()
    phases["step"] = _take_stats()
    return phases


def _take_stats() -> dict:
    stats = zp.comm_stats()
    zp.reset_comm_stats()
    return stats


# -- every collective goes through zero_plugin/comm/collectives.py ------------------------------------

# torch.distributed function -> the comm_stats() kind zero_plugin records for it.
COUNTED = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_gather_object": "all_gather_object",
    "broadcast_object_list": "broadcast_object",
}
# Collectives zero_plugin is not expected to use at all: any call shows up under its own name.
OTHERS = (
    "all_gather",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "send_object_list",
    "recv_object_list",
)


class _CollectiveSpy:
    """Counting wrappers over torch.distributed's collectives, installed wherever the originals are bound.

    The wrappers replace the functions in ``torch.distributed``, ``torch.distributed.distributed_c10d``
    and any ``zero_plugin`` module that bound one to its own name (``collectives._ALL_GATHER``), so a call
    through any of these names is seen. A thread-local depth counts only the outermost call: torch's
    object collectives call its tensor collectives internally.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._depth = threading.local()
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, name: str, fn):
        def spy(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return spy

    def install(self) -> None:
        originals = {}
        for name in set(COUNTED) | set(OTHERS):
            fn = getattr(dist, name, None)
            if fn is not None:
                originals[id(fn)] = (name, fn)
        modules = [dist, dist.distributed_c10d] + [
            m for n, m in list(sys.modules.items()) if n.startswith("zero_plugin") and m is not None
        ]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if id(value) in originals and originals[id(value)][1] is value:
                    name, fn = originals[id(value)]
                    self._undo.append((module, attr, value))
                    setattr(module, attr, self._wrap(name, fn))

    def remove(self) -> None:
        for module, attr, value in reversed(self._undo):
            setattr(module, attr, value)
        self._undo.clear()

    @contextlib.contextmanager
    def active(self):
        self.install()
        try:
            yield self
        finally:
            self.remove()


@contextlib.contextmanager
def collectives_layout(buffered: bool | str):
    """[Note: in-place region gather] in zero_plugin/comm/collectives.py: gloo gathers and reduces in place
    unless ZERO_PLUGIN_BUFFERED_COLLECTIVES=1 selects the rank-major buffered layout NCCL uses.
    ``"deferred"``: the buffered layout (callers also defer host reads: ``deferred_reads``)."""
    previous = os.environ.get("ZERO_PLUGIN_BUFFERED_COLLECTIVES")
    os.environ["ZERO_PLUGIN_BUFFERED_COLLECTIVES"] = "1" if buffered else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("ZERO_PLUGIN_BUFFERED_COLLECTIVES")
        else:
            os.environ["ZERO_PLUGIN_BUFFERED_COLLECTIVES"] = previous


def deferred_reads(buffered: bool | str):
    """``buffered == "deferred"``: CPU reads of gather tags and has-gradient flags stay pending until forced,
    as on CUDA ([Note: deferred host reads] in zero_plugin/comm/host_reads.py)."""
    from zero_plugin.comm.host_reads import deferred_on_cpu

    return deferred_on_cpu() if buffered == "deferred" else contextlib.nullcontext()


def spy_worker(stage: int, mixed: bool, bypass: bool = False, buffered: bool = False) -> dict:
    """Setup, an accumulation step and the state verbs, with every torch.distributed collective counted.

    ``bypass=True`` adds one raw ``torch.distributed`` all-reduce, which the spy must see and
    ``comm_stats()`` must not (the check's own control).
    """
    spy = _CollectiveSpy()
    with collectives_layout(buffered), spy.active():
        zp.reset_comm_stats()
        model, opt = _setup(stage, mixed, bucket_size_mb=0.25)
        with zp.no_sync(model):
            _backward(model, seed=0)
        _backward(model, seed=1)
        zp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        zp.full_state_dict(model)
        full = opt.consolidate_state_dict(to_rank=None)
        opt.load_state_dict(full)
        with zp.gathered_parameters(model, modifier_rank=0):
            pass
        zp.load_full_state_dict(model, zp.full_state_dict(model), src_rank=0)
        if bypass:
            dist.all_reduce(torch.zeros(1))
        stats = zp.comm_stats()
        physical = comm_counters.physical_calls()
        wrapped = sorted({attr for _, attr, _ in spy._undo})
    return {"spy": dict(spy.counts), "stats": stats, "physical": physical, "wrapped": wrapped}
