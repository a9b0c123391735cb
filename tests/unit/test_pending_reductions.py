"""How many gradient reductions may be pending during backward ([Note: pending reductions] in
``zero_plugin/grads/reducer.py``): the bound holds where a pending bucket holds a buffer of its own; stage 0's
buckets whose gradients are views of their persistent buffers hold none, so, as DDP, every one is launched as
soon as its turn comes and the backward never waits for an earlier all-reduce.  One process, torch's fake
process group of 2 ranks (collectives complete at once): only the order of launches and completions is
checked here; the values are checked against a single-process reference in ``tests/parity/test_bucket_views.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_plugin as zp
from tests.gpu.fake_pg import fake_world
from zero_plugin.engines.engine import engine_of
from zero_plugin.grads.reducer import MAX_INFLIGHT


@pytest.fixture
def two_fake_ranks():
    with fake_world(2):
        yield


def _events(stage: int, **config) -> list[str]:
    """Launches ("L") and completions ("C") of one backward, in the order they ran, for a chain of 8 linear
    layers in buckets of about one layer each."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = zp.ZeroConfig(stage=stage, bucket_size_mb=64 * 65 * 4 / 2**20, **config)
    model, optimizer = zp.setup(model, optimizer, cfg)
    schedule = engine_of(model, "test").reducer.schedule
    events: list[str] = []
    launch, complete = schedule._launch, schedule._complete

    def launched(item):
        events.append("L")
        return launch(item)

    def completed(item, pending):
        events.append("C")
        complete(item, pending)

    schedule._launch, schedule._complete = launched, completed
    model(torch.randn(4, 64)).sum().backward()
    return events


def test_stage0_bucket_views_launch_every_bucket_before_waiting_for_any(two_fake_ranks):
    events = _events(0)
    n = events.count("L")
    assert n >= 4 * MAX_INFLIGHT, f"want many buckets, got {n}"
    assert events == ["L"] * n + ["C"] * n, f"a backward waited for a pending all-reduce: {''.join(events)}"


@pytest.mark.parametrize(
    "stage,config",
    [(0, {"reduce_dtype": "bf16"}), (1, {}), (2, {})],
    ids=["stage0_own_buffers", "stage1", "stage2"],
)
def test_buckets_that_hold_buffers_stay_bounded(two_fake_ranks, stage, config):
    """Stage 0 reducing in another dtype (a flat buffer per bucket) and stages 1-2 (the peers' regions in a
    temporary, stage 2's full gradients until completion) keep at most MAX_INFLIGHT pending."""
    events = _events(stage, **config)
    pending = peak = 0
    for e in events:
        pending += 1 if e == "L" else -1
        peak = max(peak, pending)
    assert peak <= MAX_INFLIGHT + 1 and events.count("L") >= 4 * MAX_INFLIGHT, "".join(events)
