"""Rank-side functions for ``test_offload.py`` (module-level so the worker pool can pickle them)."""

from __future__ import annotations

import torch

import zero_plugin as zp
from tests import models
from tests.parity import workers as W


def build(kind: str):
    return models.make_odd_mlp(dtype=torch.float32) if kind == "mlp32" else W.build_model(kind)


def train_worker(
    kind: str,
    stage: int,
    offload: bool,
    batches: list,
    steps: int,
    accum: int,
    param_dtype: str | None = None,
    block: int | None = None,
) -> dict:
    """``block``: elements per block of the blocked offload step (0: whole-tensor path instead)."""
    from zero_plugin.optim import blocked_step

    model = build(kind)
    cfg = zp.ZeroConfig(
        stage=stage,
        offload_optimizer="cpu" if offload else "none",
        param_dtype=param_dtype,
        reduce_dtype="fp32" if param_dtype else None,
    )
    model, opt = zp.setup(model, W.build_optimizer(model), cfg)
    defaults = blocked_step.BLOCK, blocked_step.SINGLE_BLOCK
    if block == 0:
        opt.blocked = None
    elif block is not None:
        blocked_step.BLOCK, blocked_step.SINGLE_BLOCK = block, 1  # split even the small test model
    try:
        out = W._train(model, opt, batches, steps, accum, 1.0)
    finally:
        blocked_step.BLOCK, blocked_step.SINGLE_BLOCK = defaults  # the worker process is reused
    out["blocked"] = opt.blocked is not None and opt.blocked.block is not None  # planned at its first step
    out["block"] = opt.blocked.block if opt.blocked is not None else None
    full = zp.full_state_dict(model)
    out["params"] = {k: v.double() for k, v in full.items()}
    optim = opt.consolidate_state_dict()
    out["optim"] = {
        (i, k): v
        for i, e in optim.get("state", {}).items()
        for k, v in e.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }
    out["fused"] = [g.get("fused") for g in opt.param_groups]
    return out


def memory_worker(stage: int, offload: bool, param_dtype: str | None) -> dict:
    """Placement of model states after backward (Adam state exists from a first step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    cfg = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload else "none", param_dtype=param_dtype)
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters()), cfg)
    dtype = cfg.param_dtype or torch.float32
    x = torch.randn(8, 256, dtype=dtype)
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        if _ == 0:
            opt.step()
            opt.zero_grad()
    return zp.memory_report(model, opt)


# How a bf16 run (param_dtype=bf16, reduce_dtype=fp32) accumulates micro-batches, by stage. Stages 1-2: each
# rank accumulates them in its bf16 ``param.grad`` (no_sync), and the fp32 average is kept in fp32
# (grads/reducer.py, [Note: reduced regions and later backwards]). Stage 3 reduces every micro-batch and
# accumulates the fp32 averages in the fp32 shard gradient (stage3/param.py, ``accumulate_grad``).
ACCUMULATION = {1: "local_bf16", 2: "local_bf16", 3: "reduced_fp32"}


def bf16_split_reference(kind: str, batches: list, world: int, steps: int, accum: int, accumulation: str) -> dict:
    """Single process doing what bf16 data parallelism over ``world`` ranks means, rounding where the ranks do.

    Each rank's share of each micro-batch (``models.shard_batch``, the ranks' split and mean-loss
    normalisation) gives a bf16 gradient of ``loss / accum``; the shares' gradients are summed in fp32
    and divided by ``world`` (reduce_dtype=fp32), with the micro-batches accumulated as ``accumulation``
    says (see ``ACCUMULATION``); the global-norm clip at 1.0 and fused AdamW (the offload kernel) step fp32
    masters, which are cast back to the bf16 model. ``world=1`` is one pass over the global batch.

    Call it through a one-rank worker: the ranks run one intra-op thread, and LayerNorm's CPU
    backward splits its weight-gradient sum over threads, so bf16 gradients depend on the count.
    """
    master = build(kind)
    opt = W.build_optimizer(master)
    for group in opt.param_groups:  # as ``use_fast_cpu_kernels`` does for the offloaded run
        group["fused"], group["foreach"] = True, False
    model = build(kind).to(torch.bfloat16)
    losses, norms = [], []
    for step in range(steps):
        micro_batches = batches[step * accum : (step + 1) * accum]
        shares = [_share_grads(model, micro_batches, rank, world, accum) for rank in range(world)]
        losses.append(sum(loss for loss, _ in shares) / world)  # as the test averages the ranks' losses
        grads = _average(accumulation, [g for _, g in shares], world)
        norms.append(_clip_like_engine(grads, 1.0))
        for m, g in zip(master.parameters(), grads):
            m.grad = g.float()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m)
    return {
        "losses": losses,
        "clip_norms": norms,
        "params": {n: p.detach().double() for n, p in master.named_parameters()},
    }


def _share_grads(model, micro_batches: list, rank: int, world: int, accum: int) -> tuple[float, list]:
    """One rank's step loss (as ``W._train`` sums it) and its bf16 gradients, per micro-batch."""
    step_loss, per_micro = 0.0, []
    for micro in micro_batches:
        x, target = models.shard_batch(micro, rank, world)
        value = models.loss_fn(model, (x.to(torch.bfloat16), target))  # inputs cast, target kept (as zp.setup)
        (value / accum).backward()
        step_loss += value.item() / accum
        per_micro.append([p.grad for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return step_loss, per_micro


def _average(accumulation: str, grads: list, world: int) -> list[torch.Tensor]:
    """``grads[rank][micro][i]`` -> the averaged gradient i (fp32)."""
    if accumulation == "reduced_fp32":  # stage 3: average each micro-batch, accumulate the averages in fp32
        return _sum_each([_mean_over_ranks([g[m] for g in grads], world) for m in range(len(grads[0]))])
    local = [_sum_each(per_micro) for per_micro in grads]  # no_sync: each rank accumulates in bf16
    return _mean_over_ranks(local, world)


def _mean_over_ranks(per_rank: list, world: int) -> list[torch.Tensor]:
    """Sum over ranks in fp32, then divide by ``world`` (the engine's fp32 reduce, then ``div_``)."""
    return [t / world for t in _sum_each([[t.float() for t in grads] for grads in per_rank])]


def _sum_each(lists: list) -> list[torch.Tensor]:
    """Elementwise sum of lists of tensors, left to right, in their own dtype."""
    out = [t.clone() for t in lists[0]]
    for ts in lists[1:]:
        out = [a + b for a, b in zip(out, ts)]
    return out


@torch.no_grad()
def _clip_like_engine(grads: list[torch.Tensor], max_norm: float) -> float:
    """As ``zero_plugin/optim/clip.py``: fp64 norm, scaled in the gradients' dtype only when over."""
    total = sum((g.double().norm(2) ** 2 for g in grads), torch.zeros((), dtype=torch.float64)) ** 0.5
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return float(total)
