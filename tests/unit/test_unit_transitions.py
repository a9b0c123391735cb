"""A stage-3 unit's own transitions ([Note: unit transitions] in zero_plugin/stage3/unit.py), one process.

The multi-process parity and behaviour suites check what these decisions add up to; here each decision
is checked alone on a one-rank engine: when a unit releases its parameters after a forward, after its
backward and after its reduction's launch, and which TrainingState and ReduceState changes are transitions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.param import ShardedState
from zero_plugin.stage3.unit import ReduceState, TrainingState


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return self.fc(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture()
def units():
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = zp.setup(model, optimizer, zp.ZeroConfig(stage=3, unit_classes=("_Block",)))
    engine = engine_of(model, "test")
    yield engine.units
    engine.remove()


def test_units_are_the_root_and_the_blocks(units):
    assert [u.is_root for u in units] == [True, False, False]


@pytest.mark.parametrize(
    "grad, reshard_after_forward, needed_first, released",
    [
        (False, True, False, True),  # no backward follows: always released
        (False, False, True, True),
        (True, True, False, True),  # reshard_after_forward
        (True, True, True, False),  # backward needs it first (the last unit, the root)
        (True, False, False, False),  # reshard_after_forward=False keeps it for backward
    ],
)
def test_post_forward_releases_unless_backward_needs_it(units, grad, reshard_after_forward, needed_first, released):
    unit = units[1]
    unit.pre_forward()
    assert unit.state is ShardedState.UNSHARDED
    assert unit.post_forward(grad, reshard_after_forward, needed_first) is released
    assert (unit.state is ShardedState.SHARDED) is released


def test_backward_states_move_forward_and_end_idle(units):
    unit = units[1]
    assert unit.training_state is TrainingState.IDLE
    unit.pre_backward()
    unit.pre_backward()  # a second output's gradient: no transition
    assert unit.training_state is TrainingState.PRE_BACKWARD
    unit.pre_forward()
    assert unit.post_backward() is True  # ready for its reduction, still gathered
    assert unit.training_state is TrainingState.POST_BACKWARD
    assert unit.state is ShardedState.UNSHARDED
    unit.pre_backward()  # the unit entered twice: a later state stays
    assert unit.training_state is TrainingState.POST_BACKWARD
    unit.end_backward()
    assert unit.training_state is TrainingState.IDLE and unit.state is ShardedState.SHARDED
    unit.post_backward()  # a backward that reached the inputs without the outputs' hook
    with pytest.raises(AssertionError, match="not a transition"):
        unit._to(TrainingState.PRE_BACKWARD)  # backward states never move back within a backward


def test_a_launched_reduction_releases_a_block_whose_backward_ran(units):
    block = units[1]
    block.pre_forward()
    block.hooked_inputs()
    block.pre_backward()
    block.launch_reduce()  # its gradients were final before its backward ended: still needed
    assert block.reduce_launched and block.state is ShardedState.UNSHARDED
    assert block.post_backward() is False  # reduced already: released at once
    assert block.state is ShardedState.SHARDED


def test_a_launched_reduction_releases_a_block_without_input_hook_but_never_the_root(units):
    root, block = units[0], units[1]
    for unit in (root, block):
        unit.pre_forward()
        unit.launch_reduce()  # no post-backward hook on its inputs: nothing would report its backward
    assert block.state is ShardedState.SHARDED
    assert root.state is ShardedState.UNSHARDED  # [Note: root unit]: only the final callback releases it
    root.end_backward()
    assert root.state is ShardedState.SHARDED and not root.reduce_launched


def test_a_reduction_has_one_turn_per_backward_and_repeats_only_its_kind(units):
    block = units[1]
    block.pre_forward()
    assert block.reduce_state is ReduceState.PENDING and not block.reduce_launched
    block.launch_reduce()  # its turn came before its backward ran: the unit is still IDLE
    assert block.training_state is TrainingState.IDLE
    block.launch_reduce()  # late gradients: the final callback's second reduction
    assert block.reduce_state is ReduceState.LAUNCHED and block.reduce_launched
    with pytest.raises(AssertionError, match="not a transition"):
        block.defer_reduce()  # zp.no_sync holds for the whole backward
    block.end_backward()
    assert block.reduce_state is ReduceState.PENDING and not block.reduce_launched
    block.defer_reduce()  # zp.no_sync with kept gradients: its turn came, nothing sent
    assert block.reduce_state is ReduceState.DEFERRED and block.reduce_launched
    with pytest.raises(AssertionError, match="not a transition"):
        block.launch_reduce()
    block.end_backward()
    assert block.reduce_state is ReduceState.PENDING
