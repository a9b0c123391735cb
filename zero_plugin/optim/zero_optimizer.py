"""``ZeroOptimizer``: the user's optimizer, rebound to this rank's masters.

It *is* a ``torch.optim.Optimizer`` (LR schedulers, Accelerate and Lightning
check that) whose ``param_groups`` and ``state`` are the wrapped optimizer's own
objects: changing ``lr`` on either changes both.  See [Note: masters] in
``master.py`` for what the groups hold.

[Note: configured clipping] ``ZeroConfig.clip_grad_norm`` is exactly ``torch.nn.utils.clip_grad_norm_``
(global norm over every rank's shard, true fp16 gradients) called right before ``step()``.  An explicit
``zp.clip_grad_norm_`` earlier in the step does not replace it: both apply, in that order, as two
torch calls would (so the smaller bound wins, and the user's call still returns the unclipped norm).
The inf/NaN check then reuses the configured clip's norm instead of reading the gradients again.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

from ..tensors.phases import phase
from .blocked_step import BlockedStep
from .clip import clip_owned_grads
from .cpu_step import fused_cpu_step
from .loss_scale import GradGuard, scaler_state_problem
from .state import class_mismatch, consolidate_optimizer_state, optimizer_class, shard_optimizer_state
from .whole_params import WholeParams

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(torch.optim.Optimizer):
    """Steps this rank's shard with the wrapped optimizer, then lets the engine re-sync parameters."""

    def __init__(
        self, inner: torch.optim.Optimizer, engine: Any, whole: WholeParams | None = None, slots: list | None = None
    ) -> None:
        # Optimizer.__init__ would re-register the params; we share the inner ones instead.
        self.inner = inner
        self.engine = engine
        # the engine's slots this optimizer steps: all of them, or its own with several optimizers over one model
        # ([Note: several optimizers] in engines/engine.py)
        self.slots = engine.slots if slots is None else slots
        self._subset = None if slots is None or len(slots) == len(engine.slots) else slots
        # [Note: optimizer partitions] in partition.py: None steps the element partition's region masters
        self.whole = whole
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        cfg = engine.config
        scaling = cfg.scales_loss
        fixed = cfg.precision.loss_scale if scaling and not isinstance(cfg.precision.loss_scale, str) else None
        self.guard = GradGuard(
            engine,
            dynamic_scale=scaling and cfg.precision.loss_scale == "dynamic",
            fixed_scale=fixed,
            init_scale=cfg.precision.loss_scale_init,
            growth_interval=cfg.precision.loss_scale_growth_interval,
        )
        # [Note: cache-blocked offload step]: with offload, separate host masters are stepped block by block,
        # gradients cast in (CPU-only) or waited for (CUDA) and masters written back on the way.
        self.offloaded = cfg.offload.optimizer == "cpu"
        wants_blocked = self.offloaded and whole is None and BlockedStep.wanted(self.slots)
        self.blocked = BlockedStep(self.slots) if wants_blocked else None

    @property
    def partition(self) -> str:
        """``"elements"`` or ``"parameters"`` ([Note: optimizer partitions] in partition.py)."""
        return "elements" if self.whole is None else "parameters"

    # param_groups/state are properties so that both views always agree.
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.engine.config.stage}, inner={self.inner!r})"

    def __getstate__(self):
        raise TypeError("ZeroOptimizer holds process-group state; save with zp.save_checkpoint or state_dict()")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with phase("optimizer_step"):  # [Note: profiler phases] in tensors/phases.py
            self._step()
        return loss

    def _step(self) -> None:
        """Clip, check, step (the partition's way) and hand the updated masters back to the engine."""
        self._clip_configured()
        if not self.guard.should_step():
            self.engine.zero_grad(set_to_none=True)  # the skipped step's gradients are discarded
            return
        if self.whole is not None:
            self.engine.before_step(slots=self._subset)
            self._step_whole()
            self.engine.after_step(self._subset)
            return
        blocked = self.blocked is not None and self.blocked.applies(self.inner)
        pipelined = not blocked and self.engine.can_step_pipelined(self.inner)
        self.engine.before_step(blocked=blocked, slots=self._subset)
        if blocked:
            self.blocked.step(self.inner)
        elif pipelined:  # [Note: pipelined step]: the step and after_step, bucket by bucket
            self.engine.step_pipelined(self.inner)
            return
        elif not (self.offloaded and fused_cpu_step(self.inner)):  # [Note: direct fused step]
            self.inner.step()
        self.engine.after_step(self._subset)

    def _step_whole(self) -> None:
        """The parameter partition's step; an error inside the user's optimizer is re-raised saying what it saw."""
        try:
            self.whole.step(self.inner)
        except Exception as exc:
            raise type(exc)(
                f"{exc}\n(zero_plugin: {optimizer_class(self.inner)}.step() ran under ZeroConfig.optimizer_partition="
                "'parameters': this rank stepped the whole parameters it owns, in their real shapes, with their "
                "full reduced gradients; the parameters other ranks own have no gradient here)"
            ) from exc

    def _clip_configured(self) -> None:
        """``ZeroConfig.clip_grad_norm``, if set, applied before the check ([Note: configured clipping])."""
        max_norm = self.engine.config.precision.clip_grad_norm
        if max_norm is not None:
            self.guard.unscale()
            clip_owned_grads(self.engine, max_norm)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank had an inf/NaN gradient."""
        return self.guard.skipped_steps

    @property
    def loss_scale(self) -> float:
        return self.guard.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` under fp16 dynamic loss scaling, else ``loss``: call ``.backward()`` on the result."""
        return self.guard.scale_loss(loss)

    def unscale_(self) -> None:
        """Unscale the gradients now (e.g. before inspecting them); ``clip_grad_norm_`` does it itself."""
        self.guard.unscale()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none, self._subset)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "ZeroOptimizer.add_param_group: add every param group before zp.setup (the parameters must be "
            "sharded together with the model)"
        )

    # -- state dicts --------------------------------------------------------
    # Both forms carry a "zero_plugin" record: the wrapped optimizer's class (checked on load) and the loss
    # scaler's state ([Note: scaler state] in loss_scale.py).  torch's own load_state_dict ignores the key.
    def _record(self) -> dict:
        return {"optimizer_class": optimizer_class(self.inner), "grad_guard": self.guard.state_dict()}

    @contextlib.contextmanager
    def element_view(self) -> Iterator[None]:
        """Collective in the parameter partition: inside, the wrapped optimizer holds the element partition's
        region masters and state, the form checkpoints and full state dicts are read from and written to
        ([Note: the element view of parameter-partition state] in whole_params.py)."""
        if self.whole is None:
            yield
            return
        with self.whole.element_view(self.inner):
            yield

    def state_dict(self) -> dict:
        """This rank's shard: the wrapped optimizer's state dict plus a ``zero_plugin`` record (layout, class,
        loss scaler)."""
        sd = self.inner.state_dict()
        sd["zero_plugin"] = {**self.engine.shard_metadata(), "partition": self.partition, **self._record()}
        return sd

    def consolidate_state_dict(self, to_rank: int | None = 0) -> dict:
        """Collective: the state dict an unsharded optimizer would have (full-shape tensors, on CPU), plus
        the ``zero_plugin`` record (class, loss scaler).

        Ranks other than ``to_rank`` get ``{}`` (``to_rank=None``: every rank gets it).
        """
        with self.element_view():
            full = consolidate_optimizer_state(self, to_rank)
        if full:
            full["zero_plugin"] = {"sharded": False, **self._record()}
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from ``consolidate_state_dict`` or an unsharded optimizer) or this rank's shard.
        Everything is checked before anything changes."""
        meta = state_dict.get("zero_plugin") or {}
        self._check_record(meta)
        if meta.get("sharded", False):
            self.engine.check_shard_metadata(meta)
            saved = meta.get("partition", "elements")
            if saved == "parameters" and self.whole is None:
                raise ValueError(
                    "ZeroOptimizer.load_state_dict: this shard was saved under optimizer_partition='parameters' "
                    "(whole parameters on their owners) and this optimizer steps regions ('elements'); load a full "
                    "state dict (consolidate_state_dict) or use zp.save_checkpoint / zp.load_checkpoint, which "
                    "convert between partitions"
                )
            inner_sd = {k: v for k, v in state_dict.items() if k != "zero_plugin"}
            # an element-partition shard into the parameter partition: loaded in its own form, then assembled
            view = self.element_view() if saved == "elements" else contextlib.nullcontext()
            with view:
                self.inner.load_state_dict(inner_sd)
        else:
            owns = None if self.whole is None else self.whole.owns
            self.inner.load_state_dict(shard_optimizer_state(self, state_dict, owns))
        if "grad_guard" in meta:  # absent from plain torch dicts and from dicts saved before it was recorded
            self.guard.load_state_dict(meta["grad_guard"])

    def _check_record(self, meta: dict) -> None:
        verb = "ZeroOptimizer.load_state_dict"
        error = class_mismatch(
            meta.get("optimizer_class"),
            self.inner,
            verb,
            "or leave the optimizer state out and start this optimizer fresh",
        )
        if error is None and "grad_guard" in meta and (problem := scaler_state_problem(meta["grad_guard"])):
            error = f"{verb}: malformed loss-scaler record zero_plugin.grad_guard: {problem}"
        if error is not None:
            raise ValueError(error)
