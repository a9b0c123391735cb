"""Model, data, reference and rank functions of ``tests/parity/test_uneven_use.py``.

Ranks use parameters unevenly: an expert that gets tokens on some ranks only, a block whose forward
ignores its weights on one rank, a branch taken by rank parity.  Expected semantics are DDP's: the
gradient of a parameter is the average over ranks, with zeros from ranks that did not use it; a
parameter no rank used gets no gradient (the optimizer skips it).

The single-process float64 reference replays every rank's slice of the global batch with the decisions
that rank made and averages the per-rank mean losses, so its gradient is ``(1/N) sum_r grad L_r``, which
is exactly what data-parallel averaging gives.

[Note: uneven bucket order] The model is built so that gradient hooks complete buckets (stages 0-2) and
units (stage 3) in a different order on different ranks: the head (root unit) is registered first and
gets its gradient first, and the three blocks are identical (15 -> 15 with an expert), so a block whose
gradient is missing on one rank is launched last there, and in its place that rank reduces another
block of the same size.  ``BUCKETS["block"]`` is one block's bytes, so each block is one bucket at
stages 0-2; ``"tiny"`` puts every parameter in its own bucket (the paired reductions then differ in size)
and ``"default"`` puts everything in one bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from tests.unit.memory_comm_workers import collectives_layout, deferred_reads

WIDTH, OUT = 15, 7  # odd widths: every parameter is padded for 2 and 3 ranks
N_BLOCKS, STEPS, ROWS_PER_RANK = 3, 3, 3
CASES = ("expert", "ignored", "branch")
OPTIMIZERS = ("adamw", "sgd")
# Bytes of one UnevenBlock in float64: fc (225 + 15), norm (15 + 15), expert (225 + 15).
BLOCK_BYTES = (2 * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH) * 8
BUCKETS = {"tiny": 1e-6, "block": BLOCK_BYTES / 2**20, "default": 25.0}
# A collective that blocks this long is a hang (the order diverged); zero_plugin then raises.
COLLECTIVE_TIMEOUT_S = 30.0


class UnevenBlock(nn.Module):
    """``tanh(norm(fc(x)))`` plus an expert ``tanh(expert(x))``; a stage-3 unit.

    ``mode``: "full" (fc and expert), "dense" (the expert gets no tokens), "skip" (the block is called
    but ignores its weights and returns its input).  ``extra`` adds a ``shift`` vector, making the
    block larger than the others.
    """

    def __init__(self, extra: bool = False):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)
        self.shift = nn.Parameter(0.1 * torch.ones(WIDTH)) if extra else None

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        if mode == "skip":
            return x
        h = torch.tanh(self.norm(self.fc(x)))
        if mode == "full":
            h = h + torch.tanh(self.expert(x))
        if self.shift is not None:
            h = h + self.shift
        return h


class UnevenModel(nn.Module):
    """A head (registered first, so it is the last bucket and the root unit) and three ``UnevenBlock``.

    ``forward(x, modes)``: ``modes[i]`` is block i's mode, or "absent" to not call block i at all.
    ``larger`` (a block index or None) gives that block an extra parameter.
    """

    _no_split_modules = ["UnevenBlock"]

    def __init__(self, larger: int | None = None):
        super().__init__()
        self.head = nn.Linear(WIDTH, OUT)
        self.blocks = nn.ModuleList([UnevenBlock(extra=i == larger) for i in range(N_BLOCKS)])

    def forward(self, x: torch.Tensor, modes: tuple) -> torch.Tensor:
        for block, mode in zip(self.blocks, modes):
            if mode != "absent":
                x = block(x, mode)
        return self.head(x)


def build_model(larger: int | None = None) -> UnevenModel:
    """Same float64 weights on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return UnevenModel(larger).double()


def build_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """AdamW (with weight decay, so a skipped step differs from a zero gradient) or plain SGD, whose
    update is the raw gradient."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.2)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def block_modes(case: str, rank: int, world: int, step: int) -> tuple[str, ...]:
    """Each block's mode on ``rank`` at ``step``.

    expert:  block 1's expert gets tokens on rank 0 only, and at step 2 on no rank (then it gets no
             gradient and the optimizer must skip it; ``STEPS`` >= 3);
    ignored: block 1 ignores its weights on the last rank;
    branch:  block 1's expert where rank + step is even, block 2's where it is odd.
    """
    if case == "expert":
        return ("full", "full" if rank == 0 and step != 2 else "dense", "full")
    if case == "ignored":
        return ("full", "skip" if rank == world - 1 else "full", "full")
    if case == "branch":
        odd = (rank + step) % 2 == 1
        return ("full", "dense" if odd else "full", "full" if odd else "dense")
    raise ValueError(f"case must be one of {CASES}, got {case!r}")


def make_data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``world * ROWS_PER_RANK`` rows; rank r takes rows [r*R, (r+1)*R)."""
    gen = torch.Generator().manual_seed(world)
    rows = world * ROWS_PER_RANK
    return [
        (
            torch.randn(rows, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(rows, OUT, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def rank_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]


def reference(case: str, opt_name: str, world: int) -> dict[str, torch.Tensor]:
    """Single process: each step's loss is the mean over ranks of rank r's mean loss, computed with the
    decisions rank r made, so a parameter rank r did not use contributes zero for that rank."""
    model = build_model()
    opt = build_optimizer(model, opt_name)
    for step, (x, y) in enumerate(make_data(world)):
        losses = [
            F.mse_loss(model(rank_slice(x, r), block_modes(case, r, world, step)), rank_slice(y, r))
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gradient_order(case: str, world: int, step: int) -> list[list[str]]:
    """Per rank: the names of the parameters in the order backward finalises their gradients on that
    rank (parameters that get none are left out).  Used to check [Note: uneven bucket order]."""
    model = build_model()
    x, y = make_data(world)[step]
    orders = []
    for r in range(world):
        seen: list[str] = []
        handles = [
            p.register_post_accumulate_grad_hook(lambda p, n=n, seen=seen: seen.append(n))
            for n, p in model.named_parameters()
        ]
        F.mse_loss(model(rank_slice(x, r), block_modes(case, r, world, step)), rank_slice(y, r)).backward()
        for h in handles:
            h.remove()
        model.zero_grad()
        orders.append(seen)
    return orders


def _train(
    case: str, opt_name: str, stage: int, buffered: bool, bucket: str, shard_group_size: int | None = None
) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    config = zp.ZeroConfig(
        stage=stage, bucket_size_mb=BUCKETS[bucket], timeout_s=COLLECTIVE_TIMEOUT_S, shard_group_size=shard_group_size
    )
    with collectives_layout(buffered):
        model, opt = zp.setup(model, build_optimizer(model, opt_name), config)
    with deferred_reads(buffered):
        for step, (x, y) in enumerate(make_data(world)):
            out = model(rank_slice(x, rank), block_modes(case, rank, world, step))
            F.mse_loss(out, rank_slice(y, rank)).backward()
            opt.step()
            opt.zero_grad()
    full = zp.full_state_dict(model, rank0_only=False)
    return {n: full[n] for n, _ in model.named_parameters()}


def parity_worker(
    stage: int, buffered: bool, runs: list[tuple[str, str, str]], refs: dict, shard_group_size: int | None = None
) -> dict[str, float]:
    """Train each ``(case, optimizer, bucket)`` of ``runs``; ``{"case/optimizer/bucket": max |θ - θ_ref|}``.

    ``refs[(case, optimizer)]`` are the reference parameters for this world size; ``shard_group_size``:
    hierarchical sharding (a parameter used in one shard group only reaches the other through the replica
    sum and its flags)."""
    errors = {}
    for case, opt_name, bucket in runs:
        got = _train(case, opt_name, stage, buffered, bucket, shard_group_size)
        want = refs[case, opt_name]
        errors[f"{case}/{opt_name}/{bucket}"] = max((got[n] - want[n]).abs().max().item() for n in want)
    return errors


def divergence_worker(absent: int, larger: bool, buffered: bool, absent_rank: int = 1) -> None:
    """Stage 3: one normal step, then rank ``absent_rank`` does not call block ``absent`` at all, so its
    gathers no longer pair with the other ranks'.  ``larger``: that block has one parameter more than the
    others.  Expected: a RuntimeError on every rank naming ``blocks.<absent>``; returns only if none was
    raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(larger=absent if larger else None)
    config = zp.ZeroConfig(stage=3, timeout_s=COLLECTIVE_TIMEOUT_S)
    with collectives_layout(buffered):
        model, opt = zp.setup(model, build_optimizer(model, "adamw"), config)
    with deferred_reads(buffered):
        for step, (x, y) in enumerate(make_data(world)[:3]):
            modes = ["full"] * N_BLOCKS
            if step >= 1 and rank == absent_rank:
                modes[absent] = "absent"
            F.mse_loss(model(rank_slice(x, rank), tuple(modes)), rank_slice(y, rank)).backward()
            opt.step()
            opt.zero_grad()
