"""Stage 3 under ``zp.no_sync`` with ``ZeroConfig.accumulate_full_grads``: full gradients kept, reduced once.

[Note: deferred reduction]
By default a stage-3 backward under ``no_sync`` still reduce-scatters every unit and the shard gradients
accumulate: no extra memory, but A reduce-scatters per optimizer step of A micro-batches.  With
``accumulate_full_grads`` (FSDP2's ``set_requires_gradient_sync(False)``) a unit's reduction still takes
its turn in the agreed order ([Note: rank-agreed reduction order] in ``grads/schedule.py``) and the unit
is released as after a reduction, but nothing is sent: each trainable parameter's full gradient is added
into a flat tensor kept here, in the reduce dtype (``ZeroConfig.effective_reduce_dtype``, else the
gradient's), and ``param.grad`` is dropped so the next micro-batch's backward starts a fresh one.  The
first synced backward's reduction of the unit sends the kept sum plus that backward's gradient
(:meth:`FullGradStore.grad_of`, read by ``comm_layout``'s reductions), so every unit is reduce-scattered
once per optimizer step; its has-gradient flag is 1 where any micro-batch gave the parameter a gradient
on this rank, as under DDP's ``no_sync``.  Late gradients (a parameter reused across reentrant
checkpoint segments) are deferred again at the end of backward and added.

Memory: the full gradients of every trained unit, Ψ × reduce-dtype bytes per rank (4Ψ in fp32), from the
first ``no_sync`` backward to the synced one; ``zp.memory_report`` counts them as gradients and
``zero-plugin estimate --accum`` shows them.  ``zero_grad`` discards them.  Clipping or stepping while
gradients are kept (no synced backward since the ``no_sync`` ones) raises: they would be missing from the
norm and the update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .param import ShardedParam
    from .unit import Unit

__all__ = ["FullGradStore"]


class FullGradStore:
    """The full gradients kept between ``no_sync`` backwards, by parameter ([Note: deferred reduction])."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}  # id(ShardedParam) -> flat full gradient, reduce dtype

    @torch.no_grad()
    def defer(self, unit: Unit) -> list:
        """The unit's reduction turn under ``no_sync``: keep its gradients, send nothing."""
        for sp in unit.trainable:
            grad = sp.param.grad
            if grad is None:
                continue
            flat = grad.detach().reshape(-1)
            dtype = unit.reduce_dtype or flat.dtype
            kept = self.kept.get(id(sp))
            if kept is None:  # autograd's param.grad is ours alone: kept as it is when no cast is needed
                self.kept[id(sp)] = flat if flat.dtype == dtype else flat.to(dtype)
            else:
                kept.add_(flat)
            sp.param.grad = None
        return unit.defer_reduce()

    @torch.no_grad()
    def grad_of(self, sp: ShardedParam) -> torch.Tensor | None:
        """The gradient a reduction of ``sp`` sends: the kept sum plus this backward's, handed over (the
        reduction holds it until it completes)."""
        kept = self.kept.pop(id(sp), None)
        grad = sp.param.grad
        if kept is None:
            return grad
        if grad is not None:
            kept.add_(grad.detach().reshape(-1))
        return kept

    def check_reduced(self, verb: str) -> None:
        if self.kept:
            raise RuntimeError(
                f"zero_plugin: {verb} with gradients still kept by zp.no_sync (ZeroConfig.accumulate_full_grads): "
                "they are reduced by the first backward outside no_sync, and none ran since. Run the last "
                "micro-batch's backward outside zp.no_sync before clipping and stepping, or call zero_grad() to "
                "discard them."
            )

    def discard(self) -> None:
        self.kept.clear()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.kept.values())
