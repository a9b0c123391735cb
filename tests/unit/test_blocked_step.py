"""[Note: cache-blocked offload step]: the blocked step is the whole-tensor offload step, bitwise, without
ever holding an fp32 gradient larger than one block; it steps aside where the direct fused step would."""

from __future__ import annotations

import pytest
import torch

import zero_plugin as zp
from zero_plugin.optim import blocked_step as B
from zero_plugin.optim.blocked_step import BlockedStep
from zero_plugin.optim.cpu_step import fused_cpu_step
from zero_plugin.optim.master import MasterParam
from zero_plugin.tensors.flat import ShardLayout

SHAPES = [(7, 5), (13,), (300,), (1000,), (64,), (3, 3)]  # 1000 and 300 cross blocks of 128


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(B, "BLOCK", 128)
    monkeypatch.setattr(B, "SINGLE_BLOCK", 1)  # always split, however small the masters are in all


def _slots(param_dtype: torch.dtype, cls, hyper: dict):
    g = torch.Generator().manual_seed(0)
    slots = []
    for i, shape in enumerate(SHAPES):
        full = torch.randn(shape, generator=g)
        param = torch.nn.Parameter(full.to(param_dtype))
        layout = ShardLayout(param.numel(), 1, 0)
        slots.append(MasterParam(f"p{i}", param, layout, param.data, torch.float32, source=full))
    masters = [s.master for s in slots]
    groups = [{"params": masters[:3]}, {"params": masters[3:], "lr": 3e-3, "weight_decay": 0.0}]
    return slots, cls(groups, lr=1e-3, fused=True, **hyper)


def _grads(step: int, grad_dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=g).to(grad_dtype) for shape in SHAPES]
    grads[5] = None  # never a gradient: no state, untouched
    return grads


@pytest.mark.parametrize(
    "cls,hyper",
    [
        (torch.optim.AdamW, {"weight_decay": 0.01}),
        (torch.optim.AdamW, {"amsgrad": True, "maximize": True, "betas": (0.8, 0.99)}),
        (torch.optim.Adam, {"weight_decay": 0.1, "eps": 1e-6}),
    ],
)
@pytest.mark.parametrize(
    "param_dtype,grad_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_bitwise_same_as_whole_tensor_path(small_blocks, cls, hyper, param_dtype, grad_dtype):
    ref_slots, ref_opt = _slots(param_dtype, cls, hyper)
    slots, opt = _slots(param_dtype, cls, hyper)
    blocked = BlockedStep(slots)
    assert BlockedStep.wanted(slots) and blocked.applies(opt)
    for step in range(3):
        grads = _grads(step, grad_dtype)
        for s, gr in zip(ref_slots, grads):
            s.set_grad(gr)
        assert fused_cpu_step(ref_opt)
        for s in ref_slots:
            s.write_back()
        for s, gr in zip(slots, grads):
            s.set_grad(gr, blocked=True)
            assert s.master.grad is None
        blocked.step(opt)
        for s in slots:
            s.write_back()  # a no-op for the ones the blocked step wrote
            assert s.deferred_grad is None and not s.written_back
    if grad_dtype == torch.float32:
        assert blocked.scratch is None  # nothing to cast: the kernel reads the gradient in place
    else:
        assert blocked.scratch.numel() <= 128
    for a, b in zip(ref_slots, slots):
        assert torch.equal(a.master, b.master) and torch.equal(a.param, b.param), a.name
    sa, sb = ref_opt.state_dict(), opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys() == {0, 1, 2, 3, 4}
    for k, entry in sa["state"].items():
        for key, value in entry.items():
            assert value.dtype == sb["state"][k][key].dtype and torch.equal(value, sb["state"][k][key]), (k, key)


def test_blocks_cover_each_element_once_at_aligned_offsets(small_blocks):
    slots, opt = _slots(torch.bfloat16, torch.optim.AdamW, {})
    for s, gr in zip(slots, _grads(0, torch.bfloat16)):
        s.set_grad(gr, blocked=True)
    step = BlockedStep(slots)
    entries, _ = step._entries(opt, opt.param_groups[1])
    starts = [0] * len(entries)
    for block in step._blocks(entries, step._block_size()):
        assert 0 < sum(pc.size for pc in block) <= B.BLOCK
        for pc in block:
            assert starts[pc.entry] % B.ALIGN == 0 and pc.at % 16 == 0 and pc.at + pc.size <= B.BLOCK
            assert entries[pc.entry].sizes[pc.k] == pc.size
            starts[pc.entry] += pc.size
    assert starts == [e.tensors[0].numel() for e in entries] and len(entries) == 2  # (3, 3) has no gradient


def _train(stage: int, blocked: bool, monkeypatch, hook: bool = False):
    from tests import models

    torch.manual_seed(0)
    model = models.make_odd_mlp(dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage, offload_optimizer="cpu", param_dtype="bf16"))
    if not blocked:
        opt.blocked = None
    if hook:
        opt.inner.register_step_post_hook(lambda *a: None)
    seen = []
    real = torch._fused_adamw_

    def spy(params, grads, *args, **kwargs):
        seen.extend(g.numel() for g in grads)
        return real(params, grads, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    x = torch.randn(16, 7, generator=torch.Generator().manual_seed(3)).bfloat16()
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    monkeypatch.setattr(torch, "_fused_adamw_", real)
    return model, opt, seen


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_takes_the_blocked_step(small_blocks, monkeypatch, stage):
    """bf16 parameters with offload on a CPU-only machine: the engine's step is the blocked one, no kernel
    call sees a gradient over one block, and the training is bitwise the whole-tensor path's."""
    model, opt, seen = _train(stage, True, monkeypatch)
    ref_model, ref_opt, ref_seen = _train(stage, False, monkeypatch)
    assert opt.blocked is not None and max(seen) <= B.BLOCK < max(ref_seen)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    for a, b in zip(opt.engine.slots, ref_opt.engine.slots):
        assert torch.equal(a.master, b.master)
        assert a.master.grad is None and a.deferred_grad is None


def test_steps_aside_when_a_hook_is_registered(small_blocks, monkeypatch):
    """A step hook makes the direct kernel call unsafe: the wrapped optimizer's own step runs (same result)."""
    model, opt, seen = _train(1, True, monkeypatch, hook=True)
    ref_model, _, _ = _train(1, False, monkeypatch)
    assert not opt.blocked.applies(opt.inner) and max(seen) > B.BLOCK
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_steps_aside_for_strided_state(small_blocks):
    """Pieces are flat views: a loaded state tensor that is not contiguous sends the step down the whole path."""
    slots, opt = _slots(torch.bfloat16, torch.optim.AdamW, {})
    step = BlockedStep(slots)
    for s, gr in zip(slots, _grads(0, torch.bfloat16)):
        s.set_grad(gr, blocked=True)
    step.step(opt)
    assert step.applies(opt)
    master = slots[0].master  # (7, 5)
    opt.state[master]["exp_avg"] = opt.state[master]["exp_avg"].t().contiguous().t()
    assert not step.applies(opt)


def test_not_wanted_without_separate_masters():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    _, opt = zp.setup(model, torch.optim.AdamW(model.parameters()), zp.ZeroConfig(stage=2, offload_optimizer="cpu"))
    assert opt.blocked is None  # fp32 parameters are their own masters: nothing to cast, fused_cpu_step runs


def test_waits_for_each_copy_and_writes_back_block_by_block(small_blocks, monkeypatch):
    """The CUDA schedule, traced on the CPU: each master's gradient-copy event is waited for just before its
    first piece is stepped (later copies stay in flight during earlier blocks), and each block is written
    back before the next block's kernel runs (its copy overlaps that step)."""
    trace = []

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            trace.append(("wait", self.name))

    def store(dst, src):
        trace.append(("store", dst.numel()))
        return dst.copy_(src)

    real = torch._fused_adamw_

    def kernel(params, *args, **kwargs):
        trace.append(("kernel", sum(p.numel() for p in params)))
        return real(params, *args, **kwargs)

    slots, opt = _slots(torch.bfloat16, torch.optim.AdamW, {})
    for s, gr in zip(slots, _grads(0, torch.float32)):  # fp32: as the host copies arrive on CUDA
        s.set_grad(gr, blocked=True)
        s.grad_ready = Event(s.name) if gr is not None else None
    monkeypatch.setattr(B, "_copy_into", store)
    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    BlockedStep(slots).step(opt)
    kinds = [k for k, _ in trace]
    kernels = [i for i, k in enumerate(kinds) if k == "kernel"]
    waits = {name: i for i, (k, name) in enumerate(trace) if k == "wait"}
    assert sorted(waits) == ["p0", "p1", "p2", "p3", "p4"] and len(kernels) > 5
    assert waits["p3"] > kernels[0] and waits["p4"] > kernels[1], "later copies are not waited for up front"
    for a, b in zip(kernels, kernels[1:]):  # between two kernels: the first one's stores, then waits only
        between = trace[a + 1 : b]
        stored = sum(n for k, n in between if k == "store")
        assert stored == trace[a][1] and kinds[a + 1 : b] == sorted(kinds[a + 1 : b], key=lambda k: k != "store")
    assert all(s.grad_ready is None and s.written_back for s in slots[:5])


def test_small_masters_are_one_block(monkeypatch):
    """Separate masters of at most SINGLE_BLOCK blocks in all: one kernel call per group, one scratch for all."""
    monkeypatch.setattr(B, "BLOCK", 512)  # SINGLE_BLOCK (4) blocks: 2048 elements; the masters have 1456
    calls = []
    real = torch._fused_adamw_

    def kernel(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    slots, opt = _slots(torch.bfloat16, torch.optim.AdamW, {})
    for s, gr in zip(slots, _grads(0, torch.bfloat16)):
        s.set_grad(gr, blocked=True)
    step = BlockedStep(slots)
    step.step(opt)
    assert calls == [3, 2] and step.block == step.scratch.numel() == 1456


def test_identity_masters_larger_than_the_separate_ones(monkeypatch):
    """An fp32 parameter that is its own master (gradient used in place) next to a small bf16 one: the block
    is sized by the separate masters (here under ALIGN elements), the large one is split and stepped all the
    same, bitwise as the whole-tensor path."""

    def build():
        g = torch.Generator().manual_seed(0)
        own = torch.nn.Parameter(torch.randn(1000, generator=g))
        small = torch.randn(20, generator=g)
        low = torch.nn.Parameter(small.bfloat16())
        slots = [
            MasterParam("own", own, ShardLayout(1000, 1, 0), own, None),
            MasterParam("low", low, ShardLayout(20, 1, 0), low.data, torch.float32, source=small),
        ]
        assert slots[0].is_identity and slots[1].separate
        return slots, torch.optim.AdamW([s.master for s in slots], lr=1e-3, fused=True)

    (ref, ref_opt), (slots, opt) = build(), build()
    g = torch.Generator().manual_seed(5)
    step = BlockedStep(slots)
    for _ in range(2):
        grads = [torch.randn(1000, generator=g), torch.randn(20, generator=g).bfloat16()]
        for s, gr in zip(ref, grads):
            s.param.grad = gr.clone() if s.is_identity else None
            s.set_grad(gr)
        assert fused_cpu_step(ref_opt)
        for s, gr in zip(slots, grads):
            s.param.grad = gr.clone() if s.is_identity else None
            s.set_grad(gr, blocked=True)
        step.step(opt)
        for s in ref + slots:
            s.write_back()
    assert step.block == B.ALIGN
    assert all(torch.equal(a.master, b.master) and torch.equal(a.param, b.param) for a, b in zip(ref, slots))


def test_empty_shard_next_to_others(small_blocks):
    """A rank whose shard of some parameter is empty (world size above its element count): stepped like the
    whole-tensor path does (its step count advances, nothing else)."""

    def build():
        g = torch.Generator().manual_seed(0)
        fulls = [torch.randn(n, generator=g) for n in (0, 300)]
        params = [torch.nn.Parameter(f.bfloat16()) for f in fulls]
        slots = [
            MasterParam(f"p{i}", p, ShardLayout(p.numel(), 1, 0), p.data, torch.float32, source=f)
            for i, (p, f) in enumerate(zip(params, fulls))
        ]
        return slots, torch.optim.AdamW([s.master for s in slots], lr=1e-3, fused=True)

    (ref, ref_opt), (slots, opt) = build(), build()
    grads = [torch.zeros(0, dtype=torch.bfloat16), torch.randn(300).bfloat16()]
    for s, gr in zip(ref, grads):
        s.set_grad(gr)
    assert fused_cpu_step(ref_opt)
    for s, gr in zip(slots, grads):
        s.set_grad(gr, blocked=True)
    BlockedStep(slots).step(opt)
    for s in ref + slots:
        s.write_back()
    assert all(torch.equal(a.param, b.param) for a, b in zip(ref, slots))
    assert [float(opt.state[s.master]["step"]) for s in slots] == [float(ref_opt.state[s.master]["step"]) for s in ref]
