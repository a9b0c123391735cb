"""Property tests of the shard math in ``zero_plugin.tensors.flat`` (single process)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_plugin.tensors.flat import ShardLayout, copy_from_rows, copy_padded_rows

numels = st.integers(min_value=0, max_value=5000)
world_sizes = st.integers(min_value=1, max_value=9)
fast = settings(deadline=None, max_examples=200)


def layouts(numel: int, world_size: int) -> list[ShardLayout]:
    return [ShardLayout(numel, world_size, r) for r in range(world_size)]


@fast
@given(numel=numels, world_size=world_sizes)
def test_padding_is_minimal(numel, world_size):
    layout = ShardLayout(numel, world_size, 0)
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padded_numel - numel < world_size
    assert layout.shard_numel == -(-numel // world_size)


@fast
@given(numel=numels, world_size=world_sizes)
def test_bounds_tile_every_element_once(numel, world_size):
    owners = torch.zeros(numel, dtype=torch.int64)
    cursor = 0
    for layout in layouts(numel, world_size):
        lo, hi = layout.bounds()
        assert (lo, hi) == layouts(numel, world_size)[0].bounds(layout.rank)
        assert lo == cursor and lo <= hi <= numel  # contiguous, in rank order
        assert hi - lo == layout.local_numel <= layout.shard_numel
        owners[lo:hi] += 1
        cursor = hi
    assert cursor == numel
    assert bool((owners == 1).all())


@fast
@given(numel=numels, world_size=world_sizes)
def test_local_view_and_chunk_view_agree_with_bounds(numel, world_size):
    full = torch.arange(numel, dtype=torch.float64)
    for layout in layouts(numel, world_size):
        lo, hi = layout.bounds()
        view = layout.local_view(full)
        assert torch.equal(view, full[lo:hi])
        if view.numel():
            assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view, no copy
        row = torch.arange(layout.shard_numel, dtype=torch.float64)
        assert layout.chunk_view(row).numel() == hi - lo


@fast
@given(
    numel=numels,
    world_size=world_sizes,
    left=st.integers(0, 5),
    right=st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_rows_round_trip_and_zero_padding(numel, world_size, left, right, dtype):
    layout = ShardLayout(numel, world_size, 0)
    s = layout.shard_numel
    src = (torch.arange(numel, dtype=torch.float64) + 1).to(dtype)  # no zeros, so padding is recognisable
    # Rows are columns of a wider bucket buffer, as in grads/bucket.py; the neighbours must stay untouched.
    bucket = torch.full((world_size, left + s + right), float("nan"), dtype=dtype)
    rows = bucket[:, left : left + s]
    copy_padded_rows(rows, src, layout)

    assert torch.isnan(bucket[:, :left]).all() and torch.isnan(bucket[:, left + s :]).all()
    for r in range(world_size):
        lo, hi = layout.bounds(r)
        assert torch.equal(rows[r, : hi - lo], src[lo:hi]), f"row {r} holds rank {r}'s chunk"
        assert bool((rows[r, hi - lo :] == 0).all()), f"row {r}: padding must be zero"
    assert int((rows != 0).sum()) == numel

    out = torch.full((numel,), -1.0, dtype=dtype)
    copy_from_rows(out, rows, layout)
    assert torch.equal(out, src)


@fast
@given(numel=numels, world_size=world_sizes)
def test_none_source_gives_zero_rows(numel, world_size):
    layout = ShardLayout(numel, world_size, world_size - 1)
    rows = torch.full((world_size, layout.shard_numel), 7.0)
    copy_padded_rows(rows, None, layout)
    assert bool((rows == 0).all())


@fast
@given(numel=numels, world_size=world_sizes)
def test_gathered_rows_rebuild_the_tensor(numel, world_size):
    """Each rank's padded chunk of its own region, stacked in rank order (an all-gather), copies out to the whole."""
    full = torch.randn(numel, dtype=torch.float64)
    chunks = []
    for layout in layouts(numel, world_size):
        padded = torch.zeros(layout.shard_numel, dtype=torch.float64)
        padded[: layout.local_numel] = layout.local_view(full)
        chunks.append(padded)
    gathered = torch.stack(chunks) if chunks[0].numel() else torch.zeros(world_size, 0, dtype=torch.float64)
    rebuilt = torch.empty(numel, dtype=torch.float64)
    copy_from_rows(rebuilt, gathered, layouts(numel, world_size)[0])
    assert torch.equal(rebuilt, full)
