"""Rank-side functions of ``tests/unit/test_deepspeed_checkpoint.py``: resume a DeepSpeed fixture here."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero_plugin as zp
from tests.fixtures.deepspeed import tiny_model as tm
from tests.unit.checkpoint_workers import _rank_world, full_optimizer_state, full_params
from zero_plugin.checkpoint import CheckpointError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed")
MOMENTS = ("exp_avg", "exp_avg_sq")


def fixture(variant: int | str) -> tuple[str, dict, dict, dict]:
    """The checkpoint folder of a DeepSpeed stage (``1`` or ``"1_bf16"``), its expected.json, the state at the
    save and after DeepSpeed's resumed run."""
    root = os.path.join(FIXTURES, f"stage{variant}")
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    saved = load_file(os.path.join(root, "saved_state.safetensors"))
    resumed = load_file(os.path.join(root, "resumed_state.safetensors"))
    return os.path.join(root, "ckpt"), expected, saved, resumed


def build(zp_stage: int, offload: bool, seed: int = 1, param_dtype: str | None = None, writer_base: bool = False):
    """``writer_base``: the frozen parameter as the writer had it (a pretrained base a PEFT checkpoint leaves out)."""
    model = tm.build_model(seed)
    if writer_base:
        model.pos.data.copy_(tm.build_model(0).pos)
    config = zp.ZeroConfig(stage=zp_stage, offload_optimizer="cpu" if offload else "none", param_dtype=param_dtype)
    return zp.setup(model, tm.build_optimizer(model), config)


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Full weights and Adam moments, keyed as in the fixtures' state files, and the step counts."""
    params, optim = full_params(model), full_optimizer_state(model, opt)
    out = {f"w/{n}": params[n] for n in optim["state"]}
    for name, entry in optim["state"].items():
        for key in MOMENTS:
            out[f"{key}/{name}"] = entry[key].reshape(params[name].shape)
    steps = {float(entry["step"]) for entry in optim["state"].values()}
    return out, steps


def _compare(ours: dict, theirs: dict, exact: bool, what: str) -> None:
    assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)} != {sorted(theirs)}"
    for key, value in theirs.items():
        if exact:
            assert torch.equal(ours[key], value), f"{what}: {key} differs by {(ours[key] - value).abs().max()}"
        else:
            torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{what}: {k}: {m}")


def _mean_loss(model, step: int) -> float:
    rank, world = _rank_world()
    loss = model(tm.batch(step, rank, world))
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    return loss, total.item() / world


def resume(variant: int | str, zp_stage: int, offload: bool) -> dict:
    """Load a DeepSpeed fixture, check the state against DeepSpeed's at the save, train as DeepSpeed's own
    resumed run did and check the losses and the state after it.  A bf16 run is resumed in bf16 with fp32
    masters: the masters and Adam state load exactly, the losses agree to bf16's resolution (8 bits)."""
    ckpt, expected, saved, resumed = fixture(variant)
    bf16, no_frozen = str(variant).endswith("_bf16"), str(variant).endswith("_no_frozen")
    what = f"DeepSpeed stage {variant} -> zero_plugin stage {zp_stage}{' + offload' if offload else ''}"
    model, opt = build(zp_stage, offload, param_dtype="bf16" if bf16 else None, writer_base=no_frozen)
    base = full_params(model)["pos"]
    extra = zp.load_checkpoint(ckpt, model, opt)
    if no_frozen:
        assert torch.equal(full_params(model)["pos"], base), f"{what}: the frozen base changed"
    state, steps = _state(model, opt)
    _compare(state, saved, exact=True, what=f"{what}, after loading")
    assert steps == {expected["saved_step"]}, f"{what}: step counts {steps}"
    losses = []
    for step in range(tm.TRAIN_STEPS, tm.TRAIN_STEPS + tm.RESUMED_STEPS):
        loss, mean = _mean_loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean)
    rtol = 2**-7 if bf16 else 1e-5
    torch.testing.assert_close(losses, expected["resumed_losses"], rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")
    state, steps = _state(model, opt)
    if not bf16:  # bf16 forward passes differ in rounding from DeepSpeed's, and Adam amplifies it
        _compare(state, resumed, exact=False, what=f"{what}, after the resumed steps")
    assert steps == {expected["resumed_step"]}, f"{what}: step counts {steps}"
    return extra


def resume_all(configs: list[tuple[int, int, bool]]) -> list:
    return [resume(*config) for config in configs]


def load_error(ckpt: str, marker: str) -> str:
    """The error ``zp.load_checkpoint`` raises on ``ckpt`` (which must fail); the marker must not appear."""
    model, opt = build(1, False)
    try:
        zp.load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"zp.load_checkpoint({ckpt!r}) did not fail")
    assert not os.path.exists(marker), "the planted payload ran"
    return message


def sgd_load_error(ckpt: str) -> str:
    """Adam state from DeepSpeed into an SGD: refused before anything changes."""
    model = tm.build_model(1)
    model, opt = zp.setup(model, torch.optim.SGD(tm.param_groups(model), lr=0.1), zp.ZeroConfig(stage=1))
    try:
        zp.load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("an SGD took DeepSpeed's Adam state")


def load_model_only(variant: int | str, zp_stage: int) -> None:
    """``zp.load_checkpoint(path, model)``: the fp32 masters of a DeepSpeed checkpoint, no optimizer state."""
    ckpt, _expected, saved, _resumed = fixture(variant)
    model, opt = build(zp_stage, False)
    zp.load_checkpoint(ckpt, model)
    params = full_params(model)
    for key, value in saved.items():
        if key.startswith("w/"):
            assert torch.equal(params[key[2:]], value), key
    assert not opt.inner.state, "the optimizer took state from a model-only load"


def accelerate_resume(state_dir: str, zp_stage: int) -> tuple[list[float], list[float]]:
    """``accelerator.load_state`` of what Accelerate's ``save_state`` wrote under DeepSpeed, in zero_plugin's
    Accelerator (the loop of ``make_accelerate_ckpt.py``); the losses and learning rates of the next steps."""
    from accelerate.state import AcceleratorState

    from tests.fixtures.deepspeed import make_accelerate_ckpt as fx
    from zero_plugin.integrations.accelerate import Accelerator

    rank, world = _rank_world()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, zero_plugin=zp.ZeroConfig(stage=zp_stage))
    model = tm.build_model(1)
    optimizer = tm.build_optimizer(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, fx.schedule(optimizer))
    accelerator.load_state(state_dir)
    steps = range(tm.TRAIN_STEPS, tm.TRAIN_STEPS + tm.RESUMED_STEPS)
    result = fx.train(accelerator, model, optimizer, scheduler, steps)
    AcceleratorState._reset_state(True)
    return result


def resume_fp16(variant: str, zp_stage: int, offload: bool) -> dict:
    """An fp16 run with DeepSpeed's dynamic loss scaler, resumed here in fp16 with fp32 masters and the same growth
    interval: masters and Adam state load exactly, the loss scale is DeepSpeed's at the save and, after the two
    resumed steps (where DeepSpeed grew it), DeepSpeed's again; the losses agree to fp16's resolution."""
    ckpt, expected, saved, _ = fixture(variant)
    scaler = expected["loss_scaler"]
    model = tm.build_model(1)
    config = zp.ZeroConfig(
        stage=zp_stage, offload_optimizer="cpu" if offload else "none", param_dtype="fp16",
        loss_scale_growth_interval=scaler["saved"]["scale_window"],
    )  # fmt: skip
    model, opt = zp.setup(model, tm.build_optimizer(model), config)
    zp.load_checkpoint(ckpt, model, opt)
    state, steps = _state(model, opt)
    _compare(state, saved, exact=True, what=f"{variant} -> stage {zp_stage}, after loading")
    out = {"scale_at_load": opt.guard.scale, "losses": []}
    for step in range(tm.TRAIN_STEPS, tm.TRAIN_STEPS + tm.RESUMED_STEPS):
        loss, mean = _mean_loss(model, step)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(mean)
    out["scale_after"], out["skipped"] = opt.guard.scale, opt.guard.skipped_steps
    out["steps"] = _state(model, opt)[1]
    return out
