"""Quantized frozen base weights (QLoRA): which schemes ``zp.setup`` accepts, and what it must keep intact.

[Note: packed 4-bit weights]
bitsandbytes' 4-bit layout for sharding (FSDP-QLoRA's: ``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_storage=torch.bfloat16)``) stores each ``Linear4bit`` weight as a ``Params4bit`` whose data
is the packed 4-bit codes *reinterpreted* as a float tensor of shape ``(numel * 4 bits / storage bits, 1)``,
plus a ``QuantState`` attribute (absmax per block, the code book, the original shape and dtype; with
double quantization a nested state) that dequantization needs for the whole weight.  What follows from it:

* The packed data is bytes, not numbers.  It is sharded, gathered, saved and loaded like any frozen
  parameter, but never cast (no ``param_dtype``, no ``consolidate --dtype``) and only ever moved by
  same-dtype copies and collectives that do not compute (all-gather, broadcast): a float operation would
  canonicalise the ~0.1 % of codes that happen to spell a NaN (bitsandbytes issue #1945, FSDP2).
* The ``Params4bit`` object keeps its identity ([Note: stage-3 parameter storage] in ``stage3/param.py``),
  so its ``quant_state`` stays attached while ``.data`` switches between the 1-D shard and the gathered
  packed tensor; bitsandbytes' forward finds it there.  The quant state is small (one fp32 absmax
  per 64-element block: 1/8 of the packed bytes, 1/32 with double quantization, plus a code book of about
  1 KiB per layer) and stays replicated: setup broadcasts rank 0's and moves it to
  the compute device.
* ``state_dict()`` is bitsandbytes' own layout: ``Linear4bit._save_to_state_dict`` adds the quant state
  entries (``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4``, ...) beside
  the weight, which the stage-3 hooks replace by the gathered packed tensor, so ``save_pretrained`` writes
  what ``from_pretrained`` reads back as a pre-quantized checkpoint.  ``zp.save_checkpoint`` stores those
  entries as buffers (rank 0's file; a load copies them back into the live quant state) and ``zero-plugin
  consolidate`` writes them under the same names, uncast.
* bitsandbytes' CPU inference path (``Linear4bit.forward`` in eval mode on an AVX512-BF16 CPU) repacks
  ``weight.data`` in place into another layout the first time it runs; a sharded parameter cannot have its
  data replaced, so setup turns that path off for the model's 4-bit layers (``support_avx512bf16_for_cpu``,
  an attribute of each layer instance).  Results are the same; CPU inference is slower.

Refused at setup, with the scheme named: 8-bit (``load_in_8bit``: ``Linear8bitLt.forward`` replaces
``weight.data`` by the int8 copy it keeps in the layer's state), 4-bit with integer storage (the default
``uint8``; the layout above is the supported one), a 4-bit weight that requires grad, and every other
transformers quantizer (GPTQ, AWQ, HQQ, torchao, ...: packed integer buffers and kernels of their own).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_quantization", "is_packed_4bit", "prepare_quantized", "quantized_layers"]

_FIX_4BIT = (
    "load the model with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
    "bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16) -- the FSDP-QLoRA layout "
    "zero_plugin shards"
)


def is_packed_4bit(param: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit weight (quantized or not yet): see [Note: packed 4-bit weights]."""
    return type(param).__name__ == "Params4bit" and type(param).__module__.startswith("bitsandbytes")


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding a packed 4-bit weight directly."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if any(p is not None and is_packed_4bit(p) for p in m._parameters.values())
    ]


def check_quantization(model: nn.Module) -> None:
    """``ValueError`` for a quantization scheme zero_plugin cannot shard or train over; see the Note."""
    for method, config in _quantization_configs(model):
        if method != "bitsandbytes":
            raise ValueError(
                f"zp.setup: the model is quantized with {method!r}, which zero_plugin does not support (its packed "
                f"integer buffers and kernels are not shardable parameters); for QLoRA, {_FIX_4BIT}, or load the "
                "model unquantized"
            )
        if _get(config, "load_in_8bit"):
            raise ValueError(
                "zp.setup: the model is loaded in 8-bit (BitsAndBytesConfig(load_in_8bit=True)), which zero_plugin "
                "does not support (Linear8bitLt replaces weight.data by its own int8 copy in every forward, which a "
                f"sharded parameter cannot allow); {_FIX_4BIT}"
            )
    for name, p in model.named_parameters():
        kind = type(p).__name__
        if kind == "Int8Params":
            raise ValueError(
                f"zp.setup: parameter {name!r} is a bitsandbytes 8-bit weight, which zero_plugin does "
                f"not support; {_FIX_4BIT}"
            )
        if not is_packed_4bit(p):
            continue
        if not p.dtype.is_floating_point:
            raise ValueError(
                f"zp.setup: 4-bit weight {name!r} is stored as {p.dtype} (bnb_4bit_quant_storage is not set to a float "
                f"dtype); zero_plugin shards the float-storage layout only: {_FIX_4BIT}"
            )
        if getattr(p, "quant_state", None) is None or p.is_meta:
            raise ValueError(
                f"zp.setup: 4-bit weight {name!r} is not quantized yet (no quant_state; bitsandbytes quantizes when "
                "the layer is moved to a device); load it with from_pretrained(..., quantization_config=...) or call "
                ".to(device) on the model before zp.setup"
            )
        if p.requires_grad:
            raise ValueError(
                f"zp.setup: 4-bit weight {name!r} requires grad; quantized weights cannot be trained. "
                "Freeze them (requires_grad=False) and train adapters (PEFT LoRA) on top"
            )


def _quantization_configs(model: nn.Module) -> list[tuple[str, object]]:
    """``(quant_method, config)`` of every transformers model inside ``model`` (PEFT wraps one)."""
    out = []
    for module in model.modules():
        config = getattr(getattr(module, "config", None), "quantization_config", None)
        quantizer = getattr(module, "hf_quantizer", None)
        if config is None and quantizer is not None:
            config = getattr(quantizer, "quantization_config", None)
        if config is None:
            continue
        method = _get(config, "quant_method")
        out.append((str(getattr(method, "value", method)), config))
    return out


def _get(config: object, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


@torch.no_grad()
def prepare_quantized(model: nn.Module, comm, device: torch.device | None = None) -> None:
    """Collective at world size > 1: every 4-bit weight's quant state becomes rank 0's (on ``device`` if
    given), and bitsandbytes' in-place CPU repacking is turned off ([Note: packed 4-bit weights])."""
    states = []
    for _, module in quantized_layers(model):
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        for p in module._parameters.values():
            if p is not None and is_packed_4bit(p):
                if device is not None:
                    p.quant_state.to(device)
                states.append(p.quant_state)
    tensors = [t for qs in states for t in _state_tensors(qs)]
    if tensors and comm.world_size > 1:
        comm.coalesced(tensors, lambda flat: comm.broadcast(flat, src=0))


def _state_tensors(quant_state) -> list[torch.Tensor]:
    """The tensors of one ``QuantState`` (absmax, code book; with double quantization the offset and the
    nested state's absmax and code book)."""
    out = [quant_state.absmax, quant_state.code]
    if getattr(quant_state, "nested", False):
        out += [quant_state.offset, quant_state.state2.absmax, quant_state.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]
