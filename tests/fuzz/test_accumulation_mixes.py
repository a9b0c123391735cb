"""Accumulation windows that mix synced and ``zp.no_sync`` micro-batches, one parameter unused on some rank,
against single-process float64 training (issue 42: stage 1 was silently wrong on these).

Stage 1 keeps full gradients, whose regions outside this rank's own hold values a reduction already took in
([Note: reduced regions and later backwards] in zero_plugin/grads/reducer.py).  On main 9410fdc:
  * ``sync-nosync-sync``: the ``no_sync`` micro-batch's gradient was dropped by the next synced backward;
  * ``sync-sync-unused``: a block rank 1 skips in the second synced backward had its first average reduced
    again (1e-3 relative off the float64 update at world size 2, a third of the update at world size 3).
Each named schedule runs at stage 1 in both collective layouts at 2 and 3 ranks (once with offload) and at
stage 2 (the control: it was right), through the fuzzer's worker pools and comparison (``check.run_spec``).
"""

from __future__ import annotations

import pytest

from tests.fuzz.check import run_spec
from tests.fuzz.model import SKIP, USE
from tests.fuzz.spec import written_spec

ALL = [USE, USE]
SKIP_FIRST = [SKIP, USE]


def _micro(sync: bool, scale: float, usage_per_rank: list[list[int]]) -> list:
    return ["micro", {"sync": sync, "scale": scale, "usage": usage_per_rank}]


def _window(syncs: list[bool], usages: list[list[list[int]]]) -> list:
    return [_micro(s, 1.0 / len(syncs), u) for s, u in zip(syncs, usages)]


def _schedules(world_size: int) -> dict[str, list]:
    even = [ALL] * world_size
    rank1_skips = [ALL, SKIP_FIRST] + [ALL] * (world_size - 2)
    step = [["step"], ["zero_grad", "optimizer"]]
    return {
        "sync-nosync-sync": _window([True, False, True], [even] * 3) + step,
        "sync-sync-unused": _window([True, True], [even, rank1_skips]) + step,
        "nosync-sync-sync-unused": _window([False, True, True], [even, rank1_skips, even]) + [["clip", 0.05]] + step,
        "sync-nosync-unused-sync": _window([True, False, True], [even, rank1_skips, even])
        + step
        + _window([True, False, True], [rank1_skips, even, rank1_skips])
        + step,
    }


NAMES = list(_schedules(2))


def _spec(stage: int, world_size: int, name: str, buffered: bool, offload: bool) -> dict:
    return written_spec(_schedules(world_size)[name], world_size, stage, buffered=buffered, offload=offload)


# (stage, world size, buffered, offload): stage 1 in both layouts at 2 and 3 ranks (offload once), stage 2 once
SETTINGS = [(1, 2, False, False), (1, 2, True, False), (1, 3, False, True), (1, 3, True, False), (2, 3, True, False)]


@pytest.mark.parametrize(
    "stage,world_size,buffered,offload",
    SETTINGS,
    ids=[f"stage{s}-ws{w}-{'buffered' if b else 'in_place'}{'-offload' if o else ''}" for s, w, b, o in SETTINGS],
)
@pytest.mark.parametrize("name", NAMES)
def test_mixed_accumulation_matches_single_process(name, stage, world_size, buffered, offload):
    run_spec(_spec(stage, world_size, name, buffered, offload))
