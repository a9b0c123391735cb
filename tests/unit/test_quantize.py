"""Block-wise int8 quantizer of ZeRO++'s qwZ / qgZ ([Note: block quantization] in zero_plugin/comm/quantize.py)."""

from __future__ import annotations

import pytest
import torch

from zero_plugin.comm import quantize


def _round_trip(x: torch.Tensor, block: int, scales=None) -> torch.Tensor:
    packed = torch.empty(quantize.packed_numel(x.numel(), block), dtype=torch.uint8)
    quantize.quantize_into(packed, x, block, scales)
    return quantize.dequantize(packed, x.numel(), block, x.dtype)


def _bound(x: torch.Tensor, block: int) -> torch.Tensor:
    return quantize.block_scales(x, block).double().repeat_interleave(block)[: x.numel()] / 2


@pytest.mark.parametrize("numel", [1, 7, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("block", [64, 2048])
def test_round_trip_within_half_a_scale(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=torch.float64) * 5
    err = (_round_trip(x, block) - x).abs()
    bound = _bound(x, block)
    assert (err <= bound * (1 + 1e-12)).all(), (err - bound).max()
    if numel > 1:
        assert err.max() > 0  # it does quantize
    # the largest element of each block is exact up to the float32 scale's rounding
    assert err.max() <= quantize.block_scales(x, block).max() / 2 * (1 + 1e-12)


def test_zeros_and_zero_blocks_are_exact():
    x = torch.zeros(300, dtype=torch.float64)
    x[200:] = torch.linspace(-1, 1, 100, dtype=torch.float64)
    y = _round_trip(x, 64)
    assert torch.equal(y[:192], x[:192])  # whole blocks of zeros: scale 0, exact
    assert (y[x == 0] == 0).all()  # zeros stay zeros in every block


def test_packed_bytes_formula():
    # scales (4 B per block) then int8 per element, padded to 4 bytes
    assert quantize.packed_numel(0, 64) == 0
    assert quantize.packed_numel(1, 64) == 4 + 4
    assert quantize.packed_numel(65, 64) == 8 + 68
    assert quantize.packed_numel(2048 * 3, 2048) == 12 + 6144


def test_float32_input_and_bf16_output():
    x = torch.randn(513, generator=torch.Generator().manual_seed(1))
    err = (_round_trip(x, 128).double() - x.double()).abs()
    assert (err <= _bound(x, 128) * (1 + 1e-6)).all()
    packed = torch.empty(quantize.packed_numel(513, 128), dtype=torch.uint8)
    quantize.quantize_into(packed, x, 128)
    y = quantize.dequantize(packed, 513, 128, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and (y.double() - x.double()).abs().max() < 0.05


def test_a_wrong_scale_breaks_the_bound():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    half = quantize.block_scales(x, 64) / 2  # elements above 63.5 * scale clip at 127
    err = (_round_trip(x, 64, half) - x).abs()
    assert (err > _bound(x, 64) * (1 + 1e-12)).any()
