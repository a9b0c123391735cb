"""One parameter's sharded/unsharded lifecycle at stage 3 (ZeRO paper, section 5.3).

[Note: stage-3 parameter storage]
The ``nn.Parameter`` object never changes.  Between uses ``param.data`` is this
rank's 1-D shard (its valid region, in the storage dtype: the master dtype when
``param_dtype`` is lower).  While its unit is gathered, ``param.data`` is
``unsharded``: a full-shape tensor in ``param_dtype`` whose *storage object is
kept for the whole training run*; releasing resizes that storage to 0 bytes and
gathering resizes it back and refills it.  Autograd may have saved views of the
unsharded tensor in forward (``weight.t()`` in ``F.linear``); keeping the storage
object alive and refilling it before backward keeps those views valid, and
freeing by resize keeps the memory bounded.  On CPU the memory is lent instead of resized: swapped in
from the engine's ``StoragePool`` and back ([Note: lent storage] in storage_pool.py), the same storage
object either way.  Writes go through ``.data`` aliases
so that autograd's version counters are untouched (the data is the same values).

[Note: uses outside the unit]
A parameter used outside its unit's forward without ``zp.gathered_parameters`` (a
regulariser on ``blocks[0].fc.weight``) computes on the 1-D shard.  Autograd keeps one
gradient accumulator per parameter and checks gradients against the shape the parameter
had when the accumulator was made, so left alone that use fails in backward with
autograd's "invalid gradient ... got [105]", which names neither the parameter nor the
fix.  Each switch of ``param.data`` therefore also drops the accumulator (autograd makes
a new one, with the current shape, at the next use; graphs already built keep theirs):
the outside use then reaches the parameter as a gradient of the shard's shape, which
``Stage3Runtime.pre_accumulate`` turns into an error naming the parameter and
``zp.gathered_parameters``.  A use inside ``zp.gathered_parameters`` gets its own accumulator
too, which may fire after the unit resharded: for that gradient ``param.data`` is lent the
full shape (``lend_full_shape``; autograd lays the gradient out like the data), and the
gradient is reduced as a late one.  Not caught: a 1-element parameter at world size > 1 (its
shard has the full shape).  Autograd drops an accumulator only when the dtype or device of
``.data`` changes, hence the swap through a 0-element tensor of another dtype.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from ..optim.offload import pin, to_device
from ..tensors.flat import ShardLayout, copy_from_rows, copy_into_chunks
from .storage_pool import StoragePool

__all__ = ["ShardedParam", "ShardedState"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"  # param.data is the local shard; unsharded storage is 0 bytes
    UNSHARDED = "unsharded"  # param.data is the full tensor


class ShardedParam:
    """Owns one parameter's local shard, its reusable unsharded storage and its shard gradient."""

    __slots__ = (
        "param",
        "name",
        "layout",
        "shape",
        "local",
        "unsharded",
        "sharded_grad",
        "state",
        "lent",
        "storage_pool",
        "husk",
        "__weakref__",
    )

    def __init__(
        self,
        param: nn.Parameter,
        name: str,
        full: torch.Tensor,
        layout: ShardLayout,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        storage_device: torch.device | None = None,
    ) -> None:
        self.param = param
        self.name = name
        self.layout = layout
        self.shape = tuple(full.shape)
        # ``storage_device``: the host with offload_params (the shard is copied in for each gather).
        region = layout.local_view(full.detach().contiguous())
        self.local = pin(region.to(device=storage_device or full.device, dtype=storage_dtype, copy=True))
        self.unsharded = torch.empty(self.shape, dtype=compute_dtype, device=full.device)
        # [Note: lent storage] in storage_pool.py: set by the engine; None = grow and shrink by resize_
        self.storage_pool: StoragePool | None = None
        self.husk: torch.UntypedStorage | None = None
        self._free_unsharded()
        self.sharded_grad: torch.Tensor | None = None
        self.state = ShardedState.SHARDED
        self.lent = False  # param.data lent the full shape for one accumulation: lend_full_shape
        self._set_data(self.local)

    # -- transitions ----------------------------------------------------------
    def to_unsharded(self, rows: torch.Tensor, layout: ShardLayout | None = None) -> None:
        """Fill the full tensor from gathered ``(world_size, shard_numel)`` rows and expose it; ``layout``: the
        rows' own layout when it is not the shard's (hpZ's secondary shards, stage3/secondary.py)."""
        assert self.state is ShardedState.SHARDED, f"{self.name}: to_unsharded from {self.state}"
        self._alloc_unsharded()
        copy_from_rows(self.unsharded.data.view(-1), rows, layout or self.layout)
        self._set_data(self.unsharded)
        self.state = ShardedState.UNSHARDED

    @staticmethod
    def all_to_unsharded(
        params: list[ShardedParam], layouts: list[ShardLayout], rows: torch.Tensor, trailer: int
    ) -> torch.Tensor:
        """Copy-out of a unit's all-gather, batched: ``rows`` is ``(world_size, width + trailer)``, the params'
        padded chunks side by side (in order, ``shard_numel`` of their ``layouts`` each: the shard's, or hpZ's
        secondary one), then ``trailer`` columns; every param's full tensor is filled and exposed.  One
        ``split_with_sizes_copy`` of the whole rows (the trailer into a small tensor of its own) straight into
        the full tensors when no param is padded (FSDP2's copy-out), else one foreach copy of the valid spans.
        Returns the trailer columns."""
        for sp in params:
            assert sp.state is ShardedState.SHARDED, f"{sp.name}: to_unsharded from {sp.state}"
            sp._alloc_unsharded()
        n, width = rows.shape[0], rows.shape[1] - trailer
        trailing = rows[:, width:]
        sizes = [layout.shard_numel for layout in layouts]
        if all(layout.numel == layout.padded_numel for layout in layouts):
            outs = [sp.unsharded.data.view(n, size) for sp, size in zip(params, sizes)]
            if trailer:
                trailing = torch.empty(n, trailer, dtype=rows.dtype, device=rows.device)
                outs, sizes = outs + [trailing], sizes + [trailer]
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)
        else:
            dsts, srcs, offset = [], [], 0
            for sp, layout in zip(params, layouts):
                columns = rows[:, offset : offset + layout.shard_numel]
                _valid_spans(sp.unsharded.data.view(-1), columns, layout, dsts, srcs)
                offset += layout.shard_numel
            torch._foreach_copy_(dsts, srcs)
        for sp in params:
            sp._set_data(sp.unsharded)
            sp.state = ShardedState.UNSHARDED
        return trailing

    def open_unsharded(self) -> torch.Tensor:
        """In-place gather, first half: allocate the full tensor, write this rank's region into it and
        return its flat view; other ranks' regions are filled by the caller's collective, then
        :meth:`expose` makes it the parameter's data."""
        assert self.state is ShardedState.SHARDED, f"{self.name}: open_unsharded from {self.state}"
        self._alloc_unsharded()
        flat = self.unsharded.data.view(-1)
        self.layout.local_view(flat).copy_(self.local)
        return flat

    def adopt_local(self, view: torch.Tensor) -> None:
        """Move the shard into ``view`` (its place in the unit's flat shard, [Note: flat shards] in unit.py)
        and keep it there: ``local`` and, while sharded, ``param.data`` become that view."""
        assert self.state is ShardedState.SHARDED and not self.lent, f"{self.name}: adopt_local while {self.state}"
        assert view.shape == self.local.shape and view.dtype == self.local.dtype, f"{self.name}: flat shard mismatch"
        view.copy_(self.local)
        self.local = view
        self._set_data(view)

    def expose(self) -> None:
        self._set_data(self.unsharded)
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        assert self.state is ShardedState.UNSHARDED, f"{self.name}: to_sharded from {self.state}"
        self._set_data(self.local)
        self._free_unsharded()
        self.state = ShardedState.SHARDED

    def lend_full_shape(self) -> None:
        """While SHARDED, let autograd accumulate a full-shape gradient: it lays ``param.grad`` out like
        ``param.data``, so ``param.data`` is the (0-byte) unsharded tensor until :meth:`end_lend`."""
        self.param.data = self.unsharded
        self.lent = True

    def end_lend(self) -> None:
        if self.lent:
            self.lent = False
            self.param.data = self.local

    def _set_data(self, data: torch.Tensor) -> None:
        """``param.data = data`` and a fresh gradient accumulator: [Note: uses outside the unit]."""
        if self.param.requires_grad:
            self.param.data = _other_dtype_husk(self.param.dtype, self.param.device)
        self.param.data = data

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        nbytes = self.layout.numel * self.unsharded.element_size()
        if self.storage_pool is None or self.husk is not None or storage.nbytes() or not nbytes:
            storage.resize_(nbytes)
        else:
            self.husk = self.storage_pool.lend(storage, nbytes)

    def _free_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        if self.husk is not None:
            husk, self.husk = self.husk, None
            self.storage_pool.take_back(storage, husk)
        else:
            storage.resize_(0)

    # -- data movement ----------------------------------------------------------
    def copy_local_into(self, dst: torch.Tensor) -> None:
        """Copy-in for the all-gather: the local shard (cast to the compute dtype) into ``dst``; from the
        host (offload_params) without blocking ([Note: asynchronous host copies] in optim/offload.py)."""
        to_device(dst[: self.local.numel()], self.local)
        if self.local.numel() < dst.numel():
            dst[self.local.numel() :].zero_()

    @staticmethod
    def copy_locals_into(members: list[ShardedParam], chunks: list[torch.Tensor], extra: list = ()) -> None:
        """Copy-in for a unit's all-gather, batched: the local shards into their chunks and the ``extra``
        (destination, source) pairs (the gather tag) in one foreach copy (cast to the compute dtype), the
        padding after them zeroed in one more; shards on the host (offload_params) one by one, without
        blocking (:meth:`copy_local_into`)."""
        on_device = []
        for sp, chunk in zip(members, chunks):
            if sp.local.device != chunk.device:
                sp.copy_local_into(chunk)
            else:
                on_device.append((chunk, sp.local))
        copy_into_chunks(on_device, extra)

    @torch.no_grad()
    def write_full_into_local(self, full: torch.Tensor) -> None:
        """Take this rank's region of an edited full tensor (load, gathered edit)."""
        self.local.copy_(self.layout.local_view(full.detach().reshape(-1).contiguous()))

    def keep_reduced(self, reduced: torch.Tensor, row: torch.Tensor | None) -> None:
        """Store a reduction's result: a view of ``row`` (the unit's reduced row, fresh for this reduction and
        no one else's) becomes the shard gradient as it is, with no copy, when there is none yet and its
        dtype and device are the shard's ([Note: reduced rows kept] in unit.py); otherwise (also without a
        row: in place, qgZ, shards on the host) :meth:`accumulate_grad`."""
        if (
            self.sharded_grad is None
            and row is not None
            and reduced._base is row
            and reduced.dtype == self.local.dtype
            and reduced.device == self.local.device
        ):
            self.sharded_grad = reduced
        else:
            self.accumulate_grad(reduced)

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        if self.sharded_grad is None:
            # To the host (offload_params): non-blocking into pinned memory, complete after the engine's
            # synchronize_copies ([Note: asynchronous host copies] in optim/offload.py).
            self.sharded_grad = reduced.to(
                device=self.local.device, dtype=self.local.dtype, copy=True, non_blocking=True
            )
        else:  # accumulation on the host reads the copy at once: a blocking copy
            self.sharded_grad.add_(reduced.to(device=self.local.device, dtype=self.local.dtype))


_HUSKS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _other_dtype_husk(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-element tensor of a dtype other than ``dtype`` on ``device``, made once: switching ``.data`` through it
    drops the gradient accumulator ([Note: uses outside the unit]); no allocation per switch (issue #39)."""
    key = (dtype, device)
    husk = _HUSKS.get(key)
    if husk is None:
        other = torch.float32 if dtype == torch.float16 else torch.float16
        husk = _HUSKS[key] = torch.empty(0, dtype=other, device=device)
    return husk


def _valid_spans(flat: torch.Tensor, columns: torch.Tensor, layout: ShardLayout, dsts: list, srcs: list) -> None:
    """The (destination, source) pairs that copy ``columns`` (``(world_size, shard_numel)``, padded) into a full
    flat tensor: the whole rows, then the valid prefix of the partial one (``copy_from_rows``' spans)."""
    s = layout.shard_numel
    full_rows, rem = divmod(layout.numel, s)
    if full_rows:
        dsts.append(flat[: full_rows * s].view(full_rows, s))
        srcs.append(columns[:full_rows])
    if rem:
        dsts.append(flat[full_rows * s :])
        srcs.append(columns[full_rows, :rem])
