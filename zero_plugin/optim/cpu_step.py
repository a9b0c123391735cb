"""The offload optimizer's CPU step: torch's fused Adam/AdamW kernel, called directly.

[Note: direct fused step]
With offload the CPU step runs torch's fused kernel (``use_fast_cpu_kernels`` in ``offload.py``).
Measured with ``benchmarks/cpu_adam.py``, the kernel itself is as fast as DeepSpeed's
``DeepSpeedCPUAdam`` (both memory-bound from ~10M parameters), but ``AdamW.step()`` spends about
0.2 ms per call in Python around it (the profiler range, the grad-mode wrapper, grouping the tensors
by device and dtype, dispatch through the functional API): a quarter of a 1M-parameter step, a few
percent at 10M.  For the exact classes ``torch.optim.Adam`` and ``AdamW`` with nothing hooked into
their step, :func:`fused_cpu_step` issues the same kernel with the same arguments and creates missing
state exactly as torch's ``_init_group`` does (a 0-dim float32 ``step`` on the parameter's device,
``zeros_like`` moments), so the result is bitwise the same and the state dict identical.  Anything it
does not cover -- subclasses, step hooks, another patched ``step``, capturable, differentiable, tensor
hyper-parameters, non-CPU or complex parameters, sparse gradients -- returns False and the caller
runs ``optimizer.step()``.
"""
from __future__ import annotations

import torch
from torch.optim import optimizer as _optimizer_module

__all__ = ["fused_cpu_step"]

_COVERED = (torch.optim.Adam, torch.optim.AdamW)


def fused_cpu_step(optimizer: torch.optim.Optimizer) -> bool:
    """Step ``optimizer`` with one fused-kernel call per param group; False (and nothing done) if not covered."""
    if not _covered(optimizer):
        return False
    # What the LR scheduler's wrapper of ``step`` records, so it does not warn that the optimizer never stepped.
    optimizer._opt_called = True   # type: ignore[attr-defined]
    with torch.no_grad():
        for group in optimizer.param_groups:
            _step_group(optimizer, group)
    return True


def _covered(opt: torch.optim.Optimizer) -> bool:
    if type(opt) not in _COVERED:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if _optimizer_module._global_optimizer_pre_hooks or _optimizer_module._global_optimizer_post_hooks:
        return False
    patched = vars(opt).get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        return False
    for group in opt.param_groups:
        if not group.get("fused") or group.get("capturable") or group.get("differentiable"):
            return False
        if any(isinstance(group.get(k), torch.Tensor) for k in ("lr", "weight_decay", "eps")):
            return False
        if any(isinstance(b, torch.Tensor) for b in group["betas"]):
            return False
        for p in group["params"]:
            if p.device.type != "cpu" or p.is_complex() or (p.grad is not None and p.grad.is_sparse):
                return False
    return True


def _step_group(opt: torch.optim.Optimizer, group: dict) -> None:
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    amsgrad = group["amsgrad"]
    for p in group["params"]:
        if p.grad is None:
            continue
        state = opt.state[p]
        if not state:   # as torch's Adam._init_group creates it for fused=True
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    decoupled = group.get("decoupled_weight_decay", type(opt) is torch.optim.AdamW)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    torch._foreach_add_(steps, 1)
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=amsgrad, lr=group["lr"],
           beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
           maximize=group["maximize"], grad_scale=None, found_inf=None)
