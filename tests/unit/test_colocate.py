"""``zp.offload_states`` / ``zp.reload_states`` (vLLM colocate mode, [Note: parked states] in
zero_plugin/engines/state_offload.py), on 2 gloo ranks with the real-shaped Llama (untied 4096 x 256 head: a
stage-3 leaf unit).

On this CPU-only machine the device is the host, so what is checked is the mechanism: every device storage
of the offloaded categories is 0 bytes while offloaded, memory_report's device bytes for them go to 0 and its
host bytes hold them, the values come back bit for bit, and training then continues bit-identical to a run
that never offloaded (losses, parameters, optimizer state).  Offloads happen mid-accumulation (gradients held)
and between steps (optimizer state, no gradients).  The CUDA side (pinned copies, device memory freed) is
tests/gpu/colocate.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zero_plugin as zp
from tests import models
from tests.harness import run_ranks
from tests.unit import colocate_workers as CW

STEPS, ACCUM, WORLD = 3, 2, 2
CONFIGS = {  # name -> (stage, offload_optimizer)
    "stage0": (0, False),
    "stage1": (1, False),
    "stage2": (2, False),
    "stage3": (3, False),
    "stage3_offload_optimizer": (3, True),
}


@functools.cache
def _run(name: str, cycles: bool, include: tuple | None = None) -> dict:
    stage, offload = CONFIGS[name]
    batches = models.make_batches("llama", STEPS * ACCUM, WORLD, 2)
    return run_ranks(WORLD, CW.train_worker, "real_llama", stage, offload, batches, STEPS, ACCUM, cycles, include)[0]


def _device(placement: dict, category: str) -> float:
    return placement["device"].get(category, 0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_reload_frees_device_and_training_continues_bit_identical(name):
    with_cycles, plain = _run(name, True), _run(name, False)
    assert with_cycles["losses"] == plain["losses"]
    assert with_cycles["params"].keys() == plain["params"].keys()
    for key, value in plain["params"].items():
        assert torch.equal(with_cycles["params"][key], value), key
    for index, entry in plain["optim"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(with_cycles["optim"][index][key]), torch.as_tensor(value)), (index, key)
    offload_optimizer = CONFIGS[name][1]
    for when, record in with_cycles["records"].items():
        before, during, after = record["placement"]
        assert record["bit_identical"], when
        assert record["emptied"] > 0
        moved = record["summary"]["moved"]
        for category in ("params", "grads", "optimizer"):
            if offload_optimizer and category == "optimizer":  # already on the host: a no-op
                assert moved[category] == 0 and record["summary"]["already_on_host"][category] > 0
                assert during["host"][category] == before["host"][category]
                continue
            assert moved[category] == _device(before, category), (when, category)
            assert _device(during, category) == 0, (when, category)
            assert during["host"].get(category, 0) == before["host"].get(category, 0) + moved[category]
            assert _device(after, category) == _device(before, category)
        assert during["device"]["total"] == 0
        assert record["measured"][0] == record["measured"][1] == record["measured"][2]  # bytes held, moved
        assert record["moved_back"] == moved
    gradients = with_cycles["records"]["mid_accumulation"]["summary"]["moved"]["grads"]
    assert gradients > 0
    assert with_cycles["records"]["mid_accumulation"]["refused"] == [
        "forward",
        "step",
        "zero_grad",
        "model.zero_grad",
        "clip",
        "state_dict",
        "full_state_dict",
        "offload twice",
    ]


def test_include_moves_only_the_named_categories():
    """DeepSpeed's names are accepted: ``optim_states`` is our optimizer category (masters included)."""
    record = _run("stage2", True, ("optim_states",))["records"]["mid_accumulation"]
    before, during, _ = record["placement"]
    assert record["summary"]["moved"] == {"optimizer": _device(before, "optimizer")}
    assert _device(during, "optimizer") == 0
    assert _device(during, "params") == _device(before, "params") > 0
    assert _device(during, "grads") == _device(before, "grads") > 0
    assert record["bit_identical"]


def test_include_rejects_unknown_names():
    with pytest.raises(ValueError, match="include must name params, grads, optimizer"):
        zp.colocate._categories(["weights"])


def test_verbs_need_a_set_up_model():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="was not prepared by zp.setup"):
        zp.offload_states(model)
    with pytest.raises(ValueError, match="was not prepared by zp.setup"):
        zp.reload_states(model)


def test_evaluation_only_model_at_stage3():
    """TRL's reference / reward models (zp.setup(model, None, config)) offload their shards too.  (At stages 0-2
    such a model stays a plain replicated module with no engine, and offload_states refuses it.)"""
    batch = models.make_batches("llama", 1, WORLD, 2)[0]
    for rank in run_ranks(WORLD, CW.evaluation_only_worker, 3, batch):
        assert rank["summary"]["moved"]["params"] > 0 and rank["device"] == 0
        assert rank["refused"] and rank["same"]
