"""The fuzzed model, its data and its optimizer, built from a plain-data spec (see ``spec.py``).

Both sides of a comparison call these builders: the ranks (``workers.py``) and the single-process
reference (``reference.py``), so they start from the same weights, see the same batches and use the
same param groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Batches of ``forward`` ops (no backward) are numbered from here, apart from the micro-batches'.
FORWARD_BATCHES = 10_000

# Usage of one block in one rank's forward of one micro-batch.
SKIP, DISCARD, USE = 0, 1, 2
"""SKIP: the block is not called; DISCARD: called, its output thrown away (its weights get no gradient on
this rank); USE: called and its output feeds the loss."""


def fit(x: torch.Tensor, width: int) -> torch.Tensor:
    """Parameter-free stand-in for a block that is skipped or discarded: truncate or zero-pad to ``width``."""
    have = x.shape[-1]
    return x[..., :width] if have >= width else F.pad(x, (0, width - have))


class FuzzBlock(nn.Module):
    """``h = tanh(fc(x)); h + mix(h)``; ``mix`` is square so it can be tied to another block of the same width.

    The stage-3 unit class of the fuzzed model (``unit_classes=("FuzzBlock",)``).
    """

    def __init__(self, d_in: int, width: int, bias: bool):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(d_in, width, bias=bias)
        self.mix = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.mix(h)


class FuzzModel(nn.Module):
    """A stack of ``FuzzBlock``s, a head and a one-element ``scale`` (fewer elements than ranks).

    ``forward(x, usage)`` takes one ``SKIP``/``DISCARD``/``USE`` per block, so each rank and each
    micro-batch can use the blocks differently.
    """

    _no_split_modules = ["FuzzBlock"]

    def __init__(self, d_in: int, widths: list[int], d_out: int, bias: bool):
        super().__init__()
        dims = [d_in, *widths]
        self.blocks = nn.ModuleList([FuzzBlock(dims[i], w, bias) for i, w in enumerate(widths)])
        self.head = nn.Linear(dims[-1], d_out, bias=bias)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, usage: list[int]) -> torch.Tensor:
        for block, use in zip(self.blocks, usage):
            if use == SKIP:
                x = fit(x, block.width)
                continue
            out = block(x)
            x = out if use == USE else fit(x, block.width)
        return self.head(x) * self.scale


def build_model(spec: dict, dtype: torch.dtype) -> FuzzModel:
    """Seeded fp32 init, then ties, frozen parameters and the cast to ``dtype`` (the same values on every call)."""
    m = spec["model"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = FuzzModel(m["d_in"], m["widths"], m["d_out"], m["bias"])
    for j, i in enumerate(m["tie_to"]):
        if i is not None:
            model.blocks[j].mix.weight = model.blocks[i].mix.weight
    model = model.to(dtype)
    names = dict(model.named_parameters())
    for name in m["frozen"]:
        names[name].requires_grad_(False)
    return model


def tie_roots(tie_to: list) -> list:
    """``tie_to`` with every entry pointing at the first block of its chain (a block tied to a tied block)."""
    roots: list = []
    for i in tie_to:
        roots.append(None if i is None else (roots[i] if roots[i] is not None else i))
    return roots


def build_optimizer(spec: dict, model: nn.Module) -> torch.optim.Optimizer:
    """SGD, AdamW, torch's Adafactor or the tests' LAMB (shape-aware: whole-tensor statistics) over the trainable
    parameters; ``two_groups`` puts vectors in a second group (lr / 2, no decay)."""
    o = spec["optimizer"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    first = [p for p in trainable if p.ndim >= 2]
    second = [p for p in trainable if p.ndim < 2]
    if o["two_groups"] and first and second:
        groups = [{"params": first}, {"params": second, "lr": o["lr"] / 2, "weight_decay": 0.0}]
    else:
        groups = [{"params": trainable}]
    if o["kind"] == "sgd":
        return torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"])
    if o["kind"] == "adafactor":
        return torch.optim.Adafactor(groups, lr=o["lr"], weight_decay=o["weight_decay"])
    if o["kind"] == "lamb":
        from tests.parity.shape_aware_workers import Lamb

        return Lamb(groups, lr=o["lr"], weight_decay=o["weight_decay"])
    return torch.optim.AdamW(groups, lr=o["lr"], weight_decay=o["weight_decay"])


def batch(spec: dict, micro: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, targets) of micro-batch ``micro``: fixed by (seed, micro, rank) alone."""
    m = spec["model"]
    g = torch.Generator().manual_seed(spec["seed"] * 7919 + micro * 131 + rank)
    x = torch.randn(m["batch"], m["d_in"], generator=g)
    y = torch.randn(m["batch"], m["d_out"], generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.to(y.dtype), y)


def written(index: int, value: torch.Tensor, seed: int) -> torch.Tensor:
    """A ``write`` op's new value of the ``index``-th trainable parameter (in ``named_parameters`` order):
    half the current value plus seeded noise, computed in the value's dtype."""
    g = torch.Generator().manual_seed(seed * 1000 + index)
    return 0.5 * value + 0.1 * torch.randn(value.shape, generator=g, dtype=torch.float64).to(value.dtype)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters, tied ones once (``named_parameters`` order)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]
