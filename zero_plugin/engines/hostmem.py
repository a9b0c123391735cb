"""Host-memory hygiene for stage 3 on CPU: hand freed heap pages back to the kernel.

[Note: heap trimming]  glibc keeps freed blocks below its mmap threshold (which rises to the
largest block freed, up to 32 MiB) in its heaps.  A stage-3 step frees whole units of parameters
and their gradients while activations are allocated in between, so the heaps end up holding far
more than the live bytes: measured on the 120M-parameter benchmark model (2 ranks), the peak RSS
increase was 2036 MiB with the default allocator against 1288 MiB with every block mmapped
(``MALLOC_MMAP_THRESHOLD_=131072``), while DDP's was 3095 / 2615 MiB.  ``malloc_trim(0)`` returns
the free pages of every arena (``madvise(MADV_DONTNEED)`` on free chunks, not only the heap top);
the stage-3 runtime calls it after each unit's release in forward (the activations kept for backward
would otherwise grow around the freed units) and at the end of each forward and backward, so the next
phase re-faults only what it really uses.  With it the peak RSS increase of stage 3 is 0.53x DDP's at
120M parameters and 0.55-0.61x at 58M (``benchmarks/results/medium-ws2.md``, ``small-ws2.md``);
trimming only when the heap holds more than two units' worth of free bytes changed neither the peak
nor the step time at 58M, while not trimming at all took the 58M step from 1.14-1.18x to 1.00x DDP's
and its peak from 0.55-0.61x to 0.64x: ``ZeroConfig(trim_host_heap=False)`` makes that choice.  A
no-op where glibc is not the allocator (macOS, musl) and on CUDA devices (the caching allocator
manages device memory; host buffers there are pinned and reused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["trim_host_heap"]


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_host_heap() -> bool:
    """Return freed heap pages to the kernel; True when glibc's ``malloc_trim`` ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
