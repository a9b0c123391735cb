"""The in-place layout's gather and reduce-scatter, sent point to point on gloo ([Note: point-to-point
exchange] in zero_plugin/comm/collectives.py): values at world sizes 1-4 with odd, padded and empty
regions, several gathers in flight at once, and bit-identity with gloo's all-reduce at two ranks."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import p2p_workers as workers


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_regions(world_size, dtype):
    assert all(run_ranks(world_size, workers.gather_worker, dtype, 3))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_in_place_sums_own_regions(world_size):
    for r in run_ranks(world_size, workers.reduce_worker, "float64"):
        assert r["worst"] < 1e-12, r


def test_reduce_in_place_equals_all_reduce_at_two_ranks():
    assert all(run_ranks(2, workers.matches_all_reduce_worker))
