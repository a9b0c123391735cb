"""Stage 3 for evaluation only: a model nothing trains (a DPO reference, a distillation teacher, a reward
model) sharded like a trained one, with a forward-only runtime.

[Note: evaluation-only models]
``zp.setup(model, None, config)`` at stage 3 (and Accelerate's ``prepare_model(m, evaluation_mode=True)``
or ``prepare`` of a model without trainable parameters) shards every parameter 1/N exactly as training
does (same units, same in-place gathers), but builds no master, gradient, reduction or optimizer state
and registers no autograd hook: only the module forward hooks that gather a unit before its forward and
release it after (``InferenceRuntime``).  Every rank's forward is collective, as at training time.

A forward is always run without autograd: the weights of a unit are released as soon as its forward
returns, so backward could not read them.  The outermost entry turns grad mode off for the duration of
the forward (the outputs do not require grad, as under ``torch.no_grad()``) and restores it on exit,
also on an exception.  An input that requires grad (a gradient expected to flow back through the model
into the caller's graph) is refused with an error naming the fix, rather than silently cut.
``torch.inference_mode()`` works as well.  ``requires_grad`` flags are left as they are, so the same
model can later be set up for training: ``zp.setup(model, optimizer, config)`` on an evaluation-only
model first gathers its parameters back into full tensors (``InferenceEngine.release_full``; every
rank then holds the full model once, as before the first setup) and shards it again for training.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .engine import Stage3Engine
from .hooks import Stage3Runtime

__all__ = ["InferenceEngine", "InferenceRuntime"]


class InferenceRuntime(Stage3Runtime):
    """Forward hooks only: gather a unit before its forward, release it after ([Note: evaluation-only models])."""

    _outer_grad: bool | None = None  # grad mode of the caller of the outermost entry, restored on exit

    def register(self) -> None:
        for m in self._root_entries():
            self._handles.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._root_post, always_call=True))
        for unit in self.units[1:]:
            m = unit.module
            self._handles.append(
                m.register_forward_pre_hook(functools.partial(self.pre_forward, unit), with_kwargs=True)
            )
            self._handles.append(m.register_forward_hook(functools.partial(self.post_forward, unit)))
        self._register_direct_reads()

    def _root_pre(self, module, args, kwargs):
        if self._root_depth == 0:
            grad = torch.is_grad_enabled()
            if grad:
                _refuse_inputs_needing_grad(module, args, kwargs)
            self._outer_grad = grad
            torch._C._set_grad_enabled(False)
        return super()._root_pre(module, args, kwargs)

    def _root_post(self, module, args, output):
        if self._outer_grad is None:  # the entry was refused before anything was gathered
            return None
        try:
            return super()._root_post(module, args, output)
        finally:
            if self._root_depth == 0:
                torch._C._set_grad_enabled(self._outer_grad)
                self._outer_grad = None


def _refuse_inputs_needing_grad(module: nn.Module, args, kwargs) -> None:
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"zero_plugin: this {type(module).__name__} was set up for evaluation only (stage 3 without an "
                f"optimizer), so its forward runs without autograd (each block's weights are released after its "
                f"forward), but an input of shape {tuple(t.shape)} requires grad; a gradient could not flow back "
                f"through the model. Detach the inputs (or call it under torch.no_grad()), or set the model up for "
                f"training with zp.setup(model, optimizer, config)"
            )


class InferenceEngine(Stage3Engine):
    """A stage-3 engine without slots, gradients or optimizer ([Note: evaluation-only models])."""

    runtime_type = InferenceRuntime
    optimizer = None

    @torch.no_grad()
    def release_full(self) -> None:
        """Collective: every parameter back to a full tensor (one unit gathered at a time), hooks removed."""
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            unit.unshard()
            unit.tag_checks.flush()  # [Note: gather tag] in unit.py
            for sp in unit.params:
                full[id(sp)] = sp.param.data.clone()
            unit.reshard()
        self.remove()
        for sp in self.sharded.values():
            sp.param.data = full[id(sp)]

    def remove(self) -> None:
        super().remove()
