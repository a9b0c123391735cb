"""Stages 1-2 on gloo: the optimizer steps one parameter bucket at a time, and each bucket's updated
regions are on the wire while the next bucket steps.

[Note: pipelined step]
After a stage-1/2 step every rank must send its updated regions to the others (``param_sync.py``).
Done after the whole step, that all-gather is pure waiting: on ``blocks34m`` (2 gloo ranks) the step
phase took 207 ms of wall time for 163 ms of CPU time, against tuned DDP's 147 / 145.  Here the
wrapped optimizer steps the masters of one bucket (``ParamAllGather``'s buckets, the same on every
rank, so the gathers are issued in a rank-agreed order), the bucket's gather is launched
asynchronously, and the next bucket steps meanwhile; the step returns once every gather completed,
so nothing after it can see a stale region.

Only where that changes nothing but the time: the exact classes ``torch.optim.Adam``, ``AdamW`` and
``SGD`` (their update of one parameter reads only that parameter's gradient and state, so stepping
a subset at a time gives bit-identical results, for the for-loop, foreach and fused
implementations alike), with no step hooks on the optimizer or registered globally (they would run
once per bucket), on gloo's in-place layout, without offload (whose steps have their own paths:
``cpu_step.py``, ``blocked_step.py``).  Everything else steps whole and gathers after.  The subset
is chosen by narrowing each param group's ``"params"`` for the call and restoring it afterwards
(also when the step raises); the groups' other options are untouched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["steps_in_pieces", "only_these"]

_EXACT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def steps_in_pieces(inner: torch.optim.Optimizer) -> bool:
    """Whether stepping ``inner`` one subset of parameters at a time gives what one step gives."""
    return (
        type(inner) in _EXACT
        and not inner._optimizer_step_pre_hooks
        and not inner._optimizer_step_post_hooks
        and not torch_optimizer._global_optimizer_pre_hooks
        and not torch_optimizer._global_optimizer_post_hooks
    )


@contextlib.contextmanager
def only_these(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    """``inner.step()`` inside steps only ``params`` (each keeps its own group)."""
    wanted = {id(p) for p in params}
    saved = [group["params"] for group in inner.param_groups]
    try:
        for group, group_params in zip(inner.param_groups, saved):
            group["params"] = [p for p in group_params if id(p) in wanted]
        yield
    finally:
        for group, group_params in zip(inner.param_groups, saved):
            group["params"] = group_params
