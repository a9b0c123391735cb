"""Non-finite gradients: dynamic loss scaling for fp16, and a guard for every precision.

fp16 (``param_dtype=float16``, or ``loss_scaling=True`` for fp32 parameters under an fp16-autocast forward):
scale the loss before backward (``optimizer.scale_loss(loss)``) so small gradients do not underflow;
before the step, unscale the owned gradients and check them on every rank.  If any rank saw inf/NaN,
*every* rank skips the step (the flag is all-reduced, so the decision is the same everywhere), halves the
scale, and training continues.  The scale doubles after
``growth_interval`` clean steps (the schedule of torch's GradScaler and DeepSpeed's dynamic scaler).

Other precisions: no scaling, but a NaN/inf gradient is reported (warning + ``skipped_steps``) and the
step is skipped, never silently applied.

[Note: scaler state] The scale, the clean-step count and the skip count are training state: a resumed
run that started again from the initial scale would re-skip the steps that backed it off and depart
from the uninterrupted run.  They travel in ZeroOptimizer.state_dict / consolidate_state_dict (under
"zero_plugin") and in zp.save_checkpoint's index.json (optimizer.grad_guard).  A record from a run
without dynamic scaling (or loaded into one) carries only the skip count over.
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["GradGuard", "UnscaleCheck", "scaler_state_problem", "unscale_checked"]


# [Note: finite check in the unscale]
# With loss scaling a step read every owned gradient twice: the unscale (a multiplication by 1/scale) and the
# inf/NaN check (a foreach norm, [Note: finite check in the average] in comm/layout.py has the cost).  torch's
# GradScaler does both in one pass, ``_amp_foreach_non_finite_check_and_unscale_``, and so does
# :func:`unscale_checked`: per device and dtype, a one-element float32 flag set where an element is inf/NaN.
# Only where the scale is a power of two (the dynamic scale always is: 2^16, halved and doubled): its float32
# inverse is exact, so every product is the correctly rounded one the Python-float ``mul_`` made before, in any
# dtype; another fixed scale keeps the multiplication, and the step reads the gradients as before.  The flags
# cover the gradients as the unscale left them (the same tensors at the same autograd versions): one written
# since (a clamp, a user's edit after ``opt.unscale_()``) sends the check back to reading them.
class UnscaleCheck:
    """The flags one unscale took and the gradients (with their versions) they speak for."""

    def __init__(self, flags: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.flags = flags
        self._grads = [(g, g._version) for g in grads]

    def covers(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` are the unscaled gradients, none written since."""
        return len(grads) == len(self._grads) and all(
            g is h and g._version == version for g, (h, version) in zip(grads, self._grads)
        )


def unscale_checked(grads: list[torch.Tensor], scale: float) -> UnscaleCheck | None:
    """Multiply ``grads`` by 1/``scale`` in place; where ``scale`` is a power of two, flag inf/NaN in the same
    pass and return the check ([Note: finite check in the unscale]), else None."""
    if math.frexp(scale)[0] != 0.5:  # not a power of two: x * float32(1/scale) could differ from x * (1/scale)
        inv = 1.0 / scale
        for g in grads:
            g.mul_(inv)
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (device, _), group in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        flags.append(found)
    return UnscaleCheck(flags, grads)


class GradGuard:
    def __init__(
        self,
        engine,
        dynamic_scale: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        growth: float = 2.0,
        fixed_scale: float | None = None,
    ) -> None:
        self.engine = engine
        self.scaling = dynamic_scale or fixed_scale is not None
        self.dynamic = dynamic_scale and fixed_scale is None
        self.scale = fixed_scale if fixed_scale is not None else (init_scale if dynamic_scale else 1.0)
        self.growth_interval = growth_interval
        self.backoff, self.growth = backoff, growth
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # By an fp32 tensor, as torch's GradScaler does: a 0-dim fp16/bf16 loss is promoted to fp32 rather
        # than overflowing (3.0 * 2**20 is no fp16 number); a loss with dimensions keeps its dtype, as there.
        if not self.scaling:
            return loss
        return loss * torch.tensor(self.scale, dtype=torch.float32, device=loss.device)

    @torch.no_grad()
    def unscale(self) -> None:
        """Divide the owned gradients by the scale once per step (clipping must see true gradients), taking the
        step's inf/NaN answer on the way where it can ([Note: finite check in the unscale]).  "Once" is the
        engine's per-step flag, which zero_grad clears with the gradients ([Note: per-step state] in
        engine.py): gradients of a later backward are scaled again."""
        if self.scaling and not self.engine.grads_unscaled:
            self.engine.note_unscaled(unscale_checked(self.engine.owned_grads(), self.scale))

    @torch.no_grad()
    def found_nonfinite(self) -> bool:
        """True if any rank holds an inf/NaN gradient (the same answer on every rank).

        Free when ``clip_grad_norm_`` ran this step: its norm is global, so every rank decides alike
        without communicating.  Otherwise the gradients' L2 norms, one foreach op per precision (a single
        read pass, one fused kernel on CUDA rather than one per gradient; an inf or NaN anywhere makes its
        norm non-finite, and a finite gradient overflows it only with an element past 1.8e19, whose square
        passes fp32's 3.4e38), summed, and that sum summed over the ranks (non-negative terms: an inf or NaN
        carries through every sum): four ops and one read of the host, where a flag filled from a first read
        and all-reduced by MAX took seven and two (issue #39).  L2, not L1: on the CPU torch's foreach L1
        norm runs about 5x slower than its L2 norm (69 against 13 ms for 50M fp32 elements), which made the
        step of a 374M model 150-250 ms slower than per-gradient sums had (benchmarks.ab at 370m).
        """
        if self.engine.step_nonfinite is not None:
            return self.engine.step_nonfinite
        norm = self.engine.step_grad_norm
        if norm is not None:
            return not math.isfinite(norm)
        check = self.engine.unscale_check  # [Note: finite check in the unscale]
        if check is not None and check.covers(self.engine.owned_grads()):
            flags, unchecked = list(check.flags), []
        else:
            flags, unchecked = self.engine.checked_grads()  # [Note: finite check in the average] in comm/layout.py
        sums = _l2_norms(unchecked)
        device = (sums or flags)[0].device if sums or flags else torch.device("cpu")
        if self.engine.comm.device.type == "cuda":
            device = self.engine.comm.device  # NCCL reduces CUDA tensors only
        if flags:  # inf where a reduction saw one, summed with the norms (0 * inf would be NaN: where, not mul)
            flag = (flags[0] if len(flags) == 1 else torch.cat(flags)).sum()
            sums = sums + [torch.where(flag > 0, math.inf, 0.0).to(torch.float32).reshape(1)]
        if sums:  # one vector of norms per precision: cat only where there are two
            total = (sums[0] if len(sums) == 1 else torch.cat(sums)).sum().reshape(1).to(device)
        else:
            total = torch.zeros(1, dtype=torch.float32, device=device)
        self.engine.comm.all_reduce(total, op="sum", tag="nonfinite-check")
        return not math.isfinite(total.item())

    def check_before_clamp(self) -> None:
        """Loss scaling: unscale and take this step's inf/NaN answer now (collective, once per step), before
        clipping by value turns an inf into a finite value the step's check would miss.  torch's GradScaler
        likewise records infs when it unscales, so a clamped overflow still skips the step as under DDP."""
        if self.scaling:
            self.unscale()
            self.engine.note_nonfinite(self.found_nonfinite())

    def should_step(self) -> bool:
        """Unscale, check every rank, update the scale; False means skip this step on every rank."""
        self.unscale()
        nonfinite = self.found_nonfinite()
        self.engine.reset_step_state()  # the step consumes (or discards) these gradients
        if nonfinite:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale *= self.backoff
            else:
                warnings.warn(
                    f"zero_plugin: non-finite gradient on some rank; step skipped on every rank "
                    f"(skipped so far: {self.skipped_steps})",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth
        return True

    # Saved and loaded with the optimizer: [Note: scaler state].
    def state_dict(self) -> dict:
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a :meth:`state_dict`; check it first with :func:`scaler_state_problem`."""
        self.skipped_steps = int(state["skipped_steps"])
        if self.dynamic and state["dynamic"]:
            self.scale = float(state["scale"])
            self.clean_steps = int(state["clean_steps"])


def _l2_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients' L2 norms as float32 vectors, one foreach op per precision: half-precision gradients
    accumulate in float32 (``dtype``; their own range would overflow), wider ones in their own dtype (the
    foreach norm refuses to narrow), cast after, as the per-gradient float32 sums this replaces did."""
    half = (torch.float16, torch.bfloat16)
    norms = []
    for group, dtype in (
        ([g for g in grads if g.dtype in half], torch.float32),
        ([g for g in grads if g.dtype not in half], None),
    ):
        group = [g for g in group if g.numel()]
        if group:
            norms.append(torch.stack(torch._foreach_norm(group, 2, dtype=dtype)).to(torch.float32))
    return norms


def scaler_state_problem(state) -> str | None:
    """What is wrong with a loaded :meth:`GradGuard.state_dict` (untrusted input), or None."""

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__}"
    scale = state.get("scale")
    ok = (
        isinstance(state.get("dynamic"), bool)
        and isinstance(scale, (int, float))
        and not isinstance(scale, bool)
        and math.isfinite(scale)
        and scale > 0
        and count(state.get("clean_steps"))
        and count(state.get("skipped_steps"))
    )
    return (
        None
        if ok
        else (f"expected dynamic (bool), scale (finite > 0), clean_steps and skipped_steps (ints >= 0); got {state!r}")
    )
