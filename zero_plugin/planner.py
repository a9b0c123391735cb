"""Memory planner: per-rank device and host bytes of a training step for each ZeRO stage.

    import zero_plugin.planner as zpp
    zpp.estimate("llama-7b", world_size=8, stage=3, param_dtype="bf16", batch=1, seq=2048)
    plan = zpp.Planner("llama-7b", param_dtype="bf16", batch=1, seq=2048)   # one trace, many rows
    plan.fit(world_size=8, gpu_mem=24 * 2**30, host_mem=128 * 2**30)

A step's memory is replayed as a timeline, not summed from maxima (that overestimates by the size of
whatever is gone when the other peaks):
  * model states: ``memory.theory_bytes`` (ZeRO paper section 5, the same numbers ``zp.memory_report``
    prints as theory).  Parameters and optimizer state live all step; gradients exist from the
    backward that produces them to the ``zero_grad`` after the step;
  * activations: one forward + backward traced on fake tensors (``planner_trace.py``);
  * our transient buffers, replayed at the trace's events exactly as the engine allocates them, in
    the layout ``Comm`` uses on the planned backend ([Note: in-place region gather] in
    ``collectives.py``; device "cpu" plans gloo, "cuda" NCCL):
    stages 0-2: a buffer per gradient bucket (``grads/bucket.py``), at most 2 buckets pending, then
    (stages 1-2) the all-gather of updated parameters after the step, at most 2 buckets at once; in
    place (stages 1-2 on gloo) no bucket buffer (the gradients themselves are summed, or a copy in the
    reduce dtype), stage 2's region copied out at completion, and no buffer for the parameter gather;
    stage 3: the root unit gathered for the whole step and the last unit of the forward order from its
    forward through its backward ([Note: last unit kept]), each other unit gathered around its forward
    and backward with ``prefetch_depth`` more in flight; buffered (NCCL): input ``width+2`` and output
    ``N*(width+2)`` in ``param_dtype``, reduce-scatter buffers ``N*(width+k)``; in place (gloo): the full
    tensors from the launch and no buffers, gradients kept whole until their reduction completes;
    at most 2 reductions in flight (``stage3/``);
  * the optimizer step: AdamW on one tensor at a time allocates two parameter-sized temporaries
    (CPU default), ``foreach`` one list of all of them (CUDA default), the fused kernel none (offload).
The estimate counts live tensor bytes: what ``torch.cuda.max_memory_allocated`` reports on a GPU, and
the peak RSS of a CPU run whose allocator returns freed blocks (``benchmarks/planner_accuracy.py``,
"exact" allocator).  [Note: glibc slack] With glibc's default malloc, freed blocks up to 32 MiB stay
in the heap (its mmap threshold rises to the largest block freed), so a CPU run's peak RSS is higher:
``rss_glibc`` (device "cpu" only) adds one activation peak, the documented slack term that the runs
in ``benchmarks/results/planner.md`` support (the heap keeps the freed blocks of one step's
activations; see the numbers there for how well it holds).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ._flat import ShardLayout
from .config import ZeroConfig
from .collectives import regions_in_place
from .grads.bucket import plan_buckets
from .memory import theory_bytes
from .planner_trace import (BUILTIN_MODELS, SYNTHETIC_BLOCKS, ParamInfo, Trace, checkpointing, default_loss,
                            hf_inputs, resolve_model, synthetic_trace, trace_model)

__all__ = ["BUILTIN_MODELS", "COST_MODEL", "SETTINGS", "SYNTHETIC_BLOCKS", "Planner", "cost", "estimate",
           "resolve_model"]

# Relative step cost used by ``Planner.fit`` to rank settings that fit (lower is faster):
# communication per step in units of Ψ (ZeRO paper section 7: 2Ψ for stages 0-2, 3Ψ for stage 3),
# plus a penalty for host traffic and the CPU optimizer step (ZeRO-Offload moves Ψ/N gradients down and
# Ψ/N parameters up each step over PCIe, and steps on the CPU; offloading parameters copies every
# gathered shard in, twice per step).  Ties go to the lower stage: least sharding, fewest collectives.
COST_MODEL = {"comm": {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}, "offload_optimizer": 1.5, "offload_params": 2.0}
_MAX_INFLIGHT = 2           # grads/reducer.py, optim/param_sync.py: bucket collectives pending at once
_MAX_INFLIGHT_REDUCES = 2   # stage3/hooks.py
_GATHER_TAG = 2             # stage3/unit.py


# -- timeline -----------------------------------------------------------------------------------------
class _Memory:
    """Bytes by (place, category) as the step proceeds; keeps the device, host and combined peaks."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], float] = {}
        self.acts = 0.0
        self.phase = "forward"
        self.peaks: dict[str, tuple[float, dict]] = {}

    def add(self, place: str, category: str, nbytes: float) -> None:
        self.bytes[(place, category)] = self.bytes.get((place, category), 0.0) + nbytes
        self.check()

    def check(self, acts: float | None = None) -> None:
        acts = self.acts if acts is None else acts
        device = acts + sum(v for (p, _), v in self.bytes.items() if p == "device")
        host = sum(v for (p, _), v in self.bytes.items() if p == "host")
        for name, value in (("device", device), ("host", host), ("total", device + host)):
            if value > self.peaks.get(name, (-1.0, None))[0]:
                self.peaks[name] = (value, {"phase": self.phase, "activations": acts, "bytes": dict(self.bytes)})

    @staticmethod
    def by_category(snapshot: dict, places: tuple[str, ...]) -> dict[str, float]:
        out: dict[str, float] = {}
        for (place, cat), v in snapshot["bytes"].items():
            if place in places:
                out[cat] = out.get(cat, 0.0) + v
        return out


@dataclass(frozen=True, slots=True)
class _Setting:
    stage: int
    world_size: int
    offload: bool
    offload_params: bool
    device: str
    config: ZeroConfig
    in_place: bool    # regions gathered and reduced in place (gloo, [Note: in-place region gather])


class _Replay:
    """Walks a trace's events, allocating and freeing what the engine would (see the module docstring)."""

    def __init__(self, plan: "Planner", s: _Setting, theory: dict[str, float]) -> None:
        self.plan, self.s, self.mem = plan, s, _Memory()
        self.n = s.world_size
        self.pb, self.rb, self.mb = plan.param_bytes, plan.reduce_bytes(s.config), plan.master_bytes
        self.shard_is_master = plan.shard_is_master(s)
        self.trainable = [i for i, p in enumerate(plan.params) if p.requires_grad and p.numel]
        self.mem.add(self.place("params"), "params", theory["params"])
        self.mem.add(self.place("optimizer"), "optimizer", theory["optimizer"])

    def place(self, category: str) -> str:
        s = self.s
        if category == "params":
            return "host" if s.offload_params else "device"
        if category == "grad_shards":
            return "host" if (s.offload_params and s.device == "cuda") else "device"
        if category in ("optimizer", "master_grads"):
            on_host = s.offload or (s.offload_params and s.device == "cuda")
            return "host" if on_host else "device"
        return "device"

    def local(self, i: int) -> int:
        return ShardLayout(self.plan.params[i].numel, self.n, 0).local_numel

    def run(self) -> _Memory:
        for ev in self.plan.trace.events:
            kind = ev[0]
            if kind == "seg":
                self.mem.check(ev[1])
                self.mem.acts = ev[2]
            elif kind == "backward":
                self.mem.phase = "backward"
            elif kind == "end":
                self.finish_backward()
            else:
                getattr(self, "on_" + kind)(*ev[1:])
        self.step()
        return self.mem

    def on_grad(self, i: int) -> None:
        self.mem.add("device", "grads", self.plan.params[i].numel * self.pb)

    # [Note: collective buffers] When the bytes of a collective count (measured with the RSS of 2 and
    # 4 gloo ranks, torch 2.13):
    #   * all-gather: input and output at the launch; on CPU gloo also stages the output in a temporary
    #     of its size until the collective completes (counted until our wait);
    #   * reduce-scatter: the input at the launch; the output when written: on CUDA at the launch (the
    #     allocation), on CPU at our wait (``Comm`` issues it on gloo as an in-place all-reduce and copies
    #     this rank's row out in the wait);
    #   * all-reduce: in place.
    def gather_launch(self, category: str, inp: float, out: float) -> float:
        """Allocate an all-gather's buffers; returns the temporary to release at completion."""
        temp = out if self.s.device == "cpu" else 0.0
        self.mem.add("device", category, inp + out)
        self.mem.add("device", "collective_temp", temp)
        return temp

    def gather_complete(self, temp: float) -> None:
        self.mem.add("device", "collective_temp", -temp)

    def reduce_output(self, category: str, out: float, at_launch: bool) -> None:
        """Count a reduce-scatter's output where it becomes memory (see [Note: collective buffers])."""
        if at_launch == (self.s.device == "cuda"):
            self.mem.add("device", category, out)

    def on_fwd_pre(self, unit: int, in_backward: bool) -> None:
        pass

    on_fwd_post = on_bwd_pre = on_bwd_post = on_fwd_pre

    def finish_backward(self) -> None:
        pass

    def step(self) -> None:
        """before_step (gradients copied to separate masters), the optimizer's temporaries, after_step.
        The non-finite check allocates nothing that counts (one fp32 sum per gradient)."""
        self.mem.phase = "step"
        locals_ = [self.local(i) if self.s.stage else self.plan.params[i].numel for i in self.trainable] or [0]
        if self.separate_masters():
            self.mem.add(self.place("master_grads"), "step", sum(locals_) * self.mb)
        temp = self.optimizer_temporaries(locals_)
        self.mem.add(self.place("optimizer"), "step", temp)
        self.mem.add(self.place("optimizer"), "step", -temp)
        self.mem.bytes = {k: v for k, v in self.mem.bytes.items() if k[1] != "step"}
        self.after_step()

    def separate_masters(self) -> bool:
        mixed = self.plan.mixed
        if self.s.stage == 3:
            return not self.shard_is_master and (mixed or (self.s.offload and self.s.device == "cuda"))
        return mixed or (self.s.offload and self.s.device == "cuda")

    def optimizer_temporaries(self, locals_: list[int]) -> float:
        """AdamW's temporaries: the fused CPU kernel (offload, optim/offload.py) needs none; torch's default
        on CUDA (foreach) one sqrt per parameter, all at once; on CPU (one tensor at a time) the sqrt and
        the division of the largest parameter."""
        if self.s.offload:
            return 0.0
        if self.s.device == "cuda" and not self.s.offload_params:
            return sum(locals_) * self.mb
        return 2.0 * max(locals_) * self.mb

    def after_step(self) -> None:
        pass


class _ReplicatedReplay(_Replay):
    """Stages 0-2 (``grads/reducer.py``, ``optim/param_sync.py``): full parameters; gradients bucketed and
    all-reduced (0) or reduce-scattered (1-2), at most ``_MAX_INFLIGHT`` buckets pending."""

    def __init__(self, plan: "Planner", s: _Setting, theory: dict[str, float]) -> None:
        super().__init__(plan, s, theory)
        self.sharded = s.stage > 0
        self.in_place = s.in_place and self.sharded   # stage 0 all-reduces a flat bucket on every backend
        self.buckets = self._buckets()
        self.bucket_of = {i: b for b, (idx, _, _) in enumerate(self.buckets) for i in idx}
        self.ready = [0] * len(self.buckets)
        self.launched: set[int] = set()
        self.inflight: list[int] = []

    def _buckets(self) -> list[tuple[list[int], int, int]]:
        """(param indices, width, flags) per bucket, cut as ``grads/bucket.py`` cuts them."""
        slots = [SimpleNamespace(index=i, param=SimpleNamespace(numel=lambda i=i: self.plan.params[i].numel,
                                                                element_size=lambda: self.pb),
                                 layout=ShardLayout(self.plan.params[i].numel, self.n if self.sharded else 1, 0))
                 for i in self.trainable]
        return [([slot.index for slot in b.slots], b.width, len(b.slots))
                for b in plan_buckets(slots, int(self.s.config.bucket_size_mb * 2**20), sharded=self.sharded)]

    def buffer_bytes(self, b: int) -> tuple[float, float]:
        """(input, output) bytes of bucket ``b``'s collective: all-reduce in place, reduce-scatter N:1."""
        _, width, k = self.buckets[b]
        return ((self.n if self.sharded else 1) * (width + k) * self.rb, (width + k) * self.rb if self.sharded else 0)

    def on_grad(self, i: int) -> None:
        super().on_grad(i)
        b = self.bucket_of[i]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b][0]):
            self.launch(b)
            self.inflight.append(b)
            while len(self.inflight) > _MAX_INFLIGHT:
                self.complete(self.inflight.pop(0))

    def bucket_numel(self, b: int) -> int:
        return sum(self.plan.params[i].numel for i in self.buckets[b][0])

    def launch(self, b: int) -> None:
        self.launched.add(b)
        if self.in_place:   # grads/reducer.py ``_launch_in_place``: the gradients themselves are summed
            if self.rb != self.pb:   # ... or a copy in the reduce dtype, the gradient itself freed (stage 2)
                self.mem.add("device", "reduce_buffers", self.bucket_numel(b) * self.rb)
                if self.s.stage == 2:
                    self.mem.add("device", "grads", -self.bucket_numel(b) * self.pb)
            return
        inp, out = self.buffer_bytes(b)
        self.mem.add("device", "reduce_buffers", inp)
        if self.s.stage == 2:   # ZeRO-2: the full gradients go as soon as they are in the buffer
            self.mem.add("device", "grads", -sum(self.plan.params[i].numel for i in self.buckets[b][0]) * self.pb)
        self.reduce_output("reduce_buffers", out, at_launch=True)

    def complete(self, b: int) -> None:
        if self.in_place:   # stage 2 keeps a copy of its region; the full gradients go with the bucket
            if self.s.stage == 2:
                self.mem.add(self.place("grad_shards"), "grad_shards",
                             sum(self.local(i) for i in self.buckets[b][0]) * self.pb)
                if self.rb == self.pb:
                    self.mem.add("device", "grads", -self.bucket_numel(b) * self.pb)
            if self.rb != self.pb:
                self.mem.add("device", "reduce_buffers", -self.bucket_numel(b) * self.rb)
            return
        inp, out = self.buffer_bytes(b)
        self.reduce_output("reduce_buffers", out, at_launch=False)
        if self.s.stage == 2:   # the owned shards are views of the bucket's output (or a cast copy of it)
            same = self.rb == self.pb
            shards = out if same else sum(self.local(i) for i in self.buckets[b][0]) * self.pb
            self.mem.add(self.place("grad_shards"), "grad_shards", shards)
        self.mem.add("device", "reduce_buffers", -(inp + out))

    def finish_backward(self) -> None:
        for b in range(len(self.buckets)):
            if b not in self.launched:
                self.launch(b)
                self.inflight.append(b)
        for b in sorted(self.inflight):
            self.complete(b)
        self.inflight.clear()

    def after_step(self) -> None:
        if self.s.stage == 2:
            self.mem.bytes.pop((self.place("grad_shards"), "grad_shards"), None)
        if self.s.stage in (1, 2) and self.n > 1 and not self.in_place:   # at most _MAX_INFLIGHT at once
            self.mem.phase = "all-gather"
            pending: list[tuple[float, float]] = []
            for _, width, _ in self.buckets:
                inp, out = width * self.pb, self.n * width * self.pb
                pending.append((inp + out, self.gather_launch("allgather_buffers", inp, out)))
                if len(pending) > _MAX_INFLIGHT:
                    buffers, temp = pending.pop(0)
                    self.gather_complete(temp)
                    self.mem.add("device", "allgather_buffers", -buffers)


class _Stage3Replay(_Replay):
    """Stage 3: units gathered around their forward and backward, reduce-scattered when their grads are in."""

    def __init__(self, plan: "Planner", s: _Setting, theory: dict[str, float]) -> None:
        super().__init__(plan, s, theory)
        self.order = plan.trace.forward_order
        units = range(len(plan.trace.unit_names))
        members = {u: [i for i, p in enumerate(plan.params) if p.unit == u and p.numel] for u in units}
        train = {u: [i for i in members[u] if plan.params[i].requires_grad] for u in units}
        self.n_train = {u: len(train[u]) for u in units}
        self.full = {u: sum(plan.params[i].numel for i in members[u]) * self.pb for u in units}
        self.gather_buf = {u: self._width(members[u], _GATHER_TAG) * self.pb for u in units}      # per rank
        self.reduce_buf = {u: self._width(train[u], len(train[u])) * self.rb for u in units}    # per rank
        grad_bytes = self.mb if self.shard_is_master else self.pb
        self.shard_grads = {u: sum(self.local(i) for i in train[u]) * grad_bytes for u in units}
        self.wrapped = {ev[1] for ev in plan.trace.events if ev[0] == "bwd_post"}
        self.gathered: set[int] = set()
        self.inflight: dict[int, float] = {}     # unit -> its gather's temporary
        self.reduces: deque[int] = deque()
        self.reduced: set[int] = set()
        self.post: set[int] = set()
        self.ready = {u: 0 for u in units}

    def _width(self, idx: list[int], extra: int) -> int:
        """Elements per rank in a unit's collective (``stage3/unit.py``): padded shards plus the extras."""
        return sum(ShardLayout(self.plan.params[i].numel, self.n, 0).shard_numel for i in idx) + extra if idx else 0

    # -- gather / release (stage3/unit.py) -------------------------------------------------------
    def gather(self, u: int) -> None:
        if self.s.in_place:   # the full tensors are allocated at the launch and broadcast into
            self.inflight[u] = 0.0
            self.mem.add("device", "gathered", self.full[u])
            return
        self.inflight[u] = self.gather_launch("gather_buffers", self.gather_buf[u], self.n * self.gather_buf[u])

    def ensure(self, u: int) -> None:
        if u in self.gathered:
            return
        if u not in self.inflight:
            self.gather(u)
        temp = self.inflight.pop(u)
        if self.s.in_place:
            self.gathered.add(u)
            return
        self.gather_complete(temp)
        self.mem.add("device", "gathered", self.full[u])          # to_unsharded while the buffers are alive
        self.mem.add("device", "gather_buffers", -(self.n + 1) * self.gather_buf[u])
        self.gathered.add(u)

    def prefetch(self, u: int, direction: int) -> None:
        depth = self.s.config.prefetch_depth
        if not depth or u not in self.order:
            return
        i = self.order.index(u)
        span = self.order[i + 1: i + 1 + depth] if direction > 0 else list(reversed(self.order[max(0, i - depth): i]))
        for v in span:
            if v not in self.gathered and v not in self.inflight:
                self.gather(v)

    def reshard(self, u: int) -> None:
        if u in self.inflight:
            self.ensure(u)
        if u in self.gathered:
            self.gathered.discard(u)
            self.mem.add("device", "gathered", -self.full[u])

    # -- hooks (stage3/hooks.py) -----------------------------------------------------------------
    def on_fwd_pre(self, u: int, in_backward: bool) -> None:
        self.ensure(u)
        if not in_backward:
            self.prefetch(u, +1)

    def on_fwd_post(self, u: int, in_backward: bool) -> None:
        """Reshard after forward, except the root and the last unit of the forward order, which backward
        needs first ([Note: last unit kept] in stage3/hooks.py)."""
        if in_backward or not self.s.config.reshard_after_forward:
            return
        kept = {0, self.order[-1]} if self.order else {0}
        for v in ([w for w in self.gathered | set(self.inflight) if w not in kept] if u == 0 else
                  [] if u in kept else [u]):
            self.reshard(v)

    def on_bwd_pre(self, u: int, in_backward: bool) -> None:
        self.ensure(u)
        self.prefetch(u, -1)

    def on_bwd_post(self, u: int, in_backward: bool) -> None:
        self.post.add(u)
        if u in self.reduced or not self.n_train[u]:
            self.reshard(u)

    def on_grad(self, i: int) -> None:
        super().on_grad(i)
        u = self.plan.params[i].unit
        self.ready[u] += 1
        if self.ready[u] == self.n_train[u] and u not in self.reduced:
            self.launch(u)
            if u != 0 and (u in self.post or u not in self.wrapped):
                self.reshard(u)

    def grad_numel(self, u: int) -> int:
        return sum(p.numel for p in self.plan.params if p.unit == u and p.requires_grad and p.numel)

    def launch(self, u: int) -> None:
        self.reduced.add(u)
        if self.s.in_place:   # stage3/unit.py ``_reduce_in_place``: the gradients (or a reduce-dtype copy)
            if self.rb != self.pb:
                self.mem.add("device", "reduce_buffers", self.grad_numel(u) * self.rb)
                self.mem.add("device", "grads", -self.grad_numel(u) * self.pb)
        else:
            self.mem.add("device", "reduce_buffers", self.n * self.reduce_buf[u])
            self.mem.add("device", "grads", -self.grad_numel(u) * self.pb)
            self.reduce_output("reduce_buffers", self.reduce_buf[u], at_launch=True)
        self.reduces.append(u)
        while len(self.reduces) > _MAX_INFLIGHT_REDUCES:
            self.complete(self.reduces.popleft())

    def complete(self, u: int) -> None:
        if self.s.in_place:   # this rank's region is copied out, then the full gradients go
            self.mem.add(self.place("grad_shards"), "grad_shards", self.shard_grads[u])
            if self.rb != self.pb:
                self.mem.add("device", "reduce_buffers", -self.grad_numel(u) * self.rb)
            else:
                self.mem.add("device", "grads", -self.grad_numel(u) * self.pb)
            return
        self.reduce_output("reduce_buffers", self.reduce_buf[u], at_launch=False)
        self.mem.add(self.place("grad_shards"), "grad_shards", self.shard_grads[u])
        self.mem.add("device", "reduce_buffers", -(self.n + 1) * self.reduce_buf[u])

    def finish_backward(self) -> None:
        for u in sorted(self.n_train):
            if self.n_train[u] and u not in self.reduced:
                self.launch(u)
        while self.reduces:
            self.complete(self.reduces.popleft())
        for u in list(self.gathered | set(self.inflight)):
            self.reshard(u)

    def after_step(self) -> None:
        self.mem.bytes.pop((self.place("grad_shards"), "grad_shards"), None)


# -- planner ------------------------------------------------------------------------------------------
SETTINGS = ((0, False, False), (1, False, False), (2, False, False), (3, False, False),
            (1, True, False), (2, True, False), (3, True, False), (3, True, True))
"""(stage, offload_optimizer, offload_params) rows of a plan."""


class Planner:
    """One model and one activation trace, planned for any stage, world size and offload setting.

    ``model``: an ``nn.Module`` (any device; meta is fine), a transformers config, a built-in name
    (``BUILTIN_MODELS``), a config path or Hub id, or a parameter count (no structure: stage 3 assumes
    ``SYNTHETIC_BLOCKS`` equal blocks, no activations).  ``batch``/``seq``: per-rank micro-batch for the
    activation trace (transformers causal LMs; other models pass ``inputs`` and ``loss_fn``).
    ``config``: the rest of ``ZeroConfig`` (bucket size, prefetch depth, units, reduce dtype).
    ``device``: "cuda" (the default planning target) or "cpu" (what a CPU-only run does: offload copies
    nothing and the optimizer steps one tensor at a time).
    """

    def __init__(self, model: Any, *, param_dtype: torch.dtype | str | None = None, batch: int | None = None,
                 seq: int | None = None, checkpointing: bool = False, config: ZeroConfig | None = None,
                 device: str = "cuda", state_per_param: int = 2, inputs: Callable | None = None,
                 loss_fn: Callable | None = None) -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"planner: device must be 'cuda' or 'cpu'; got {device!r}")
        if (batch is None) != (seq is None) or any(v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                                      or v < 1) for v in (batch, seq)):
            raise ValueError(f"planner: batch and seq must be given together, as ints >= 1; got batch={batch!r}, "
                             f"seq={seq!r}")
        config = config or ZeroConfig()
        self.config = config.replace(param_dtype=param_dtype) if param_dtype is not None else config
        self.device, self.state_per_param = device, state_per_param
        self.batch, self.seq, self.checkpointing = batch, seq, checkpointing
        resolved = resolve_model(model)
        if isinstance(resolved, int):
            self.model, self.model_dtype = None, torch.float32
            self.trace = synthetic_trace(resolved)
        else:
            self.model = resolved
            self.model_dtype = next((p.dtype for p in resolved.parameters() if p.is_floating_point()), torch.float32)
            self.trace = self._trace(inputs, loss_fn)
        self.params: list[ParamInfo] = self.trace.params
        cfg = self.config   # precision as memory.py decides it
        self.mixed = cfg.param_dtype is not None and cfg.param_dtype != cfg.master_dtype
        self.param_bytes = (cfg.param_dtype or self.model_dtype).itemsize
        self.master_bytes = cfg.master_dtype.itemsize if self.mixed else self.param_bytes

    def _trace(self, inputs: Callable | None, loss_fn: Callable | None) -> Trace:
        from .stage3.policy import assign_units

        model = self.model
        modules, owner = assign_units(model, self.config)
        make = inputs or hf_inputs(model, self.batch or 1, self.seq or 1)
        was_training = model.training
        model.train()
        try:
            with checkpointing(model, self.checkpointing):
                trace = trace_model(model, [m for _, m in modules], owner, [n for n, _ in modules], make,
                                    param_dtype=self.config.param_dtype, loss_fn=loss_fn or default_loss)
        finally:
            model.train(was_training)
        if self.batch is None and inputs is None:   # structure only: no activations were asked for
            trace.events = [("seg", 0, 0) if ev[0] == "seg" else ev for ev in trace.events]
            trace.saved_bytes = trace.forward_bytes = trace.peak_bytes = 0
        return trace

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def counts(self) -> dict[str, int]:
        trainable = sum(p.numel for p in self.params if p.requires_grad)
        total = sum(p.numel for p in self.params)
        return {"total": total, "trainable": trainable, "frozen": total - trainable}

    def reduce_bytes(self, config: ZeroConfig) -> int:
        dtype = config.effective_reduce_dtype
        return dtype.itemsize if dtype is not None else self.param_bytes

    def shard_is_master(self, s: _Setting) -> bool:
        """Stage 3 keeps one fp32 shard as parameter and master unless offload moves masters off the device."""
        return s.stage == 3 and self.mixed and not (s.offload and s.device == "cuda")

    def theory(self, s: _Setting) -> dict[str, float]:
        c = self.counts
        return theory_bytes(stage=s.stage, world_size=s.world_size, trainable=c["trainable"], frozen=c["frozen"],
                            param_bytes=self.param_bytes, master_bytes=self.master_bytes,
                            state_per_param=self.state_per_param, mixed=self.mixed,
                            shard_is_master=self.shard_is_master(s))

    # -- estimates ----------------------------------------------------------------------------------
    def setting(self, world_size: int, stage: int, offload: bool | str = False,
                offload_params: bool = False) -> _Setting:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"planner: world_size must be an int >= 1; got {world_size!r}")
        config = self.config.replace(stage=stage, offload_optimizer=offload, offload_params=offload_params)
        return _Setting(config.stage, world_size, config.offload, config.offload_params, self.device, config,
                        in_place=self.device == "cpu" and regions_in_place("gloo"))

    def estimate(self, world_size: int, stage: int, *, offload: bool | str = False,
                 offload_params: bool = False) -> dict[str, Any]:
        """Per-rank bytes for one setting; see the module docstring for what each part counts."""
        s = self.setting(world_size, stage, offload, offload_params)
        theory = self.theory(s)
        replay = (_Stage3Replay if s.stage == 3 else _ReplicatedReplay)(self, s, theory)
        mem = replay.run()
        return _result(self, s, theory, replay, mem)

    def rows(self, world_size: int, settings=SETTINGS) -> list[dict[str, Any]]:
        return [self.estimate(world_size, st, offload=off, offload_params=op) for st, off, op in settings]

    def fit(self, world_size: int, gpu_mem: float, host_mem: float, *, margin: float = 0.1,
            ranks_per_host: int | None = None, settings=SETTINGS) -> dict[str, Any]:
        """Which settings fit ``gpu_mem`` per device and ``host_mem`` per machine, ranked by ``COST_MODEL``.

        ``margin``: fraction of each memory kept free (CUDA context, allocator fragmentation, the
        process itself).  ``ranks_per_host``: ranks sharing one machine's host memory (default min(N, 8)).
        """
        if not 0 <= margin < 1:
            raise ValueError(f"planner: margin must be a fraction in [0, 1); got {margin!r}")
        if ranks_per_host is not None and (not isinstance(ranks_per_host, int) or ranks_per_host < 1):
            raise ValueError(f"planner: ranks_per_host must be an int >= 1; got {ranks_per_host!r}")
        per_host = ranks_per_host or min(world_size, 8)
        rows = []
        for r in self.rows(world_size, settings):
            device_ok = r["peak"]["device"] <= gpu_mem * (1 - margin)
            host_ok = r["peak"]["host"] * per_host <= host_mem * (1 - margin)
            rows.append({**r, "fits": device_ok and host_ok, "device_ok": device_ok, "host_ok": host_ok,
                         "cost": cost(r["stage"], r["offload"], r["offload_params"])})
        ranked = sorted(rows, key=lambda r: (not r["fits"], r["cost"], r["stage"]))
        best = ranked[0] if ranked and ranked[0]["fits"] else None
        return {"world_size": world_size, "gpu_mem": gpu_mem, "host_mem": host_mem, "margin": margin,
                "ranks_per_host": per_host, "rows": ranked, "best": best}


def cost(stage: int, offload: bool, offload_params: bool) -> float:
    """Relative step cost of a setting (``COST_MODEL``)."""
    return (COST_MODEL["comm"][stage] + COST_MODEL["offload_optimizer"] * offload
            + COST_MODEL["offload_params"] * offload_params)


def _result(plan: Planner, s: _Setting, theory: dict[str, float], replay: _Replay, mem: _Memory) -> dict:
    """The result dict; ``at_peak`` breaks down the device peak (CUDA) or the one-memory peak (CPU)."""
    device_peak = mem.peaks["device"][0]
    snapshot = mem.peaks["total" if s.device == "cpu" else "device"][1]
    at = mem.by_category(snapshot, ("device", "host") if s.device == "cpu" else ("device",))
    grads = at.get("grads", 0.0) + at.get("grad_shards", 0.0)
    transient = {k: at.get(k, 0.0) for k in ("gathered", "gather_buffers", "reduce_buffers", "allgather_buffers",
                                            "collective_temp", "step")}
    transient["total"] = sum(transient.values())
    placed = {"device": 0.0, "host": 0.0}
    for cat in ("params", "grads", "optimizer"):
        placed[replay.place("grad_shards" if cat == "grads" and s.stage >= 2 else cat)] += theory[cat]
    return {
        "stage": s.stage, "world_size": s.world_size, "offload": s.offload, "offload_params": s.offload_params,
        "device": s.device, "param_dtype": str(plan.config.param_dtype or plan.model_dtype).replace("torch.", ""),
        "params": plan.counts, "model_states": theory, "placement": placed,
        "activations": {"saved": plan.trace.saved_bytes, "end_of_forward": plan.trace.forward_bytes,
                        "peak": plan.trace.peak_bytes, "at_peak": snapshot["activations"]},
        "at_peak": {"phase": snapshot["phase"], "params": at.get("params", 0.0), "optimizer": at.get("optimizer", 0.0),
                    "grads": grads, "transient": transient, "activations": snapshot["activations"]},
        "peak": {"device": device_peak, "host": mem.peaks["host"][0], "total": mem.peaks["total"][0],
                 "phase": snapshot["phase"]},
        **({"rss_glibc": mem.peaks["total"][0] + plan.trace.peak_bytes} if s.device == "cpu" else {}),
    }


def estimate(model_or_config: Any, world_size: int, stage: int, *, param_dtype: torch.dtype | str | None = None,
             offload: bool | str = False, batch: int | None = None, seq: int | None = None,
             checkpointing: bool = False, offload_params: bool = False, device: str = "cuda",
             config: ZeroConfig | None = None) -> dict[str, Any]:
    """Per-rank memory of one training step; see :class:`Planner` (which reuses one trace for many rows)."""
    plan = Planner(model_or_config, param_dtype=param_dtype, batch=batch, seq=seq, checkpointing=checkpointing,
                   config=config, device=device)
    return plan.estimate(world_size, stage, offload=offload, offload_params=offload_params)
