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
runs ``optimizer.step()``.  ``blocked_step.py`` runs the same kernel block by block for fp32 masters
of lower-precision parameters ([Note: cache-blocked offload step]).
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as _optimizer_module

__all__ = ["fused_cpu_step", "covered", "group_state", "state_lists", "run_kernel"]

_COVERED = (torch.optim.Adam, torch.optim.AdamW)


def fused_cpu_step(optimizer: torch.optim.Optimizer) -> bool:
    """Step ``optimizer`` with one fused-kernel call per param group; False (and nothing done) if not covered."""
    if not covered(optimizer):
        return False
    # What the LR scheduler's wrapper of ``step`` records, so it does not warn that the optimizer never stepped.
    optimizer._opt_called = True  # type: ignore[attr-defined]
    with torch.no_grad():
        for group in optimizer.param_groups:
            _step_group(optimizer, group)
    return True


def covered(opt: torch.optim.Optimizer) -> bool:
    """True when :func:`fused_cpu_step` (or the blocked step built on it) may replace ``opt.step()``."""
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
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    states = group_state(opt, group, params)
    run_kernel(opt, group, params, [p.grad for p in params], *state_lists(group, states))


def group_state(opt: torch.optim.Optimizer, group: dict, params: list[torch.Tensor]) -> list[dict]:
    """The state of each of ``params`` (created as torch's ``Adam._init_group`` creates it for fused=True),
    its ``step`` already advanced by one for the step about to run."""
    states = []
    for p in params:
        state = opt.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states.append(state)
    torch._foreach_add_([s["step"] for s in states], 1)
    return states


def state_lists(group: dict, states: list[dict]) -> tuple[list, list, list, list]:
    """exp_avgs, exp_avg_sqs, max_exp_avg_sqs (empty without amsgrad) and steps, in the kernel's order."""
    maxes = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
    return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], maxes, [s["step"] for s in states]


def run_kernel(
    opt: torch.optim.Optimizer,
    group: dict,
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    max_exp_avg_sqs: list,
    steps: list,
) -> None:
    """One fused-kernel call with ``group``'s hyper-parameters; the state lists match ``params`` element for
    element (whole tensors, or the same slice of each as the parameter view)."""
    beta1, beta2 = group["betas"]
    decoupled = group.get("decoupled_weight_decay", type(opt) is torch.optim.AdamW)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        amsgrad=group["amsgrad"],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        grad_scale=None,
        found_inf=None,
    )
