"""Accelerate / HF Trainer integration in one process, no launcher: ``accelerator.prepare()`` rules,
``ZeroPlugin`` configuration, the Trainer's refusals of unsupported features, and
``integrations/common.py`` checkpoints round-tripping across stages (2 ranks of the worker pool).  The end-to-end launches are in ``test_accelerate.py``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.harness import run_ranks


# -- prepare() rules, configuration, Trainer checks -----------------------------------------------
@pytest.fixture
def accelerator():
    from accelerate.state import AcceleratorState

    import zero_plugin as zp
    from zero_plugin.integrations.accelerate import Accelerator, ZeroPlugin

    AcceleratorState._reset_state(True)
    yield Accelerator(zero_plugin=ZeroPlugin(zp.ZeroConfig(stage=2)))
    AcceleratorState._reset_state(True)


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Linear(15, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_prepare_shards_model_with_its_optimizer(accelerator):
    from accelerate.optimizer import AcceleratedOptimizer

    from zero_plugin import ZeroOptimizer

    model, optimizer = _model_and_optimizer()
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    # Any argument order; a frozen model is only prepared for evaluation.
    opt_p, frozen_p, model_p = accelerator.prepare(optimizer, frozen, model)
    assert model_p is model and frozen_p is frozen
    assert isinstance(opt_p, AcceleratedOptimizer) and isinstance(opt_p.optimizer, ZeroOptimizer)
    loss = model_p(torch.randn(4, 7)).square().mean()
    accelerator.backward(loss)
    norm = accelerator.clip_grad_norm_(model_p.parameters(), 1e-3)
    assert float(norm) > 1e-3
    opt_p.step()
    with pytest.raises(ValueError, match="subset of a sharded model"):
        accelerator.clip_grad_norm_(list(model_p.parameters())[:1], 1.0)
    assert accelerator.get_state_dict(model_p).keys() == model.state_dict().keys()


def test_bf16_autocast_is_kept_at_stage3():
    from accelerate.state import AcceleratorState

    import zero_plugin as zp
    from zero_plugin.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(mixed_precision="bf16", zero_plugin=zp.ZeroConfig(stage=3))
        model, optimizer = accelerator.prepare(*_model_and_optimizer())
        inner = []
        model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
        out = model(torch.randn(4, 7))
        assert inner == [torch.bfloat16] and out.dtype == torch.float32  # autocast inside, fp32 outputs
        accelerator.backward(out.square().mean())
        optimizer.step()
        assert model[0].weight.dtype == torch.float32  # fp32 shards stepped
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("which", ["model", "optimizer", "two_optimizers"])
def test_prepare_refuses_model_without_its_optimizer(accelerator, which):
    model, optimizer = _model_and_optimizer()
    args = {
        "model": (model,),
        "optimizer": (optimizer,),
        "two_optimizers": (model, optimizer, torch.optim.SGD(model.parameters(), lr=0.1)),
    }[which]
    # two optimizers over the same parameters: zp.setup's refusal (disjoint ones are prepared together)
    hint = (
        r"more than one param group or optimizer"
        if which == "two_optimizers"
        else r"accelerator.prepare\(model, optimizer\)"
    )
    with pytest.raises(ValueError, match=hint):
        accelerator.prepare(*args)


def test_zero_plugin_coercion_and_errors(monkeypatch):
    import zero_plugin as zp
    from zero_plugin.integrations.accelerate import ZeroPlugin

    assert ZeroPlugin.coerce({"stage": 3}).config == zp.ZeroConfig(stage=3)
    assert ZeroPlugin.coerce(zp.ZeroConfig(stage=1)).config.stage == 1
    monkeypatch.setenv("ZERO_PLUGIN_STAGE", "0")
    assert ZeroPlugin.coerce(None).config.stage == 0
    with pytest.raises(ValueError, match="ZeroConfig.stage"):
        ZeroPlugin.coerce({"stage": 9})
    with pytest.raises(ValueError, match="must be a ZeroPlugin"):
        ZeroPlugin.coerce(3)


@pytest.mark.parametrize("field,value", [("auto_find_batch_size", True), ("deepspeed", "ds.json")])
def test_trainer_refuses_unsupported_features(field, value):
    from zero_plugin.integrations.hf_trainer import _check_supported

    args = SimpleNamespace(auto_find_batch_size=False, load_best_model_at_end=False, deepspeed=None, fsdp=[])
    setattr(args, field, value)
    with pytest.raises(ValueError, match=f"TrainingArguments.{field}=.* is not supported"):
        _check_supported(args)


def test_trainer_load_best_model_at_end_needs_the_sharded_folder():
    from zero_plugin.integrations.hf_trainer import _check_supported

    args = SimpleNamespace(
        auto_find_batch_size=False, load_best_model_at_end=True, save_only_model=False, deepspeed=None, fsdp=[]
    )
    _check_supported(args)  # supported (tests/integrations/test_trainer_checkpoints.py)
    args.save_only_model = True
    with pytest.raises(ValueError, match="load_best_model_at_end=True with save_only_model=True .*=False"):
        _check_supported(args)


# -- integrations/common.py checkpoints, resharding across stages --------------------------------------------
def _checkpoint_roundtrip(path: str, save_stage: int, load_stage: int) -> float:
    """Train 2 steps at save_stage, save_sharded, load into a fresh model at load_stage; both step once more."""
    import zero_plugin as zp
    from zero_plugin.integrations import common

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    data = [
        torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * s + rank)) for s in range(3)
    ]

    def build(stage):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3)).double()
        return zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zp.ZeroConfig(stage=stage))

    def step(model, optimizer, x):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = build(save_stage)
    for x in data[:2]:
        step(model, optimizer, x)
    common.save_sharded(path, model, optimizer)
    other, other_opt = build(load_stage)
    common.load_sharded(path, other, other_opt)
    step(model, optimizer, data[2])
    step(other, other_opt, data[2])
    a, b = zp.full_state_dict(model, rank0_only=False), zp.full_state_dict(other, rank0_only=False)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("save_stage,load_stage", [(1, 3), (3, 0)])
def test_common_checkpoint_roundtrip_reshards(tmp_path, save_stage, load_stage):
    path = str(tmp_path / "ckpt")
    errors = run_ranks(2, _checkpoint_roundtrip, path, save_stage, load_stage)
    assert max(errors) < 1e-10, errors
    from zero_plugin.ckpt.format import COMPLETE

    assert os.path.isfile(os.path.join(path, COMPLETE))  # zp.save_checkpoint's sharded folder


def test_stage3_evaluation_mode_shards_then_prepare_with_optimizer_trains():
    """``prepare_model(m, evaluation_mode=True)`` at stage 3 shards for evaluation only ([Note: evaluation-only
    models]); the Trainer does that in ``evaluate()`` before ``train()``, which then prepares the same model with
    its optimizer: it must train exactly as plain torch."""
    import copy

    from accelerate.state import AcceleratorState

    import zero_plugin as zp
    from zero_plugin.integrations import common
    from zero_plugin.integrations.accelerate import Accelerator

    model, _ = _model_and_optimizer()
    model = model.double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 7, dtype=torch.float64)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(zero_plugin=zp.ZeroConfig(stage=3))
        prepared = accelerator.prepare_model(model, evaluation_mode=True)
        assert prepared is model and common.is_set_up(model)
        assert model[0].weight.shape == (7 * 15,)  # a 1-D shard between forwards (world size 1: all of it)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        loss = model(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        assert float(loss.detach()) == float(ref_loss.detach())
        state = accelerator.get_state_dict(model)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-12)
    finally:
        AcceleratorState._reset_state(True)
