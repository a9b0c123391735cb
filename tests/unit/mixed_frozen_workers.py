"""Rank-side functions for ``test_mixed_frozen.py``: frozen parameters under mixed precision, parameters
frozen or unfrozen after setup, edits through ``zp.gathered_parameters`` with bf16 parameters and fp32
masters, and autograd through gathered stage-3 parameters.

Module-level so the worker pool pickles them by reference; each returns plain Python or CPU tensors and
builds its own single-process reference from the same seeded model.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_plugin as zp
from tests import models
from tests.parity import workers as W
from zero_plugin.engines.engine import engine_of


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _full(model) -> dict:
    """Every rank: the full parameters in their stored precision (fp32 masters where there are some)."""
    full = zp.full_state_dict(model, rank0_only=False)
    return {n: full[n].clone() for n, _ in model.named_parameters()}


def _step(model, opt, batch, loss=models.loss_fn, shard: bool = True) -> float:
    rank, world = _rank_world() if shard else (0, 1)
    value = loss(model, models.shard_batch(batch, rank, world))
    value.backward()
    opt.step()
    opt.zero_grad()
    return value.item()


# ---------------------------------------------------------------------------------------------- item 3


def lora_bf16_worker(stage: int, steps: int = 2) -> dict:
    """LoRA (frozen base, trainable adapters) with param_dtype=bf16: frozen params and buffers end up in the
    dtypes stage 3 gives them, and the adapters train like fp32 single-process training (bf16 tolerance)."""
    rank, world = _rank_world()
    batches = models.make_batches("llama", steps, world, per_rank_batch=2, seed=21)
    model = W.build_model("lora")
    model, opt = zp.setup(model, W.build_optimizer(model), zp.ZeroConfig(stage=stage, param_dtype="bf16"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {
        "frozen_dtypes": {n: str(p.dtype) for n, p in model.named_parameters() if n not in trainable},
        "buffer_dtypes": {n: str(b.dtype) for n, b in model.named_buffers()},
    }
    out["losses"] = [_step(model, opt, b) for b in batches]
    got = {n: v.double() for n, v in _full(model).items()}
    ref_model = W.build_model("lora")
    ref_opt = W.build_optimizer(ref_model)
    ref_losses = [_step(ref_model, ref_opt, b, shard=False) for b in batches]
    init = {n: p.detach().double() for n, p in W.build_model("lora").named_parameters() if n in trainable}
    ref = {n: p.detach().double() for n, p in ref_model.named_parameters() if n in trainable}
    out["update_norm_error"] = models.update_norm_error({n: got[n] for n in ref}, ref, init)
    out["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(_mean_over_ranks(out["losses"]), ref_losses))
    out["n_trainable"] = len(trainable)
    return out


def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ---------------------------------------------------------------------------------------------- item 4


def unfreeze_worker(stage: int) -> dict:
    """``blocks.0`` frozen at setup, one step, then unfrozen: an eval forward still works, a training
    forward/backward must raise zero_plugin's error on every rank (never train silently without it)."""
    rank, world = _rank_world()
    batches = models.make_batches("mlp", 3, world, per_rank_batch=2, seed=22)
    model = W.build_model("mlp_frozen")
    model, opt = zp.setup(model, W.build_optimizer(model), zp.ZeroConfig(stage=stage))
    _step(model, opt, batches[0])
    model.blocks[0].requires_grad_(True)
    out = {}
    with torch.no_grad():  # no gradient wanted: nothing to refuse
        model(models.shard_batch(batches[1], rank, world)[0])
    try:
        _step(model, opt, batches[1])
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def freeze_later_worker(stage: int) -> dict:
    """``blocks.1`` trainable at setup and frozen after two steps: training goes on exactly as single-process
    training that freezes it at the same point (no gradient, no step, no weight decay for it)."""
    rank, world = _rank_world()
    batches = models.make_batches("mlp", 4, world, per_rank_batch=2, seed=23)

    def run(model, opt, shard):
        for i, batch in enumerate(batches):
            if i == 2:
                model.blocks[1].requires_grad_(False)
            _step(model, opt, batch, shard=shard)

    model = W.build_model("mlp")
    model, opt = zp.setup(model, W.build_optimizer(model), zp.ZeroConfig(stage=stage))
    run(model, opt, True)
    ref_model = W.build_model("mlp")
    ref_opt = W.build_optimizer(ref_model)
    mid = None
    for i, batch in enumerate(batches):
        if i == 2:
            ref_model.blocks[1].requires_grad_(False)
            mid = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
        _step(ref_model, ref_opt, batch, shard=False)
    want = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    got = _full(model)
    frozen = [n for n in want if n.startswith("blocks.1.")]
    return {
        "max_abs_diff": models.max_abs_diff(got, want),
        "frozen_moved_in_ref": max((want[n] - mid[n]).abs().max().item() for n in frozen),
        "moved": models.max_abs_diff(want, mid),
    }


# ---------------------------------------------------------------------------------------------- item 8

EDITED = "blocks.1.fc.weight"
EDIT_AT = (2, 3)
EDIT_VALUE = 0.5  # exact in bf16


@contextlib.contextmanager
def _separate_host_masters():
    """Stage 3 with offload keeps a separate fp32 master on the host only where the device is not the host
    (CUDA); on this CPU-only machine make it believe the host is another device, so the CPU runs the layout
    a GPU run has: bf16 shards, fp32 masters beside them."""
    from zero_plugin.optim.offload import HOST
    from zero_plugin.stage3 import engine as s3

    original = s3.host_for
    s3.host_for = lambda device: HOST
    try:
        yield
    finally:
        s3.host_for = original  # the worker process is reused


def gathered_edit_worker(stage: int, host_masters: bool = False) -> dict:
    """bf16 parameters, fp32 masters: one step, then rank 0 edits one element inside
    ``gathered_parameters(modifier_rank=0)`` (other ranks edit something else, which must be discarded).
    The masters must be unchanged bit for bit except the edited element, which must hold the edit."""
    rank, world = _rank_world()
    batches = models.make_batches("mlp", 2, world, per_rank_batch=2, seed=24, dtype=torch.float32)
    offload = "cpu" if host_masters else "none"
    with _separate_host_masters() if host_masters else contextlib.nullcontext():
        model = models.make_odd_mlp(dtype=torch.float32)
        config = zp.ZeroConfig(stage=stage, param_dtype="bf16", offload_optimizer=offload)
        model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    engine = engine_of(model, "test")
    out = {
        "separate_masters": sum(
            not s.is_identity and s.master.dtype != s.param.dtype for s in engine.slots if s.master.numel()
        )
    }
    _step(model, opt, batches[0])
    before = _full(model)
    with zp.gathered_parameters(model, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                dict(model.named_parameters())[EDITED][EDIT_AT] = EDIT_VALUE
            else:
                model.head.weight.mul_(2.0)
    after = _full(model)
    want = {n: v.clone() for n, v in before.items()}
    want[EDITED][EDIT_AT] = EDIT_VALUE
    out["changed"] = {n: int((after[n] != want[n]).sum()) for n in want if not torch.equal(after[n], want[n])}
    out["max_error"] = models.max_abs_diff(after, want)
    out["master_dtypes"] = sorted({str(v.dtype) for v in after.values()})
    # The edit is what the next step starts from (it reached the masters the optimizer steps).
    _step(model, opt, batches[1])
    out["edit_after_step"] = _full(model)[EDITED][EDIT_AT].item()
    return out


# ---------------------------------------------------------------------------------------------- E1

REG = 0.1


def _reg_loss(model, batch, where: str):
    """MSE plus ``REG * |blocks.0.fc.weight|^2``, the weight used outside its unit's forward."""
    x, target = batch
    w = model.blocks[0].fc.weight
    gathered = zp.gathered_parameters([w], model=model) if where.startswith("gathered") else contextlib.nullcontext()
    if where.endswith("before"):
        with gathered:
            reg = REG * w.pow(2).sum()
        return F.mse_loss(model(x), target) + reg
    loss = F.mse_loss(model(x), target)
    with gathered:
        return loss + REG * w.pow(2).sum()


def regulariser_worker(stage: int, where: str, steps: int = 3) -> dict:
    """A parameter used outside its unit's forward: inside ``zp.gathered_parameters`` (before or after the
    forward) it trains like single-process training; without it, stage 3 must raise zero_plugin's error."""
    rank, world = _rank_world()
    batches = models.make_batches("mlp", steps, world, per_rank_batch=2, seed=25)
    model = W.build_model("mlp")
    model, opt = zp.setup(model, W.build_optimizer(model), zp.ZeroConfig(stage=stage))
    out = {"error": None}
    try:
        for batch in batches:
            _step(model, opt, batch, loss=lambda m, b: _reg_loss(m, b, where))
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    ref_model = W.build_model("mlp")
    ref_opt = W.build_optimizer(ref_model)
    for batch in batches:
        _step(ref_model, ref_opt, batch, loss=lambda m, b: _reg_loss(m, b, "plain"), shard=False)
    want = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    out["max_abs_diff"] = models.max_abs_diff(_full(model), want)
    out["moved"] = models.max_abs_diff(want, {n: p.detach() for n, p in W.build_model("mlp").named_parameters()})
    return out


# ------------------------------------------------------------------------- host masters keep the model's dtype


@contextlib.contextmanager
def _separate_host_masters_every_stage():
    """``_separate_host_masters`` for the replicated engines (stages 0-2) as well as stage 3."""
    from zero_plugin.engines import replicated
    from zero_plugin.optim.offload import HOST

    original = replicated.host_for
    replicated.host_for = lambda device: HOST
    try:
        with _separate_host_masters():
            yield
    finally:
        replicated.host_for = original


def float64_host_master_worker(stage: int) -> dict:
    """A float64 model, no ``param_dtype``, ``offload_optimizer="cpu"`` with the masters on a host distinct
    from the device (the GPU layout): three steps must match single-process float64 training.  The masters
    must stay float64: an fp32 host master rounds every update to ~1e-7 (the H200 run of 2026-12-04 found
    stage 3 doing so)."""
    rank, world = _rank_world()
    batches = models.make_batches("mlp", 3, world, per_rank_batch=2, seed=31)
    ref = models.make_odd_mlp()
    ref_opt = models.two_group_adamw(ref)
    for batch in batches:
        _step(ref, ref_opt, batch, shard=False)
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with _separate_host_masters_every_stage():
        model = models.make_odd_mlp()
        config = zp.ZeroConfig(stage=stage, offload_optimizer="cpu")
        model, opt = zp.setup(model, models.two_group_adamw(model), config)
    engine = engine_of(model, "test")
    masters = sorted({str(s.master.dtype) for s in engine.slots if s.master.numel()})
    for batch in batches:
        _step(model, opt, batch)
    return {"master_dtypes": masters, "max_abs_diff": models.max_abs_diff(_full(model), want)}
