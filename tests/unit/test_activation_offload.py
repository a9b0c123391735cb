"""Activation offload ([Note: activation offload] in zero_plugin/sequence/offload.py), one process, on a float64 Llama
with every layer checkpointed: the hooks pack exactly each layer's input (the bytes the planner predicts, both
checkpoint flavours), the copying path lets the originals go by the end of forward (without offload the checkpoint
keeps them: the check fails there), gradients are bit-identical to checkpointing without offload, and the setting's
refusals.  On CUDA (skipped here): the parked copies are pinned host tensors and the device holds one layer input,
not all of them, at the end of forward.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zero_plugin as zp
from tests.models import llama_config
from zero_plugin.planner.long_context import checkpointed_input_bytes
from zero_plugin.sequence import offload as activation_offload

LAYERS, BATCH, SEQ, HIDDEN = 3, 2, 12, 32


def _model(reentrant: bool = False, device: str = "cpu"):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(61, HIDDEN, layers=LAYERS)).double().to(device)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 61, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)


def _layer_inputs(model) -> list:
    """Weak references to each decoder layer's input, filled by forward pre-hooks."""
    seen: list = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    return seen


@pytest.mark.parametrize("reentrant", [False, True])
def test_packs_each_layer_input_once_and_lets_the_originals_go(reentrant):
    model = _model(reentrant)
    offload = activation_offload.enable(model, "cpu", copy=True)
    seen = _layer_inputs(model)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    gc.collect()
    expected = checkpointed_input_bytes(model.config, batch=BATCH, seq=SEQ, dtype=torch.float64)
    assert expected == LAYERS * BATCH * SEQ * HIDDEN * 8
    assert offload.stats.packed_tensors == LAYERS and offload.stats.packed_bytes == expected
    assert offload.stats.host_bytes == expected
    assert len(seen) == LAYERS and all(ref() is None for ref in seen), "a layer input is still referenced"
    loss.backward()
    assert offload.stats.unpacked_bytes == expected and offload.stats.host_bytes == 0
    assert offload.stats.host_peak_bytes == expected


def test_without_offload_the_checkpoint_keeps_the_inputs():
    """The control of the test above: what offload has to move is really held by the checkpoint."""
    model = _model()
    seen = _layer_inputs(model)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    gc.collect()
    assert len(seen) == LAYERS and all(ref() is not None for ref in seen)
    del loss


@pytest.mark.parametrize("copy", [False, True])
def test_gradients_bit_identical_to_checkpointing_alone(copy):
    grads = []
    for offloaded in (False, True):
        model = _model()
        if offloaded:
            activation_offload.enable(model, "cpu", copy=copy)
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_refusals_and_rewrap():
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(llama_config(61, HIDDEN, layers=1))
    with pytest.raises(ValueError, match="no module of LlamaForCausalLM checkpoints"):
        activation_offload.enable(plain, "cpu")
    own = LlamaForCausalLM(llama_config(61, HIDDEN, layers=1))
    own.activation_checkpointing_enable(offload=True)
    with pytest.raises(ValueError, match="offload=True"):
        activation_offload.enable(own, "cpu")
    assert activation_offload.enable(plain, "none") is None
    model = _model()
    offload = activation_offload.enable(model, "cpu")
    model.activation_checkpointing_enable()  # after setup: the forward wraps the new function again
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    assert offload.stats.packed_tensors == LAYERS


def test_config_setting():
    assert zp.ZeroConfig().offload_activations == "none"
    assert zp.ZeroConfig(offload_activations=True).offload_activations == "cpu"
    assert zp.ZeroConfig.from_env({"ZERO_PLUGIN_OFFLOAD_ACTIVATIONS": "cpu"}).offload_activations == "cpu"
    with pytest.raises(ValueError, match="offload_activations"):
        zp.ZeroConfig(offload_activations="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-to-host move needs a CUDA device")
def test_cuda_inputs_leave_the_device():
    model = _model(device="cuda")
    offload = activation_offload.enable(model, "cpu")
    before = torch.cuda.memory_allocated()
    loss = model(input_ids=_ids("cuda"), labels=_ids("cuda")).loss
    with_offload = torch.cuda.memory_allocated() - before
    del loss
    plain = _model(device="cuda")
    before = torch.cuda.memory_allocated()
    kept = plain(input_ids=_ids("cuda"), labels=_ids("cuda")).loss
    without = torch.cuda.memory_allocated() - before
    del kept
    one_input = BATCH * SEQ * HIDDEN * 8
    assert without - with_offload >= (LAYERS - 1) * one_input
    assert offload.stats.packed_bytes == LAYERS * one_input
