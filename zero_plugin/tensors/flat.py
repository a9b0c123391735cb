"""Shard math for one parameter (FSDP2-style per-parameter sharding).

A parameter of ``numel`` elements is flattened and split into ``world_size``
chunks of ``shard_numel = ceil(numel / world_size)`` elements; rank r owns the
flat range ``[r * shard_numel, (r + 1) * shard_numel)`` clipped to ``numel``.
Only collectives see the padded chunk (the tail past ``numel`` is zeros);
what a rank stores is its *valid* range, so no padding reaches memory that
counts toward the model states.  See ``tests/unit/test_flat.py`` for the
property tests (shard -> gather is the identity, every element has one owner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardLayout"]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where one flattened parameter's elements live across ``world_size`` ranks."""

    numel: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        assert self.numel >= 0 and self.world_size >= 1 and 0 <= self.rank < self.world_size

    @property
    def shard_numel(self) -> int:
        """Padded chunk size each rank contributes to a collective."""
        return -(-self.numel // self.world_size) if self.numel else 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """Valid flat range ``[lo, hi)`` owned by ``rank`` (default: this rank); may be empty."""
        r = self.rank if rank is None else rank
        lo = min(r * self.shard_numel, self.numel)
        hi = min(lo + self.shard_numel, self.numel)
        return lo, hi

    @property
    def local_numel(self) -> int:
        lo, hi = self.bounds()
        return hi - lo

    def local_view(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's valid region of a contiguous full tensor, as a 1-D view."""
        lo, hi = self.bounds()
        return full.view(-1)[lo:hi]

    def chunk_view(self, padded_row: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The valid prefix of a padded chunk (``shard_numel`` long) that belongs to ``rank``."""
        lo, hi = self.bounds(rank)
        return padded_row[: hi - lo]


def copy_padded_rows(dst_rows: torch.Tensor, flat_src: torch.Tensor | None, layout: ShardLayout) -> None:
    """Copy-in: scatter ``flat_src`` (``numel`` long, or None for zeros) into ``dst_rows``.

    ``dst_rows`` is a ``(world_size, shard_numel)`` view (usually columns of a
    bucket buffer); row r receives rank r's chunk, zero-padded past ``numel``.
    """
    s = layout.shard_numel
    if s == 0:
        return
    if flat_src is None:
        dst_rows.zero_()
        return
    full_rows, rem = divmod(layout.numel, s)
    if full_rows:
        dst_rows[:full_rows].copy_(flat_src[: full_rows * s].view(full_rows, s))
    if full_rows < layout.world_size:
        if rem:
            dst_rows[full_rows, :rem].copy_(flat_src[full_rows * s :])
            dst_rows[full_rows, rem:].zero_()
            dst_rows[full_rows + 1 :].zero_()
        else:
            dst_rows[full_rows:].zero_()


def copy_into_chunks(pairs, extra=()) -> None:
    """Batched copy-in for a gather: each ``(chunk, source)`` pair's 1-D source into the head of its chunk and the
    chunk's padding after it zeroed; one foreach copy (the ``extra`` ``(destination, source)`` pairs in it too) and
    one foreach zero where any chunk has padding."""
    dsts, srcs, tails = [dst for dst, _ in extra], [src for _, src in extra], []
    for chunk, source in pairs:
        n = source.numel()
        if n:
            dsts.append(chunk[:n])
            srcs.append(source)
        if n < chunk.numel():
            tails.append(chunk[n:])
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    if tails:
        torch._foreach_zero_(tails)


def copy_from_rows(
    flat_dst: torch.Tensor, src_rows: torch.Tensor, layout: ShardLayout, skip_rank: int | None = None
) -> None:
    """Copy-out: the inverse of :func:`copy_padded_rows`, dropping the padding.

    ``skip_rank``: leave that rank's region alone (it already holds those values).
    """
    s = layout.shard_numel
    if s == 0:
        return
    full_rows, rem = divmod(layout.numel, s)
    spans = (
        [(0, full_rows)]
        if skip_rank is None or skip_rank >= full_rows
        else [(0, skip_rank), (skip_rank + 1, full_rows)]
    )
    for a, b in spans:
        if b > a:
            flat_dst[a * s : b * s].view(b - a, s).copy_(src_rows[a:b])
    if rem and skip_rank != full_rows:
        flat_dst[full_rows * s :].copy_(src_rows[full_rows, :rem])
