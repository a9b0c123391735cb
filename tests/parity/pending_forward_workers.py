"""Functions that run inside the ranks of the forward-without-backward cases (issue #38, items 1-2):
``tests/parity/test_zeropp.py`` (hpZ against plain stage 3) and ``tests/parity/test_parity_stage3.py`` (a
forward with grad that never gets a backward against the same forward under ``torch.no_grad()``).

A case is a sequence of operations (``OPS``) run on a fresh stage-3 model; every operation leaves a record
(losses as Python floats, per-rank shard gradients and shards as tensors), so two runs can be compared bit
for bit, record by record.  Module-level so the worker pool pickles them by reference.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from tests.parity import workers
from tests.unit.memory_comm_workers import collectives_layout
from zero_plugin.engines.engine import engine_of

# train: forward + backward; forward / backward: the two halves, apart; orphan: a forward whose backward never
# comes (with grad, or under no_grad for the reference run); eval: a forward under no_grad; step: step + zero_grad;
# load / load_full: model.load_state_dict / zp.load_full_state_dict of a fixed other state; edit: rank 0 scales
# every weight inside zp.gathered_parameters(modifier_rank=0); save / load_ckpt: zp.save_checkpoint /
# zp.load_checkpoint of ``ckpt_dir``.
OPS = ("train", "forward", "backward", "orphan", "eval", "step", "load", "load_full", "edit", "save", "load_ckpt")

# The cases of both tests: the writes of issue #38 after a forward that got no backward, then training on.
SEQUENCES = {
    "load_state_dict": ["train", "step", "orphan", "load", "train", "step", "train"],
    "load_full_state_dict": ["train", "step", "orphan", "load_full", "train", "step", "train"],
    "step": ["train", "orphan", "step", "train", "step", "train"],
    "eval_then_step": ["train", "orphan", "eval", "step", "train", "step", "train"],
    "gathered_edit": ["train", "step", "orphan", "edit", "train", "step", "train"],
    "load_checkpoint": ["train", "step", "save", "train", "orphan", "load_ckpt", "train", "step", "train"],
    # writes that leave autograd's version counters alone (a step, load_state_dict or an in-place edit of a
    # weight the forward saved makes its backward raise, as in plain PyTorch)
    "load_before_backward": ["forward", "load_full", "backward", "step", "save", "forward", "load_ckpt", "backward"],
}


def sequence_worker(
    kind: str,
    batches: list,
    ops: list[str],
    orphan_grad: bool = True,
    ckpt_dir: str | None = None,
    buffered: bool = False,
    **config,
) -> list:
    """Run ``ops`` at stage 3 with ``config``; one record per operation, then the units left gathered.
    ``orphan_grad=False``: the orphan forwards run under ``torch.no_grad()`` (the reference); ``buffered``: the
    rank-major collective layout NCCL uses, forced on gloo."""
    model = workers.build_model(kind)
    with collectives_layout(buffered):
        model, opt = zp.setup(model, workers.build_optimizer(model), zp.ZeroConfig(stage=3, **config))
    run = _Sequence(model, opt, batches, orphan_grad, ckpt_dir)
    for op in ops:
        assert op in OPS, op
        run.do(op)
    run.records.append(("gathered", [u.name for u in run.engine.unsharded_units()]))
    return run.records


class _Sequence:
    """One rank's model and optimizer, the operations run on them so far and their records."""

    def __init__(self, model, opt, batches: list, orphan_grad: bool, ckpt_dir: str | None) -> None:
        self.model, self.opt, self.batches = model, opt, batches
        self.orphan_grad, self.ckpt_dir = orphan_grad, ckpt_dir
        self.engine = engine_of(model, "test")
        self.other = {k: v * 0.5 + 0.01 for k, v in zp.full_state_dict(model, rank0_only=False).items()}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.records: list = []
        self.pending: torch.Tensor | None = None  # the loss of a "forward" whose "backward" is still to come
        self.used = 0  # batches used so far (cycled)

    def do(self, op: str) -> None:
        if op in ("train", "forward", "orphan", "eval"):
            self.forward(op)
        elif op == "backward":
            loss, self.pending = self.pending, None
            loss.backward()
            self.records.append(("grads", self.grads()))
        elif op == "step":
            self.opt.step()
            self.opt.zero_grad()
            self.records.append((op, {n: p.detach().clone() for n, p in self.model.named_parameters()}))
        else:
            _write(op, self.model, self.opt, self.other, self.ckpt_dir, self.rank)
            self.records.append((op, None))

    def forward(self, op: str) -> None:
        grad = op != "eval" and (op != "orphan" or self.orphan_grad)
        batch = models.shard_batch(self.batches[self.used % len(self.batches)], self.rank, self.world)
        self.used += 1
        with contextlib.nullcontext() if grad else torch.no_grad():
            loss = models.loss_fn(self.model, batch)
        self.records.append((op, loss.item()))
        if op == "forward":
            self.pending = loss
        elif op == "train":
            loss.backward()
            self.records.append(("grads", self.grads()))

    def grads(self) -> dict:
        """This rank's shard gradients, by parameter name."""
        return {sp.name: _clone(sp.sharded_grad) for sp in self.engine.sharded.values()}


def _write(op: str, model, opt, other: dict, ckpt_dir: str | None, rank: int) -> None:
    if op == "load":
        model.load_state_dict(other)
    elif op == "load_full":
        zp.load_full_state_dict(model, other, src_rank=None)
    elif op == "edit":
        with zp.gathered_parameters(model, modifier_rank=0), torch.no_grad():
            if rank == 0:
                for p in model.parameters():
                    p.mul_(0.75)
    elif op == "save":
        zp.save_checkpoint(ckpt_dir, model, opt)
    elif op == "load_ckpt":
        zp.load_checkpoint(ckpt_dir, model, opt)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def assert_same_records(got: list, want: list, what: str) -> None:
    """Bit for bit, record by record; the first difference is named."""
    assert [op for op, _ in got] == [op for op, _ in want], f"{what}: different operations"
    for i, ((op, a), (_, b)) in enumerate(zip(got, want)):
        where = f"{what}: record {i} ({op})"
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for name in a:
                x, y = a[name], b[name]
                if x is None or y is None:
                    assert x is None and y is None, f"{where} {name}: {x} vs {y}"
                    continue
                assert x.shape == y.shape and x.dtype == y.dtype, f"{where} {name}: {x.shape} vs {y.shape}"
                diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
                assert torch.equal(x, y), f"{where} {name}: max |diff| {diff:.3g}"
        else:
            assert a == b, f"{where}: {a!r} vs {b!r}"
