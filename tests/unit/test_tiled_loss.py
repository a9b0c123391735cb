"""``zp.tiled_lm_loss`` on one process (issue #50, item 2): value and gradients (hidden, weight, bias) equal to the
untiled ``F.cross_entropy(lm_head(hidden).float(), ...)`` in float64 (1e-12), float32 (1e-6) and bfloat16 inputs,
for both reductions, with -100 labels, all-ignored tiles, token counts the tile does not divide, ``shift=True``;
the sequence-parallel path against ``sequence_loss``; the refusals.  Stage 3 on 2 ranks:
tests/parity/test_tiled_loss.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zero_plugin as zp
from zero_plugin.sequence import tiled_loss
from zero_plugin.sequence.loss import sequence_loss

VOCAB, HIDDEN = 53, 24


def _problem(dtype: torch.dtype, bias: bool = True, shape=(3, 19), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=gen))
    head = head.to(dtype)
    hidden = torch.randn(*shape, HIDDEN, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels[0, :11] = -100  # with tile_tokens 5: tiles 0 and 1 wholly ignored, tile 2 partly
    labels[-1, -3:] = -100
    return head, hidden, labels


def _untiled(head, hidden, labels, reduction, shift=False):
    logits = head(hidden).float() if hidden.element_size() < 4 else head(hidden)
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction=reduction)


def _compare(head, hidden, labels, reduction, tol, shift=False, **kwargs):
    inputs = [hidden, *head.parameters()]
    want = _untiled(head, hidden, labels, reduction, shift)
    want_grads = torch.autograd.grad(want, inputs)
    got = zp.tiled_lm_loss(hidden, head, labels, reduction=reduction, shift=shift, **kwargs)
    got_grads = torch.autograd.grad(got, inputs)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())
    return got, want


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["float64", "float32"])
@pytest.mark.parametrize("tile_tokens", [1, 5, 57, 4096])  # 57 tokens: one token per tile .. one tile
def test_equals_the_untiled_loss(dtype, tol, reduction, tile_tokens):
    head, hidden, labels = _problem(dtype)
    _compare(head, hidden, labels, reduction, tol, tile_tokens=tile_tokens)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bfloat16_inputs_compute_the_loss_in_float32(reduction):
    """As transformers: the matmul in bfloat16, the logits taken to float32; gradients back in bfloat16 (their
    float32 sums over tiles rounded once, where autograd rounds each matmul: 1 bf16 ulp)."""
    head, hidden, labels = _problem(torch.bfloat16)
    got, _ = _compare(head, hidden, labels, reduction, 1e-2, tile_tokens=5)
    assert got.dtype == torch.float32


def test_no_bias_a_weight_tensor_and_shift():
    head, hidden, labels = _problem(torch.float64, bias=False)
    _compare(head, hidden, labels, "mean", 1e-12, shift=True, tile_tokens=4)
    weight = head.weight.detach().requires_grad_()
    bias = torch.randn(VOCAB, dtype=torch.float64, requires_grad=True)
    linear = torch.nn.Linear(HIDDEN, VOCAB).to(torch.float64)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    got = zp.tiled_lm_loss(hidden, weight, labels, bias=bias, tile_tokens=6)
    torch.testing.assert_close(got, _untiled(linear, hidden, labels, "mean"), rtol=1e-12, atol=0)


def test_frozen_head_and_frozen_hidden():
    head, hidden, labels = _problem(torch.float64)
    head.requires_grad_(False)
    want = torch.autograd.grad(_untiled(head, hidden, labels, "mean"), hidden)[0]
    got = torch.autograd.grad(zp.tiled_lm_loss(hidden, head, labels, tile_tokens=5), hidden)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    head.requires_grad_(True)
    frozen = hidden.detach()
    want = torch.autograd.grad(_untiled(head, frozen, labels, "sum"), head.weight)[0]
    got = torch.autograd.grad(zp.tiled_lm_loss(frozen, head, labels, tile_tokens=5, reduction="sum"), head.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_all_labels_ignored():
    head, hidden, labels = _problem(torch.float64)
    labels.fill_(-100)
    assert zp.tiled_lm_loss(hidden, head, labels, reduction="sum").item() == 0.0
    assert torch.isnan(zp.tiled_lm_loss(hidden, head, labels)).item()  # as F.cross_entropy's mean
    grad = torch.autograd.grad(zp.tiled_lm_loss(hidden, head, labels, reduction="sum"), hidden)[0]
    assert torch.count_nonzero(grad) == 0


def test_saves_no_logits():
    """What forward keeps for backward: the inputs themselves (no copy) and one float per token."""
    head, hidden, labels = _problem(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        zp.tiled_lm_loss(hidden, head, labels, tile_tokens=5)
    assert not any(t.dim() == 2 and t.shape[-1] == VOCAB for t in saved), [tuple(t.shape) for t in saved]
    assert any(t.data_ptr() == hidden.data_ptr() for t in saved)


class _GroupTotals:
    """A sequence-parallel group's stand-in (as in test_sequence_parallel.py): its all-reduce returns known
    totals."""

    def __init__(self, k: int, totals: torch.Tensor) -> None:
        self.world_size, self.totals = k, totals

    def all_reduce(self, tensor: torch.Tensor, tag: str = "") -> None:
        tensor.copy_(self.totals)


def test_sequence_parallel_path_is_sequence_loss(monkeypatch):
    """``sequence_parallel=model``: value and backward (K / T seeding) those of ``zp.sequence_parallel_loss`` on
    the same rank's logits."""
    head, hidden, labels = _problem(torch.float64)
    comm = _GroupTotals(2, torch.tensor([123.0, 77.0], dtype=torch.float64))

    class _Group:
        pass

    group = _Group()
    group.comm = comm
    monkeypatch.setattr(tiled_loss, "sequence_parallel_of", lambda model: group)
    inputs = [hidden, *head.parameters()]
    want = sequence_loss(head(hidden), labels, comm)
    want_grads = torch.autograd.grad(want, inputs)
    got = zp.tiled_lm_loss(hidden, head, labels, tile_tokens=5, sequence_parallel=object())
    got_grads = torch.autograd.grad(got, inputs)
    assert got.item() == want.item() == 123.0 / 77.0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_refusals_name_the_problem():
    head, hidden, labels = _problem(torch.float32)
    with pytest.raises(ValueError, match="reduction must be"):
        zp.tiled_lm_loss(hidden, head, labels, reduction="none")
    with pytest.raises(ValueError, match="tile_tokens must be >= 1"):
        zp.tiled_lm_loss(hidden, head, labels, tile_tokens=0)
    with pytest.raises(ValueError, match="must cover the same tokens"):
        zp.tiled_lm_loss(hidden, head, labels[:, 1:])
    with pytest.raises(ValueError, match=r"must be \[vocab, 24\]"):
        zp.tiled_lm_loss(hidden, torch.zeros(VOCAB * HIDDEN), labels)  # a stage-3 shard read outside the forward
    with pytest.raises(ValueError, match="bias= is for a weight"):
        zp.tiled_lm_loss(hidden, head, labels, bias=head.bias)
    with pytest.raises(ValueError, match="shift_labels"):
        zp.tiled_lm_loss(hidden, head, labels, shift=True, sequence_parallel=object())
