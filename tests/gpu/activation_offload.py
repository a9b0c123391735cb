"""GPU part "activation_offload" (tests/gpu/check.py): ``ZeroConfig(offload_activations="cpu")`` on CUDA.

What only a device can show ([Note: activation offload] in zero_plugin/sequence/offload.py):
  * the checkpointed layer inputs leave the device: the memory allocated at the end of forward falls by at least
    (layers - 1) layer inputs against checkpointing alone (the last layer's input stays by design);
  * the side-stream copies are awaited before the device block is reused and the bring-back is complete before
    the recompute reads it: over several steps with a fresh batch each, the gradients with offload equal those
    without, bit for bit (a race shows up as a mismatch, not as an error);
  * through ``zp.setup`` at stage 3 (NCCL, world size 1) with the optimizer, the losses and parameters after the
    steps equal the run without activation offload, bit for bit.
"""

from __future__ import annotations

import torch

STEPS = 4
BATCH, SEQ, HIDDEN, LAYERS = 2, 2048, 512, 6
VOCAB, INTER, HEADS, KV_HEADS = 4096, 1376, 8, 4
DEVICE = "cuda"  # a dry run of the logic on CPU sets "cpu" (nothing moves there: the memory check then fails)


def _allocated() -> int:
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _model(dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    from tests.models import llama_config

    torch.manual_seed(0)
    config = llama_config(
        VOCAB,
        HIDDEN,
        intermediate=INTER,
        layers=LAYERS,
        heads=HEADS,
        kv_heads=KV_HEADS,
        max_positions=SEQ,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(dtype=dtype, device=DEVICE)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)).to(DEVICE)


def _grads_and_forward_memory(offloaded: bool) -> tuple[list[list[torch.Tensor]], int, int]:
    from zero_plugin.sequence import offload as activation_offload

    model = _model(torch.float32)
    stats = activation_offload.enable(model, "cpu").stats if offloaded else None
    grads, forward_bytes = [], 0
    for step in range(STEPS):
        before = _allocated()
        loss = model(input_ids=_batch(step), labels=_batch(step)).loss
        forward_bytes = max(forward_bytes, _allocated() - before)
        loss.backward()
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return grads, forward_bytes, stats.packed_bytes if stats is not None else 0


def _stage3(offloaded: bool) -> tuple[list[float], list[torch.Tensor]]:
    import zero_plugin as zp

    model = _model(torch.float32)
    config = zp.ZeroConfig(stage=3, offload_activations="cpu" if offloaded else "none")
    model, optimizer = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_batch(step), labels=_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with zp.gathered_parameters(model):
        params = [p.detach().cpu().clone() for p in model.parameters()]
    return losses, params


def part_activation_offload() -> dict:
    from tests.gpu.check import _nccl_world1

    plain, plain_bytes, _ = _grads_and_forward_memory(False)
    moved, moved_bytes, packed = _grads_and_forward_memory(True)
    one_input = BATCH * SEQ * HIDDEN * 4
    grads_equal = all(torch.equal(a, b) for ga, gb in zip(plain, moved) for a, b in zip(ga, gb))
    saved = plain_bytes - moved_bytes
    _nccl_world1()
    want_losses, want_params = _stage3(False)
    got_losses, got_params = _stage3(True)
    stage3_equal = got_losses == want_losses and all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    return {
        "ok": grads_equal
        and saved >= (LAYERS - 1) * one_input
        and packed == STEPS * LAYERS * one_input
        and stage3_equal,
        "grads_bitwise_equal": grads_equal,
        "forward_bytes_checkpointing": plain_bytes,
        "forward_bytes_offload": moved_bytes,
        "saved_bytes": saved,
        "wanted_at_least": (LAYERS - 1) * one_input,
        "packed_bytes": packed,
        "packed_bytes_wanted": STEPS * LAYERS * one_input,
        "stage3_bitwise_equal": stage3_equal,
        "stage3_losses": got_losses,
    }
