"""Rank-side functions of ``tests/unit/test_dcp_checkpoint.py``: resume FSDP2 / DCP fixtures here, and hand
our checkpoints back to FSDP2."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero_plugin as zp
from tests.fixtures.fsdp import tiny_models as tm
from tests.unit.checkpoint_workers import _rank_world, full_optimizer_state, full_params
from zero_plugin.checkpoint import CheckpointError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "fsdp")
MOMENTS = ("exp_avg", "exp_avg_sq")


def fixture(name: str) -> tuple[str, dict, dict, dict]:
    """The checkpoint folder of a fixture model, its expected.json, the state at the save, after the resume."""
    root = os.path.join(FIXTURES, name)
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    saved = load_file(os.path.join(root, "saved_state.safetensors"))
    resumed = load_file(os.path.join(root, "resumed_state.safetensors"))
    return os.path.join(root, "ckpt"), expected, saved, resumed


def build(name: str, stage: int, offload: bool, seed: int = 1):
    model = tm.build_model(name, seed)
    config = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload else "none")
    return zp.setup(model, tm.build_optimizer(model), config)


def state_of(model, opt) -> tuple[dict[str, torch.Tensor], set]:
    """Full weights and Adam moments, keyed as in the fixtures' state files, and the step counts."""
    params, optim = full_params(model), full_optimizer_state(model, opt)
    out = {f"w/{n}": params[n] for n in optim["state"]}
    for name, entry in optim["state"].items():
        for key in MOMENTS:
            out[f"{key}/{name}"] = entry[key].reshape(params[name].shape)
    return out, {float(entry["step"]) for entry in optim["state"].values()}


def compare(ours: dict, theirs: dict, exact: bool, what: str) -> None:
    assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)} != {sorted(theirs)}"
    for key, value in theirs.items():
        if exact:
            assert torch.equal(ours[key], value), f"{what}: {key} differs by {(ours[key] - value).abs().max()}"
        else:
            torch.testing.assert_close(
                ours[key], value, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{what}: {key}: {m}"
            )


def train(model, opt, steps: range) -> list[float]:
    rank, world = _rank_world()
    losses = []
    for step in steps:
        loss = tm.loss_of(model, tm.batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def resume(name: str, stage: int, offload: bool) -> None:
    """Load an FSDP2 fixture, check the state against FSDP2's at the save, train as its own resumed run did
    and check the losses and the state after it."""
    ckpt, expected, saved, resumed = fixture(name)
    what = f"FSDP2 {name} ({expected['layout']}) -> zero_plugin stage {stage}{' + offload' if offload else ''}"
    model, opt = build(name, stage, offload)
    zp.load_checkpoint(ckpt, model, opt)
    state, steps = state_of(model, opt)
    compare(state, saved, exact=True, what=f"{what}, after loading")
    assert steps == {expected["saved_step"]}, f"{what}: step counts {steps}"
    losses = train(model, opt, range(tm.TRAIN_STEPS, tm.TRAIN_STEPS + tm.RESUMED_STEPS))
    torch.testing.assert_close(losses, expected["resumed_losses"], rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")
    state, steps = state_of(model, opt)
    compare(state, resumed, exact=False, what=f"{what}, after the resumed steps")
    assert steps == {expected["resumed_step"]}, f"{what}: step counts {steps}"


def resume_all(configs: list[tuple[str, int, bool]]) -> None:
    for config in configs:
        resume(*config)


def load_error(name: str, ckpt: str, with_optimizer: bool = True) -> str:
    """The error ``zp.load_checkpoint`` raises on ``ckpt`` (which must fail)."""
    model, opt = build(name, 1, False)
    try:
        zp.load_checkpoint(ckpt, model, opt if with_optimizer else None)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError(f"zp.load_checkpoint({ckpt!r}) did not fail")


def load_model_only(name: str, ckpt: str) -> None:
    """A model-only DCP folder loads with optimizer=None: the weights are FSDP2's at the save."""
    _, _, saved, _ = fixture(name)
    model, _ = build(name, 3, False)
    zp.load_checkpoint(ckpt, model)
    params = full_params(model)
    for key, value in saved.items():
        if key.startswith("w/"):
            assert torch.equal(params[key[2:]], value), key


# -- our checkpoint to FSDP2 ------------------------------------------------------------------
def export_to_fsdp2(root: str, stage: int) -> None:
    """Our run saves after TRAIN_STEPS steps and continues; the checkpoint exported as DCP, FSDP2 (this
    world) resumes from it and its next steps' losses and state equal ours."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    from tests.fixtures.fsdp.make_dcp_ckpt import full_state, sharded
    from zero_plugin.ckpt.consolidate import consolidate

    ours_dir, dcp_dir = os.path.join(root, "zp"), os.path.join(root, "dcp")
    model, opt = build("mlp", stage, False, seed=0)
    train(model, opt, range(tm.TRAIN_STEPS))
    zp.save_checkpoint(ours_dir, model, opt)
    span = range(tm.TRAIN_STEPS, tm.TRAIN_STEPS + tm.RESUMED_STEPS)
    our_losses = train(model, opt, span)
    ours, _ = state_of(model, opt)
    if dist.get_rank() == 0:
        consolidate(ours_dir, dcp_dir, format="dcp")
    dist.barrier()
    fsdp, fsdp_opt = sharded("mlp", seed=1)
    msd, osd = dsd.get_state_dict(fsdp, fsdp_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=dcp_dir)
    dsd.set_state_dict(fsdp, fsdp_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    their_losses = train(fsdp, fsdp_opt, span)
    theirs, step = full_state(fsdp, fsdp_opt)
    torch.testing.assert_close(their_losses, our_losses, rtol=1e-5, atol=0)
    compare(theirs, ours, exact=False, what=f"FSDP2 resumed from our stage-{stage} checkpoint")
    assert step == tm.TRAIN_STEPS + tm.RESUMED_STEPS, step


def export_memory(root: str, layers: int, width: int) -> dict:
    """Save a ``layers`` x (``width`` x ``width``) model with AdamW state, export it as DCP and count the bytes of
    the tensors the export assembles that are alive at once (each one's storage, until it is freed)."""
    import weakref

    from zero_plugin.ckpt import dcp_export
    from zero_plugin.ckpt.consolidate import consolidate

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zp.ZeroConfig(stage=3))
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    zp.save_checkpoint(os.path.join(root, "zp"), model, opt)
    count = {"live": 0, "peak": 0, "assembled": 0}

    def freed(nbytes: int) -> None:
        count["live"] -= nbytes

    def counted(fn):
        def assemble(*args, **kwargs):
            tensor = fn(*args, **kwargs)
            storage = tensor.untyped_storage()
            count["live"] += storage.nbytes()
            count["assembled"] += storage.nbytes()
            count["peak"] = max(count["peak"], count["live"])
            weakref.finalize(storage, freed, storage.nbytes())  # when the last tensor over it is gone
            return tensor

        return assemble

    saved = dcp_export.full_tensor, dcp_export.assemble
    dcp_export.full_tensor, dcp_export.assemble = counted(saved[0]), counted(saved[1])
    try:
        consolidate(os.path.join(root, "zp"), os.path.join(root, "dcp"), format="dcp")
    finally:
        dcp_export.full_tensor, dcp_export.assemble = saved
    return count


def load_tied_saved_once(root: str) -> None:
    """A DCP checkpoint of a model with a tied embedding / head saved under the second name only ([Note: tied names
    in DCP]): the model here, built with another seed, gets every weight and buffer of the writer's."""
    import torch.distributed.checkpoint as dcp

    from tests.fixtures.deepspeed import tiny_model as ds_tm

    path = os.path.join(root, "tied_once")
    writer = ds_tm.build_model(0).state_dict()
    if dist.get_rank() == 0:
        once = {k: v for k, v in writer.items() if k != "embed.weight"}  # head.weight is the same tensor
        dcp.save({"model": once}, checkpoint_id=path, no_dist=True)
    dist.barrier()
    model = ds_tm.build_model(1)
    model, _ = zp.setup(model, ds_tm.build_optimizer(model), zp.ZeroConfig(stage=3))
    zp.load_checkpoint(path, model)
    loaded = zp.full_state_dict(model, rank0_only=False)
    for name, value in writer.items():
        assert torch.equal(loaded[name], value), name
