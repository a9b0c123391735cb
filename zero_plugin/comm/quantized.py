"""Quantized stage-3 collectives (ZeRO++, arXiv 2306.10209): qwZ's int8 weight all-gather and qgZ's int8
gradient reduce-scatter, as records that complete as ``layout.BufferedGather`` / ``BufferedReduce`` do.

[Note: qwZ gather]
``ZeroConfig.quantized_weights``: a unit's gather packs this rank's padded chunks of the members of one dtype
into one row (the buffered layout of [Note: collective layouts] in ``layout.py``), quantizes the row block by
block ([Note: block quantization] in ``quantize.py``) and all-gathers the packed uint8 rows; every rank,
this one included, dequantizes every row, so all ranks compute on the same weights.  Only the gathered copy
is quantized: the shards (and the optimizer's masters) stay exact, and each gather quantizes them afresh.
The unit's tag ([Note: gather tag] in ``stage3/unit.py``) travels exactly, as two uint8 bytes after the
packed row (padded to 4 bytes).  Both layouts (in place on gloo, buffered) use this path.

[Note: qgZ reduction]
``ZeroConfig.quantized_gradients``: each rank lays out its full gradients rank-major (row r: rank r's
padded chunks), quantizes every row on its own (block by block, so a destination's scales depend only on
its chunk), and exchanges the rows with one all-to-all: rank r receives row r of every rank.  The owner
dequantizes the N rows and sums them in float32 (float64 for float64 gradients): accumulation at the owner
in full precision, as ZeRO++ does, with one quantization per rank and reduction.  The has-gradient flags
go exactly in a small float32 all-reduce beside it.  With hierarchical sharding
([Note: sum across replicas] in ``layout.py``) the all-to-all runs in the shard group and the summed shard
is all-reduced across the replica group *exactly* (reduce dtype): quantizing again there would add a
second quantization error of the partial sums; the replica traffic is 2 Ψ/k per rank either way, and
hpZ/qwZ/qgZ target the plain world, where every collective crosses nodes.  Under ``zp.no_sync`` without
``accumulate_full_grads`` every micro-batch's reduction is quantized (A errors for A micro-batches); with
it, the kept full gradients are quantized once, in the synced backward.
Error per element of the averaged shard: at most ``sum_r scale_r / 2 / N`` (each rank's block scale),
which ``tests/parity/test_zeropp.py`` holds the engine to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..tensors.flat import copy_padded_rows
from . import quantize
from .collectives import Comm
from .layout import FRESH, Buffers, packed_offsets
from .streams import NO_STREAMS, StreamSet

__all__ = ["QuantizedGather", "QuantizedReduce", "gather_quantized", "reduce_quantized"]

Store = Callable[[Any, torch.Tensor], None]


def _aligned(nbytes: int) -> int:
    """Rows side by side keep their float32 scales aligned: every row a multiple of 4 bytes."""
    return -(-nbytes // 4) * 4


@dataclass(eq=False)
class QuantizedGather:
    """A qwZ all-gather in flight ([Note: qwZ gather]): ``output`` holds every rank's packed row."""

    comm: Comm
    members: list
    offsets: list[int]
    width: int
    trailer: int
    block: int
    dtype: torch.dtype
    input: torch.Tensor
    output: torch.Tensor
    work: Any
    buffers: Buffers = FRESH

    @property
    def row_bytes(self) -> int:
        return quantize.packed_numel(self.width, self.block) + _aligned(self.trailer)

    def wait(self, what: str) -> torch.Tensor:
        """Wait; every rank's dequantized row, ``(world_size, width + trailer)`` in ``dtype``."""
        self.comm.wait(self.work, what)
        packed = self.output.view(self.comm.world_size, self.row_bytes)
        rows = torch.empty(self.comm.world_size, self.width + self.trailer, dtype=self.dtype, device=packed.device)
        body = quantize.packed_numel(self.width, self.block)
        for r in range(self.comm.world_size):
            quantize.dequantize(packed[r, :body], self.width, self.block, self.dtype, out=rows[r, : self.width])
        rows[:, self.width :] = packed[:, body : body + self.trailer].to(self.dtype)
        return rows

    def complete(self, what: str, ends) -> None:
        """As ``BufferedGather.complete``: the dequantized rows to the caller's ``copy_out``."""
        ends.copy_out(self, self.wait(what))

    def columns(self, rows: torch.Tensor):
        for member, off in zip(self.members, self.offsets):
            yield member, rows[:, off : off + member.layout.shard_numel]

    def trailing(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.width :]

    def release(self) -> None:
        self.buffers.give(self.input)
        self.buffers.give(self.output)


def gather_quantized(
    comm: Comm,
    members: list,
    dtype: torch.dtype,
    device: torch.device,
    fill: Callable[[Any, torch.Tensor], None],
    block: int,
    trailer: tuple = (),
    tag: str = "",
) -> QuantizedGather:
    """As ``layout.gather_buffered``, the row quantized ([Note: qwZ gather]); ``trailer``: small ints (< 256)."""
    offsets, width = packed_offsets(m.layout.shard_numel for m in members)
    row = torch.empty(width, dtype=dtype, device=device)
    for member, off in zip(members, offsets):
        fill(member, row[off : off + member.layout.shard_numel])
    body = quantize.packed_numel(width, block)
    inp = torch.zeros(body + _aligned(len(trailer)), dtype=torch.uint8, device=device)
    quantize.quantize_into(inp[:body], row, block)
    for j, value in enumerate(trailer):  # scalar fills: no pageable host copy ([Note: deferred host reads])
        inp[body + j] = value
    out = torch.empty(comm.world_size * inp.numel(), dtype=torch.uint8, device=device)
    work = comm.all_gather(out, inp, async_op=True, tag=tag)
    return QuantizedGather(comm, members, offsets, width, len(trailer), block, dtype, inp, out, work)


@dataclass(eq=False)
class QuantizedReduce:
    """A qgZ reduction in flight ([Note: qgZ reduction]): ``received`` holds row ``rank`` of every rank."""

    comm: Comm
    members: list
    offsets: list[int]
    width: int
    block: int
    dtype: torch.dtype
    sent: torch.Tensor
    received: torch.Tensor
    flags: torch.Tensor
    work: Any
    flag_work: Any
    streams: StreamSet = NO_STREAMS
    sources: list | None = None
    results_in_full_tensors = False  # a result is a view of a shard-sized sum
    results = None  # no row of results is the caller's to keep (layout.BufferedReduce.results)

    def complete(self, what: str, store: Store) -> None:
        with self.streams.reduce():
            self.comm.wait(self.work, what)
            self.comm.wait(self.flag_work, f"{what} (has-gradient flags)")
            acc = torch.float64 if self.dtype == torch.float64 else torch.float32
            n = self.comm.world_size
            packed = self.received.view(n, -1)
            total = torch.zeros(self.width + len(self.members), dtype=acc, device=packed.device)
            for r in range(n):  # [Note: qgZ reduction]: dequantize and sum at the owner in full precision
                total[: self.width] += quantize.dequantize(packed[r], self.width, self.block, acc)
            total[self.width :] = self.flags.to(acc)
            if self.comm.replica is not None:  # exact, in the reduce dtype ([Note: qgZ reduction])
                flat = total.to(self.dtype)
                self.comm.replica.wait(
                    self.comm.replica.all_reduce(flat, async_op=True, tag="sum across replicas"),
                    "gradient sum across replicas",
                )
                total = flat.to(acc)
            present = total[self.width :].tolist()
            total = total[: self.width].div_(self.comm.dp_size).to(self.dtype)
            for member, off, has_grad in zip(self.members, self.offsets, present):
                if has_grad:
                    store(member, total[off : off + member.layout.local_numel])
            reduced = self.streams.record()
        self.streams.wait(reduced)
        self.sources = None


def reduce_quantized(
    comm: Comm,
    members: list,
    dtype: torch.dtype,
    device: torch.device,
    release_grads: bool,
    block: int,
    streams: StreamSet = NO_STREAMS,
    tag: str = "",
    grad_of: Callable[[Any], torch.Tensor | None] = lambda m: m.param.grad,
) -> QuantizedReduce:
    """Quantize every destination's row of the members' full gradients (``grad_of``; zeros where none) and
    exchange them ([Note: qgZ reduction]); call it on the stream the copies run on (inside ``streams.reduce()``)."""
    n = comm.world_size
    offsets, width = packed_offsets(m.layout.shard_numel for m in members)
    rows = torch.empty(n, width, dtype=dtype, device=device)
    present = []
    sources = [] if streams.overlaps else None
    for member, off in zip(members, offsets):
        grad = grad_of(member)
        copy_padded_rows(
            rows[:, off : off + member.layout.shard_numel], None if grad is None else grad.reshape(-1), member.layout
        )
        present.append(float(grad is not None))
        if grad is not None and sources is not None:
            sources.append(grad)
        if release_grads:
            member.param.grad = None
    body = quantize.packed_numel(width, block)
    sent = torch.empty(n, body, dtype=torch.uint8, device=device)
    for r in range(n):
        quantize.quantize_into(sent[r], rows[r], block)
    received = torch.empty_like(sent)
    work = comm.all_to_all(received.view(-1), sent.view(-1), async_op=True, tag=tag)
    flags = torch.tensor(present, dtype=torch.float32, device=device)
    flag_work = comm.all_reduce(flags, async_op=True, tag=f"{tag} flags")
    return QuantizedReduce(
        comm,
        members,
        offsets,
        width,
        block,
        dtype,
        sent,
        received,
        flags,
        flag_work=flag_work,
        work=work,
        streams=streams,
        sources=sources,
    )
