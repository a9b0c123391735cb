"""Device values read on the host later, without stalling the host behind the device.

[Note: deferred host reads]
On CUDA, reading a device value on the host (``.tolist()``, ``.item()``, ``torch.equal``, a copy from
pageable memory) waits for every kernel queued before it.  After each stage-3 gather or reduction that
stalls the host behind the collective, so it cannot queue unit i's compute while unit i+1's gather runs:
the H200 run of 2026-12-04 found 45 such waits per step and a prefetch that overlapped nothing
(``benchmarks/results/gpu.md``).  What stage 3 reads there is not needed at once: that every rank gathered
the same unit ([Note: gather tag] in ``stage3/unit.py``) only has to be known before a gradient is final,
and which parameters some rank had a gradient for ([Note: deferred has-gradient flags] in
``grads/presence.py``) only at the end of backward.

A ``HostRead`` copies the value into pinned host memory without blocking, on the current stream (the
side stream that produced it), and records an event: ``ready()`` asks without waiting, ``get()`` waits.
The source may be reused by later work on that stream, or on another stream once it waited for the
producer's later event, both ordered after the copy.  On the CPU the read is the value itself, ready at
once, unless ``defer_on_cpu`` is set: tests set it so the deferred paths run on this machine too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["HostRead", "deferred_on_cpu"]


class HostRead:
    defer_on_cpu = False  # tests: [Note: deferred host reads]

    def __init__(self, value: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._pending_cpu = False
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = value.detach().clone()
            self._pending_cpu = HostRead.defer_on_cpu

    def ready(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return not self._pending_cpu

    def get(self) -> torch.Tensor:
        """The value on the host, waiting for its copy if it is still in flight."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._pending_cpu = False
        return self._host


@contextlib.contextmanager
def deferred_on_cpu() -> Iterator[None]:
    """Tests: CPU reads stay pending until ``get()``, as a CUDA read whose copy has not landed."""
    previous, HostRead.defer_on_cpu = HostRead.defer_on_cpu, True
    try:
        yield
    finally:
        HostRead.defer_on_cpu = previous
