"""Each collective layout's ``Footprint`` ([Note: collective footprints] in zero_plugin/comm/layout.py), the
description the memory planner's replay counts, checked against what the pipelines allocate on a gloo group:
the storages that appear when a launch returns and go when its completion is done, by part
(``layout_footprint_workers.py``).  Both layouts run on gloo (the buffered one's pipelines are called
directly).  A change to what a pipeline allocates, or when, fails here until its footprint says the same."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import layout_footprint_workers as workers

LAYOUTS = ("in_place", "buffered")


def _check(results: list) -> None:
    for rank, (measured, described) in enumerate(results):
        assert tuple(measured) == tuple(described), f"rank {rank}: (launch, completion) measured != described"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather(layout, dtype):
    _check(run_ranks(2, workers.gather_worker, layout, dtype))


def test_gather_laid_out():
    """Stage 3's flat shards are the input: only the output is taken."""
    _check(run_ranks(2, workers.gather_worker, "buffered", "float32", True))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dtype, reduce_dtype, release",
    [
        ("float32", "float32", True),  # stage 2 / stage 3
        ("float32", "float32", False),  # stage 1
        ("bfloat16", "float32", True),  # mixed precision, reduced in fp32: a cast
        ("bfloat16", "float32", False),
    ],
)
def test_reduce(layout, dtype, reduce_dtype, release):
    _check(run_ranks(2, workers.reduce_worker, layout, dtype, reduce_dtype, release))


@pytest.mark.parametrize("dtype, reduce_dtype", [("float32", "float32"), ("bfloat16", "float32")])
def test_reduce_with_side_streams(dtype, reduce_dtype):
    """Stage 3 on CUDA: the reduce stream reads the released gradients, so the record keeps them until its
    completion (``BufferedReduce.sources``), as ``reduce_footprint(side_streams=True)`` says."""
    _check(run_ranks(2, workers.reduce_worker, "buffered", dtype, reduce_dtype, True, True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("filled", [False, True], ids=["fresh", "views"])
def test_all_reduce(dtype, filled):
    _check(run_ranks(2, workers.all_reduce_worker, dtype, filled))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_pending", [1, 2])
def test_gather_all(layout, max_pending):
    for rank, (measured, described) in enumerate(
        run_ranks(2, workers.gather_all_worker, layout, "float32", max_pending)
    ):
        assert measured == described, f"rank {rank}: buffers alive at each completion"
