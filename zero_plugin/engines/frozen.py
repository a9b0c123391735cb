"""Parameters frozen when ``zp.setup`` ran must stay frozen while the engine drives the model.

[Note: frozen at setup]
Setup builds gradient buckets (stages 0-2), units' reductions (stage 3), masters and optimizer state for
the parameters that require grad at that moment, and nothing for the others (stage 3 stores those in
``param_dtype`` without a master).  A parameter unfrozen later would get a gradient that no collective
reduces and no optimizer steps: stages 0-2 would silently not train it, stage 3 would hand autograd a
full gradient for a sharded parameter.  The root forward pre-hook below refuses it on the first forward
with grad enabled after the unfreeze, before any collective (every rank raises, nothing hangs when all
ranks unfroze the same parameters).  Its cost is one ``requires_grad`` read per frozen parameter per
root forward.  The other way round is fine: a parameter frozen after setup gets no gradient, which the
reductions already treat as an unused parameter (skipped by the optimizer, as single-process training).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FrozenGuard"]


class FrozenGuard:
    """Raises when a parameter that was frozen at setup requires grad in a forward with grad enabled."""

    def __init__(self, frozen: list[tuple[str, nn.Parameter]]) -> None:
        self.frozen = frozen
        self.handle = None

    @classmethod
    def attach(cls, model: nn.Module, trained: list[nn.Parameter]) -> FrozenGuard | None:
        ids = {id(p) for p in trained}
        frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in ids]
        if not frozen:
            return None
        guard = cls(frozen)
        # prepend: runs before stage 3's root hook gathers anything
        guard.handle = model.register_forward_pre_hook(guard.check, prepend=True)
        return guard

    def check(self, module: nn.Module, args) -> None:
        if not torch.is_grad_enabled():
            return
        for name, p in self.frozen:
            if p.requires_grad:
                raise ValueError(
                    f"zero_plugin: parameter {name!r} was frozen (requires_grad=False) when zp.setup ran and "
                    "now requires grad; zp.setup prepared no gradient reduction, master or optimizer state for "
                    "it, so it cannot train. Set requires_grad=True before zp.setup (to hold it still until "
                    "later, put it in a param group with lr=0 and raise that lr when you unfreeze it), or build "
                    "the model again and call zp.setup after unfreezing; or set requires_grad=False again"
                )

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
