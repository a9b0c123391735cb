"""Stage 3 with blocks whose output one rank computes and does not use, late in a deep forward (issue 42's fresh
seeds): the rank that used them reduced them in their turn and blocked on that reduction once two more were in
flight, before issuing the backward gathers the other rank was waiting for; both hung until the collective
timeout (on main 9410fdc, from four blocks with the last one discarded on one of two ranks; and where one rank
used no block at all, its reductions waited behind the gathers it makes at the end of backward; and where one
rank passed three blocks before its backward reached one, it marked all three ready before gathering them).
[Note: units the backward passed] in zero_plugin/stage3/hooks.py.
"""

from __future__ import annotations

import pytest

from tests.fuzz.check import run_spec
from tests.fuzz.model import DISCARD, USE
from tests.fuzz.spec import written_spec


def _spec(depth: int, discard_on: list[tuple[int, int]], world_size: int, buffered: bool) -> dict:
    usage = [[USE] * depth for _ in range(world_size)]
    for rank, block in discard_on:
        usage[rank][block] = DISCARD
    micro = ["micro", {"scale": 1.0, "sync": True, "usage": usage}]
    schedule = [micro, ["step"], ["zero_grad", "optimizer"], micro, ["step"], ["zero_grad", "optimizer"]]
    return written_spec(schedule, world_size, 3, depth, buffered=buffered, prefetch_depth=0, seed=44)


# (depth, [(rank, discarded block)], world size)
CASES = [
    (4, [(0, 3)], 2),  # the fuzzer's find
    (5, [(1, 4), (1, 3)], 2),
    (4, [(0, 3), (2, 2)], 3),
    # one rank uses no block at all (seed 271828): its backward reaches none, so it gathers them all at the end
    (4, [(0, 0), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)], 3),
    # three blocks in a row passed before the backward reaches one (seed 77777, and 300301 at 4 ranks): the rank
    # marked all three ready at once and blocked on the first reduction before gathering the second, which its
    # peer gathers before reducing the first ([Note: units the backward passed]: the walk interleaves them)
    (4, [(1, 1), (1, 2), (1, 3)], 2),
    (5, [(0, 1), (0, 2), (0, 3), (2, 4)], 3),
]


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
@pytest.mark.parametrize("depth,discard_on,world_size", CASES)
def test_discarded_late_blocks_train_as_single_process(depth, discard_on, world_size, buffered):
    run_spec(_spec(depth, discard_on, world_size, buffered))
