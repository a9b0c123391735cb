"""What a process group's backend decides for ``Comm``: the collective layout ([Note: in-place region
gather] in ``collectives.py``), the device its collectives, and stage 3's units, run on, whether its
reduce-scatter averages, and whether it moves data at all: every check of torch's ``"fake"`` group is here
(``Comm.moves_data`` for its callers)."""

from __future__ import annotations

import os

import torch

__all__ = ["backend_uses_cuda", "moves_data", "reduce_scatter_averages", "regions_in_place"]


def regions_in_place(backend: str) -> bool:
    """Whether ``Comm`` on ``backend`` gathers and reduces regions in place ([Note: in-place region
    gather]): gloo, unless ZERO_PLUGIN_BUFFERED_COLLECTIVES=1."""
    return backend == "gloo" and os.environ.get("ZERO_PLUGIN_BUFFERED_COLLECTIVES", "0") != "1"


def backend_uses_cuda(backend: str) -> bool:
    """Whether a group on ``backend`` moves CUDA tensors: NCCL, alone or in a composite backend such as
    ``"cpu:gloo,cuda:nccl"``; torch's ``"fake"`` group (it moves nothing, and its users measure the memory of
    the job it stands in for) on a machine with CUDA."""
    if "nccl" in backend:
        return True
    return backend == "fake" and torch.cuda.is_available()


def moves_data(backend: str) -> bool:
    """False for torch's ``"fake"`` group (memory planning, ``benchmarks/host_ops.py``): its collectives
    complete at once and move nothing, so there is no peer to agree with (no control channel, no sibling or
    node group) and nothing gathered to check (stage 3's gather tags)."""
    return backend != "fake"


def reduce_scatter_averages(backend: str) -> bool:
    """Whether ``backend``'s reduce-scatter has ``ReduceOp.AVG`` ([Note: averaging in the collective] in
    ``layout.py``): NCCL, and the fake group that stands in for it in tests; gloo has none."""
    return backend in ("nccl", "fake")
