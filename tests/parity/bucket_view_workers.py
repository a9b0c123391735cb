"""Model, data, reference and rank function of ``tests/parity/test_bucket_views.py``.

Stages 0 and 1 keep gradients as views of their buckets' buffers ([Note: gradients as bucket views] in
``zero_plugin/grads/views.py``).  The schedule walks every way a gradient reaches a bucket: a fresh one
after ``zero_grad(set_to_none=True)`` (copied in), one accumulated into the view after
``zero_grad(set_to_none=False)``, micro-batches under ``zp.no_sync``, and two synced backwards before one
step.  A head used on rank 0 only gets the average with zeros from the others; a parameter no rank uses
keeps no gradient.  The float64 reference replays every rank's slice with that rank's decisions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from zero_plugin.api import engine_of

IN, HIDDEN, OUT, ROWS_PER_RANK = 7, 15, 3, 4
# (set_to_none before the step's first backward, micro-batches, how the earlier ones run)
SCHEDULE = [(True, 1, None), (False, 1, None), (False, 2, "no_sync"), (True, 2, "synced"), (False, 2, "synced")]
LR = 0.1


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.side = nn.Linear(HIDDEN, OUT)  # rank 0 only
        self.spare = nn.Parameter(torch.ones(5))  # never used

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        out = self.head(h)
        return out + self.side(h) if use_side else out


def build_model() -> TwoHeads:
    return TwoHeads().double()


def batches(world_size: int) -> list:
    """Per step, per micro-batch: (x, y) of ``world_size * ROWS_PER_RANK`` rows."""
    gen = torch.Generator().manual_seed(1)
    rows = world_size * ROWS_PER_RANK
    return [
        [
            (
                torch.randn(rows, IN, generator=gen, dtype=torch.float64),
                torch.randn(rows, OUT, generator=gen, dtype=torch.float64),
            )
            for _ in range(micro)
        ]
        for _, micro, _ in SCHEDULE
    ]


def _rank_loss(model, x, y, rank: int):
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return F.mse_loss(model(x[rows], use_side=rank == 0), y[rows])


def _grads(model) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def reference(world_size: int) -> list[dict]:
    """Gradients before each step and parameters after it: mean over ranks of each rank's mean loss."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for (set_to_none, micro, _), step_batches in zip(SCHEDULE, batches(world_size)):
        opt.zero_grad(set_to_none=set_to_none)
        for x, y in step_batches:
            loss = sum(_rank_loss(model, x, y, r) for r in range(world_size)) / world_size / micro
            loss.backward()
        grads = _grads(model)
        opt.step()
        out.append({"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


def train_worker(stage: int = 0, buffered: bool = False) -> list[dict]:
    """Per step: the gradients before it (stage 1 also each parameter's owned region, ``owned``), whether
    each ``param.grad`` lies in a bucket buffer and where (``ptrs``), the buffers' addresses, and the
    parameters after it."""
    from tests.unit.memory_comm_workers import collectives_layout

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model()
    with collectives_layout(buffered):
        model, opt = zp.setup(
            model, torch.optim.SGD(model.parameters(), lr=LR), zp.ZeroConfig(stage=stage, bucket_size_mb=1e-4)
        )
    engine = engine_of(model, "test")
    buffers = engine.reducer.views.tensors
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for (set_to_none, micro, earlier), step_batches in zip(SCHEDULE, batches(world_size)):
        opt.zero_grad(set_to_none=set_to_none)
        for i, (x, y) in enumerate(step_batches):
            loss = _rank_loss(model, x, y, rank) / micro
            if i < micro - 1 and earlier == "no_sync":
                with zp.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
        grads = _grads(model)
        owned = {names[id(s.param)]: engine.owned_grad(s) for s in engine.slots}
        owned = {n: None if g is None else g.detach().clone() for n, g in owned.items()}
        ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers()]
        in_buffer = {
            n: any(lo <= p.grad.data_ptr() < hi for lo, hi in ranges)
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        ptrs = {n: p.grad.data_ptr() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        out.append(
            {
                "grads": grads,
                "owned": owned,
                "in_buffer": in_buffer,
                "ptrs": ptrs,
                "buffers": [lo for lo, _ in ranges],
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
    return out
