"""Run one rank of an N-rank job in a single process with torch's fake process group.

Collectives move no data, so results are meaningless, but every allocation is real: this measures the
per-rank memory of a large world size on one device (CPU here, CUDA in tests/gpu/run.sh).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
