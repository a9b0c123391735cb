"""What the wrapped optimizer steps: one :class:`MasterParam` per trainable parameter.

[Note: masters]
The user's optimizer is rebound from the model's parameters to *masters*:
  * stage 0, same dtype: the master is the parameter itself (plain DDP);
  * stages 1-2, same dtype: a 1-D view of this rank's owned region of the
    full parameter (no copy: an update of the master is an update of the
    parameter, and the all-gather after the step refreshes the other regions);
  * stage 3, same dtype: the parameter, whose data already is the shard;
  * any stage, ``param_dtype`` lower than ``master_dtype``: a separate tensor
    in ``master_dtype`` (fp32 master weights), written back (cast) after each step.
The grad the optimizer sees is set by :meth:`MasterParam.set_grad` from the
reduced gradient of the owned region.

[Note: gathered edits] ``zp.gathered_parameters(..., modifier_rank=r)`` hands the user the parameters
in ``param_dtype``; the masters behind them (fp32 masters, stage-3 fp32 shards, host masters) hold more
precision.  Copying the edited low-precision values back wholesale would round every master to
``param_dtype``.  So each rank keeps the gathered values of its own region from the block's entry
(``before``), and on exit only the elements whose broadcast value (``now``) differs from it are
written into ``dst`` (:func:`copy_changed`): unedited elements stay bit for bit, an edit of part of a tensor reaches exactly
those elements.  Per element rather than per tensor, so a partial edit does not round the rest of the
tensor.  An edit that writes back the value already there (in ``param_dtype``) is invisible, and
leaves the more precise master as it was.  NaN to NaN counts as unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensors.flat import ShardLayout
from ..tensors.phases import phase
from .offload import copy_done, pin, to_device, to_host

__all__ = ["MasterParam", "copy_changed"]


@torch.no_grad()
def copy_changed(dst: torch.Tensor, now: torch.Tensor, before: torch.Tensor) -> None:
    """Write into ``dst`` the elements of ``now`` that differ from ``before`` ([Note: gathered edits])."""
    now, before = now.reshape(dst.shape), before.reshape(dst.shape)
    changed = now != before
    if now.is_floating_point():
        changed &= ~(now.isnan() & before.isnan())
    if changed.any():
        dst.copy_(torch.where(changed.to(dst.device), now.to(device=dst.device, dtype=dst.dtype), dst))


class MasterParam:
    """One trainable parameter as the optimizer sees it on this rank."""

    __slots__ = (
        "name",
        "param",
        "layout",
        "local",
        "master",
        "separate",
        "host_grad",
        "deferred_grad",
        "grad_ready",
        "written_back",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        layout: ShardLayout,
        local: torch.Tensor,
        master_dtype: torch.dtype | None,
        source: torch.Tensor | None = None,
        master_device: torch.device | None = None,
    ) -> None:
        self.name = name
        self.param = param
        self.layout = layout  # where the owned region sits in the flattened parameter
        self.local = local  # view of param data holding the owned region
        dtype = master_dtype or local.dtype
        device = master_device or local.device
        self.separate = dtype != local.dtype or device != local.device
        self.host_grad: torch.Tensor | None = None  # pinned, allocated at the first offloaded gradient
        # [Note: cache-blocked offload step] in blocked_step.py: the gradient it casts block by block, the
        # event it waits for before reading a host gradient copy, whether it already wrote the master back.
        self.deferred_grad: torch.Tensor | None = None
        self.grad_ready = None
        self.written_back = False
        if self.separate:
            # ``source``: the region before the parameter was cast down, so no precision is lost.
            init = local if source is None else source
            data = pin(init.detach().to(device=device, dtype=dtype, copy=True).reshape(local.shape))
            self.master = nn.Parameter(data, requires_grad=True)
        elif local is param:
            self.master = param
        else:
            self.master = nn.Parameter(local, requires_grad=True)

    @property
    def is_identity(self) -> bool:
        """True when the optimizer steps the model's own parameter object."""
        return self.master is self.param

    def set_grad(self, grad: torch.Tensor | None, blocked: bool = False) -> None:
        """Give the master its gradient.  ``blocked``: the blocked step follows ([Note: cache-blocked offload
        step]): a separate master on the gradient's own device gets no fp32 copy (the step casts it piece by
        piece), and a host copy is marked with an event for the step to wait for, instead of being waited for."""
        self.deferred_grad = None
        self.grad_ready = None
        self.written_back = False  # a step that raised part-way must not make the next write_back skip
        if self.is_identity:
            return  # autograd/reducer already left the reduced grad in param.grad
        if grad is None:
            self.master.grad = None
        elif grad.device != self.master.device:  # offload: [Note: asynchronous host copies] in offload.py
            if self.host_grad is None:
                self.host_grad = pin(torch.empty(self.master.shape, dtype=self.master.dtype, device=self.master.device))
            with phase("offload_to_host"):  # [Note: profiler phases]
                self.master.grad = to_host(self.host_grad, grad)
            if blocked:
                self.grad_ready = copy_done(grad.device)
        elif blocked and self.separate:
            self.master.grad = None
            self.deferred_grad = grad
        elif self.separate or grad.dtype != self.master.dtype:
            self.master.grad = grad.to(device=self.master.device, dtype=self.master.dtype, non_blocking=True)
        else:
            self.master.grad = grad

    @torch.no_grad()
    def write_back(self) -> None:
        """After a step: copy an fp32 master into the (lower precision) parameter region."""
        if self.written_back:  # the blocked step already did, block by block
            self.written_back = False
            return
        if self.separate:
            with phase("offload_to_device" if self.local.device != self.master.device else "master_write_back"):
                to_device(self.local, self.master)

    def snapshot(self) -> torch.Tensor | None:
        """This rank's region as the parameter holds it, for :meth:`take_edits` (None: the master is that
        region, nothing to reconcile)."""
        return self.local.detach().clone() if self.separate else None

    @torch.no_grad()
    def take_edits(self, before: torch.Tensor | None) -> None:
        """After a gathered edit: only the changed elements of the region reach the master
        ([Note: gathered edits])."""
        if before is not None:
            copy_changed(self.master, self.local, before)

    @torch.no_grad()
    def refresh_from_param(self) -> None:
        """After the parameter was overwritten (load, gathered edit): resync the master."""
        if self.separate:
            self.master.copy_(self.local)
