"""Named phases in a profiler's trace: ``zero_plugin::<name>`` around what zero_plugin adds to a step.

[Note: profiler phases]
Under ``torch.profiler.profile`` (or any profiler torch's autograd profiler reports as running) each phase is a
``torch.profiler.record_function`` range, as FSDP2 marks its ``FSDP::all_gather`` and friends, so a trace shows
where a step's host time goes: a stage-3 unit's ``all_gather`` launch and ``all_gather_copy_out`` (its wait and
copy-out), ``reduce_scatter`` and ``reduce_scatter_wait``; the stages 0-2 buckets' ``reduce_bucket`` and
``reduce_bucket_wait``; the ``param_all_gather`` after the step; ``optimizer_step`` (the whole wrapped step) and
in it the parameter partition's ``owner_gather`` / ``owner_scatter``; the offload copies ``offload_to_host`` /
``offload_to_device``; ``checkpoint_save`` / ``checkpoint_load``.  With no profiler running a phase is one
C call that answers False and a shared null context: no aten op, no range (``benchmarks.host_ops`` counts
the same ops per step with and without the phases).  docs/tuning.md shows a trace.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["phase", "PREFIX"]

PREFIX = "zero_plugin::"
_OFF = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """``record_function("zero_plugin::" + name)`` while a profiler runs, else a no-op context."""
    if not torch.autograd._profiler_enabled():
        return _OFF
    return torch.profiler.record_function(PREFIX + name)
