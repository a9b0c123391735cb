"""Side streams and events that let stage-3 collectives overlap compute on CUDA.

[Note: side streams]
On CUDA a unit's all-gather (copy-in, collective, copy-out) runs on a *gather stream* and its
reduce-scatter (copy-in, collective, accumulation into the shard gradient) on a *reduce stream*, so
the compute stream only ever waits at the point of use: the prefetch of unit i+1 is in flight while
unit i computes, and a reduction does not hold up the backward of the next unit.  The protocol:

  1. entering a side stream (``gather()`` / ``reduce()``) makes it wait for an event recorded on the
     compute stream *now*: the local shards (updated by the last step) and the gradients (written by
     backward) are ready before the side stream reads them, and every block freed before that moment
     (unsharded storages, pool buffers) is no longer used by the compute stream;
  2. the side stream records an event after its last write (the copy-out, the accumulation), and the
     compute stream waits for it (``wait``) before it uses the result;
  3. only after that wait are buffers handed back to the ``BufferPool`` and the references to the
     full gradients dropped: every later use of that memory, on any stream, comes after the wait.

Events rather than ``Tensor.record_stream``: a block marked with ``record_stream`` is, once freed,
reusable only after events on the recorded streams complete, which the caching allocator checks at
later allocations; when memory comes back then depends on how far the GPU has got.  With explicit
waits a block is reusable exactly when the host frees it, and peak memory is the same on every run.
The number of buffers in flight is bounded where they are issued (``prefetch_depth`` gathers,
``MAX_INFLIGHT_REDUCES`` reductions in ``stage3/hooks.py``).

On CPU (gloo, or no accelerator) there is nothing to overlap with: :data:`NO_STREAMS` does nothing
and creates no stream or event, so the CPU path is unchanged.  Tests substitute a recording fake
with the same four methods to check the order of waits and records.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

__all__ = ["StreamSet", "CudaStreams", "NO_STREAMS", "streams_for"]


class StreamSet:
    """The protocol, and its no-op implementation (one device, nothing to overlap)."""

    # True where side streams exist: callers then keep tensors a side stream reads alive until the
    # compute stream has waited for it (step 3 of [Note: side streams]).
    overlaps = False

    def gather(self) -> ContextManager[None]:
        """Run the enclosed work on the gather stream, after the compute stream's work so far."""
        return _NULL

    def reduce(self) -> ContextManager[None]:
        """Run the enclosed work on the reduce stream, after the compute stream's work so far."""
        return _NULL

    def record(self) -> Any:
        """An event marking the work queued so far on the current stream (None where there is none)."""
        return None

    def wait(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (from :meth:`record`)."""


NO_STREAMS = StreamSet()
_NULL = contextlib.nullcontext()  # reusable: entering and leaving it does nothing


class CudaStreams(StreamSet):
    """A gather stream and a reduce stream on one CUDA device."""

    overlaps = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gather_stream = torch.cuda.Stream(device=device)
        self.reduce_stream = torch.cuda.Stream(device=device)

    def gather(self) -> ContextManager[None]:
        return self._on(self.gather_stream)

    def reduce(self) -> ContextManager[None]:
        return self._on(self.reduce_stream)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream):
        stream.wait_event(self.record())
        with torch.cuda.stream(stream):
            yield

    def record(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self.device).record_event()

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def streams_for(device: torch.device) -> StreamSet:
    """Side streams where collectives can overlap compute (a CUDA device), else the no-op set."""
    return CudaStreams(device) if device.type == "cuda" else NO_STREAMS
