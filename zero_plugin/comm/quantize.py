"""Block-wise symmetric int8 quantization of flat tensors (ZeRO++, arXiv 2306.10209, sections 3.1 and 3.3).

[Note: block quantization]
A flat tensor of ``n`` elements is cut into blocks of ``block`` consecutive elements (the last one
zero-padded); each block has one float32 scale ``absmax / 127`` and its elements are sent as
``round(x / scale)`` in int8 ([-127, 127]; a block of zeros has scale 0 and sends zeros).  Dequantizing
gives ``q * scale``, so every element is off by at most ``scale / 2`` (round to nearest; plus the rounding
of the arithmetic itself in the compute dtype: exact for float64 inputs up to ~1e-16 relative).  The wire
form of one flat tensor is ``packed``, one uint8 tensor so that one collective moves both and ``comm_stats``
counts the real bytes: the ``ceil(n / block)`` scales as 4 bytes each, then the ``n`` int8 bytes, padded to a
multiple of 4 bytes (so that rows of packed tensors side by side keep the scales aligned for a float32 view):
``packed_numel(n, block) = 4 * ceil(n / block) + 4 * ceil(n / 4)``.  The arithmetic runs in float32, or float64 for a
float64 input (so the bound is tight in the float64 parity tests).
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_BLOCK", "packed_numel", "quantize_into", "dequantize", "block_scales"]

DEFAULT_BLOCK = 2048  # elements per scale: ZeRO++'s qwZ uses blocks of this order (0.2% overhead in scales)
_QMAX = 127


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_numel(numel: int, block: int) -> int:
    """Bytes of the wire form of ``numel`` elements ([Note: block quantization])."""
    return 4 * _blocks(numel, block) + 4 * _blocks(numel, 4)


def block_scales(flat: torch.Tensor, block: int) -> torch.Tensor:
    """One float32 scale per block of ``flat``: ``absmax / 127`` (0 for a block of zeros)."""
    n = flat.numel()
    padded = torch.zeros(_blocks(n, block) * block, dtype=_compute_dtype(flat.dtype), device=flat.device)
    padded[:n] = flat
    return (padded.view(-1, block).abs().amax(dim=1) / _QMAX).to(torch.float32)


def quantize_into(packed: torch.Tensor, flat: torch.Tensor, block: int, scales: torch.Tensor | None = None) -> None:
    """Write the wire form of 1-D ``flat`` into the uint8 tensor ``packed`` (``packed_numel`` long).
    ``scales``: use these instead of ``block_scales(flat)`` (tests break the scale on purpose)."""
    n = flat.numel()
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(n, block), "quantize_into: packed size"
    nb = _blocks(n, block)
    scales = block_scales(flat, block) if scales is None else scales
    cdt = _compute_dtype(flat.dtype)
    per_element = scales.to(cdt).repeat_interleave(block)[:n]
    divisor = torch.where(per_element > 0, per_element, torch.ones_like(per_element))
    q = torch.round(flat.to(cdt) / divisor).clamp_(-_QMAX, _QMAX).to(torch.int8)
    packed[: 4 * nb].copy_(scales.to(torch.float32).contiguous().view(torch.uint8))
    packed[4 * nb : 4 * nb + n].copy_(q.view(torch.uint8))
    packed[4 * nb + n :].zero_()


def dequantize(packed: torch.Tensor, numel: int, block: int, dtype: torch.dtype, out: torch.Tensor | None = None):
    """The ``numel`` values of a wire form (``quantize_into``) in ``dtype`` (into ``out`` when given)."""
    nb = _blocks(numel, block)
    scales = packed[: 4 * nb].view(torch.float32)
    q = packed[4 * nb : 4 * nb + numel].view(torch.int8)
    cdt = _compute_dtype(dtype)
    values = q.to(cdt) * scales.to(cdt).repeat_interleave(block)[:numel]
    if out is None:
        return values.to(dtype)
    out.copy_(values)
    return out
