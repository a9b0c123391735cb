"""[Note: direct fused step]: ``fused_cpu_step`` is ``optimizer.step()`` for fused Adam/AdamW, bitwise, and
steps aside for everything it does not cover."""

from __future__ import annotations

import warnings

import pytest
import torch

from zero_plugin.optim.cpu_step import fused_cpu_step
from zero_plugin.optim.offload import use_fast_cpu_kernels


def _pair(cls, **hyper):
    """Two identical optimizers over identical parameters: two groups, odd shapes, one parameter without
    a gradient."""

    def build():
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (13,), (3, 3), (4,)]]
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
        return params, cls(groups, lr=1e-3, fused=True, **hyper)

    return build(), build()


@pytest.mark.parametrize(
    "cls,hyper",
    [
        (torch.optim.AdamW, {"weight_decay": 0.01}),
        (torch.optim.AdamW, {"amsgrad": True, "maximize": True, "betas": (0.8, 0.99)}),
        (torch.optim.Adam, {"weight_decay": 0.1, "eps": 1e-6}),
    ],
)
def test_bitwise_same_as_step(cls, hyper):
    (pa, oa), (pb, ob) = _pair(cls, **hyper)
    g = torch.Generator().manual_seed(1)
    for _step in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in pa]
        for params in (pa, pb):
            for i, (p, gr) in enumerate(zip(params, grads)):
                p.grad = None if i == 3 else gr.clone()  # the last parameter never gets a gradient
        oa.step()
        assert fused_cpu_step(ob)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys() == {0, 1, 2}
    for k in sa["state"]:
        for key, value in sa["state"][k].items():
            other = sb["state"][k][key]
            assert value.dtype == other.dtype and value.device == other.device and torch.equal(value, other), key


def test_steps_aside_for_what_it_does_not_cover():
    class MyAdamW(torch.optim.AdamW):
        pass

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    assert not fused_cpu_step(MyAdamW([p], fused=True))
    assert not fused_cpu_step(torch.optim.AdamW([p]))  # not fused
    assert not fused_cpu_step(torch.optim.SGD([p], lr=0.1))
    assert not fused_cpu_step(torch.optim.AdamW([p], fused=True, lr=torch.tensor(1e-3)))
    hooked = torch.optim.AdamW([p], fused=True)
    hooked.register_step_post_hook(lambda *a: None)
    assert not fused_cpu_step(hooked)
    patched = torch.optim.AdamW([p], fused=True)
    patched.step = lambda *a, **k: None
    assert not fused_cpu_step(patched)
    assert torch.equal(p, torch.ones(3)), "nothing stepped"


def test_lr_scheduler_sees_the_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], fused=True, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    p.grad = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of lr_scheduler.step() before optimizer.step()"
        assert fused_cpu_step(opt)
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_offloaded_engine_steps_through_it(monkeypatch):
    """With offload the engine's step goes through fused_cpu_step (torch's AdamW.step is never entered), and
    gives what the plain fused step gives."""
    import zero_plugin as zp

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    ref_model, ref_opt = build()
    for group in ref_opt.param_groups:
        group["fused"] = True
    for _ in range(3):
        ref_model(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt = build()
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=1, offload_optimizer="cpu"))

    def refuse(*args, **kwargs):
        raise AssertionError("AdamW.step ran instead of the direct fused step")

    monkeypatch.setattr(torch.optim.AdamW, "step", refuse)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fast_kernels_step_a_parameter_whose_first_gradient_comes_late(momentum):
    """torch's fused SGD needs a momentum buffer for every parameter with a gradient once any has one (a
    parameter first used at step 2 raised ``TypeError: expected Tensor as element 1 in argument 2, but got
    NoneType``, found by the fuzzer with offload and SGD); the switch must leave such an optimizer on a
    kernel that steps it as the user's own would."""
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    fast = torch.optim.SGD(params, lr=0.1, momentum=momentum, dampening=0.1)
    use_fast_cpu_kernels(fast)
    plain = torch.optim.SGD(ref, lr=0.1, momentum=momentum, dampening=0.1)
    for step in range(3):
        for ps, opt in ((params, fast), (ref, plain)):
            for i, p in enumerate(ps):
                p.grad = None if (i == 1 and step == 0) else torch.full_like(p, float(step + i + 1))
            opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-15)
