"""Host-memory hygiene for stage 3 on CPU: hand freed heap pages back to the kernel.

[Note: heap trimming]  glibc keeps freed blocks below its mmap threshold (which rises to the
largest block freed, up to 32 MiB) in its heaps.  A stage-3 step frees whole units of parameters
and their gradients while activations are allocated in between, so the heaps end up holding far
more than the live bytes: measured on the 120M-parameter benchmark model (2 ranks), the peak RSS
increase was 2036 MiB with the default allocator against 1288 MiB with every block mmapped
(``MALLOC_MMAP_THRESHOLD_=131072``), while DDP's was 3095 / 2615 MiB.  ``malloc_trim(0)`` returns
the free pages of every arena (``madvise(MADV_DONTNEED)`` on free chunks, not only the heap top), and
every page it returns is faulted in (and zeroed) again when the heap reuses it: that re-faulting, not
the trim call, is the step-time cost, and minor page faults per step (``ru_minflt``) measure it
independently of machine load.  On ``blocks34m`` (2 ranks, batch 4x128) the unit-sized blocks have the
sizes of the activations (1 MiB hidden states and q/k/v/o weights, 2.7 MiB MLP intermediates and
weights), so no size class or mmap threshold separates them.  Without any trim the heap's extent grows
step after step (peak RSS increase 751 MiB after 4 steps, 827-845 after 9; at the end of forward
516 MiB in use and 200 MiB free in the heap): the holes that the released units and the forward's
temporaries leave are where the kept activations would have to go.  Where to trim, measured with
``benchmarks``-style steps (minor faults per step on rank 0 / rank 1, peak RSS increase over set-up and
steps, MiB; 5 timed steps after 2 warm-up unless said; DDP: 1 fault per step, peak 1089 / 1106 over
9 steps):
  * after each unit's release in forward, at the end of forward and of backward (the previous default):
    146.6k / 150.3k faults, peak 775 / 775 (9 steps), step CPU time 1.2x the untrimmed one;
  * never (``trim_host_heap=False``): 3 / 3 faults, peak 827-845 (9 steps) and still growing;
  * at the end of backward only: 88.1k / 84.0k, peak 769 / 781;
  * at the ends of forward and backward: 99.5k / 105.8k, peak 739 / 741;
  * after the optimizer step only: 99.7k / 100.7k, peak 756 / 748;
  * at the end of forward only (the default now): 44.0k / 44.3k, peak 731 / 736.
In ``benchmarks.ab`` against the previous default (2 warm-up + 5 timed steps x 2 rounds, load
average 12-21 on 2 cores, so CPU time): 5.20 against 6.08 CPU s per step (0.894x; DDP 4.84 s), peak RSS
increase 586 against 568 MiB (DDP 895 MiB), final parameters bit-identical to DDP's.
The end of forward is the one point where the heap's holes are not about to be refilled: the
activations the backward needs are all allocated, and the backward frees more than it allocates, so it
reuses its own freed pages; pages trimmed anywhere earlier are faulted in again by the same forward,
and pages trimmed at the end of backward by the next forward.  Before that: trimming only when the heap
held more than two units' worth of free bytes changed neither the peak nor the step time at 58M; a pool
of unit-sized blocks for the unsharded parameters (``BufferPool``) with trimming gave no win, without
trimming it was faster but the peak was 0.61-0.70x DDP's; ``mallopt(M_MMAP_THRESHOLD, 1 MiB)`` for the
whole process cost DDP itself +49% CPU time (its activations are mmapped and faulted in each step too).
Since then the gathered parameters no longer go through the heap on CPU: their memory is lent from a
pool of resident storages ([Note: lent storage] in ``stage3/storage_pool.py``), emptied before this trim.
Another allocator does better than any trim: under tcmalloc stage 3 holds 0.54-0.60x tuned DDP's (glibc) peak
at 0.97-1.04x its step, with no page faults (``benchmarks/results/49-allocators-*``). It takes ``LD_PRELOAD``
before the process starts, which a library cannot do: ``zero-plugin launch --allocator`` ([Note: host
allocator] in ``launch/allocator.py``); stage 3 then neither trims nor pools (``malloc_preloaded``).
[Note: eager trimming when memory is tight] At the end of forward only, a large model still re-touches
the heap's trimmed holes through the next forward and backward: on the 3B LoRA benchmark
(``benchmarks/results/large_model.md``, 2 ranks, decoder layers of 25 MB gathered after slicing) a
rank's anonymous RSS rose 510 MiB through the first training forward while glibc's bytes in use rose 128
MiB (the saved activations), and each backward added 120-170 MiB while its bytes in use fell, so the
peak sat 300-450 MiB above the live bytes (per-layer probes of ``RssAnon`` and ``mallinfo2``). There the
page faults of trimming before every unit's gather cost nothing measurable (a 20 s step spent on
gathering 6 GB), while on a small model they cost 20% of the step (above). So the mode follows the
memory at stake, measured once when the engine is built (the shards are resident then):
``HeapTrim.EACH_UNIT`` (also before each unit's gather, in forward and backward) when the rank's RSS
exceeds ``ZeroConfig.trim_each_unit_above`` of its share of the host's memory (MemTotal / processes on
the host), ``HeapTrim.FORWARD`` otherwise. Measured with ``benchmarks.rss_trace`` (4 steps, together
with 16 MiB slices): peak through training 6.95 / 7.10 GiB per rank before, 6.53 / 6.51 GiB after, train
runtime 117 s against 112-122 s.
``ZeroConfig(trim_host_heap=False)`` turns trimming off.  A no-op where glibc is not the allocator
(macOS, musl) and on CUDA devices (the caching allocator manages device memory; host buffers there are
pinned and reused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import os

__all__ = ["HeapTrim", "choose_heap_trim", "host_share_used", "malloc_preloaded", "trim_host_heap"]


class HeapTrim(enum.Enum):
    """Where stage 3 hands freed heap pages back ([Note: heap trimming])."""

    OFF = "off"
    FORWARD = "forward"  # once per forward, at its end
    EACH_UNIT = "each_unit"  # also before every unit's gather ([Note: eager trimming when memory is tight])


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where it has nothing to trim: no glibc, or another allocator preloaded in
    front of it (``malloc_preloaded``), which leaves glibc's heap empty."""
    if malloc_preloaded():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def malloc_preloaded() -> bool:
    """True where another allocator stands in front of the C library's ``malloc`` (``LD_PRELOAD`` of tcmalloc,
    jemalloc, ...: [Note: host allocator] in ``launch/allocator.py``): the name the process resolves is not the
    C library's own definition.  glibc's heap then holds none of the tensors, so neither the trim nor the storage
    pool ([Note: lent storage] in ``stage3/storage_pool.py``), both ways around glibc's heap, has anything to do."""
    try:
        own = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc
        first = ctypes.CDLL(None).malloc
    except (OSError, AttributeError):
        return False
    return ctypes.cast(first, ctypes.c_void_p).value != ctypes.cast(own, ctypes.c_void_p).value


def trim_host_heap() -> bool:
    """Return freed heap pages to the kernel; True when glibc's ``malloc_trim`` ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def host_share_used(local_processes: int) -> float | None:
    """This process's RSS over its share of the host's memory (total / ``local_processes``); None where
    either is unknown (no ``/proc``)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return rss * max(1, local_processes) / total if total > 0 else None


def choose_heap_trim(enabled: bool, on_cpu: bool, each_unit_above: float, share_used: float | None) -> HeapTrim:
    """The trimming mode of a stage-3 engine ([Note: eager trimming when memory is tight])."""
    if not (enabled and on_cpu) or _malloc_trim() is None:
        return HeapTrim.OFF
    if each_unit_above == 0 or (share_used is not None and share_used > each_unit_above):
        return HeapTrim.EACH_UNIT
    return HeapTrim.FORWARD
