"""[Note: deferred host reads] (comm/host_reads.py): gather tags and has-gradient flags read on the host
once per forward / backward instead of after every collective (a host stall per collective on CUDA).  On
this CPU machine ``deferred_on_cpu`` keeps reads pending as an in-flight CUDA copy would be."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.comm.host_reads import HostRead, deferred_on_cpu
from zero_plugin.engines.engine import engine_of
from zero_plugin.grads.presence import DeferredStores
from zero_plugin.stage3.tag_check import TagChecks, tag_of


def test_host_read_on_cpu_is_ready_at_once_unless_deferred():
    value = torch.tensor([1.0, 2.0])
    read = HostRead(value)
    value.fill_(7.0)  # the read is a copy
    assert read.ready() and read.get().tolist() == [1.0, 2.0]
    with deferred_on_cpu():
        pending = HostRead(value)
    assert not pending.ready()
    assert pending.get().tolist() == [7.0, 7.0] and pending.ready()


def _rows(*indices: int) -> torch.Tensor:
    return torch.tensor([tag_of(i) for i in indices], dtype=torch.bfloat16)


def test_tag_checks_raise_at_once_when_the_read_landed():
    checks = TagChecks()
    checks.add(3, "blocks.2", _rows(3, 3))
    with pytest.raises(RuntimeError, match=r"diverged.*unit 3 \('blocks.2'\).*rank\(s\) \[1\].*\[200\]"):
        checks.add(3, "blocks.2", _rows(3, 200))


def test_tag_checks_deferred_raise_at_flush_not_before():
    checks = TagChecks()
    with deferred_on_cpu():
        checks.add(1, "blocks.0", _rows(1, 1))
        checks.add(2, "blocks.1", _rows(2, 5))
        checks.poll()  # nothing landed: no check, no error
        with pytest.raises(RuntimeError, match=r"unit 2 \('blocks.1'\).*rank\(s\) \[1\] gathered unit\(s\) \[5\]"):
            checks.flush()


def test_deferred_stores_store_local_gradients_at_once_and_the_rest_by_the_summed_flags():
    """Stages 1-3: a member this rank had a gradient for is stored at completion; the others wait for the
    summed flags, as copies (the reduction's buffer may be reused meanwhile); one no rank had a gradient
    for is never stored."""
    stored = []
    deferred = DeferredStores()
    results = [torch.full((2,), float(i)) for i in range(4)]
    with deferred_on_cpu():
        # flags summed over ranks: m0 had one here; m1 on another rank only; m2 and m3 on no rank
        deferred.take(
            ["m0", "m1", "m2"],
            torch.tensor([1.0, 1.0, 0.0]),
            results[:3],
            lambda m, r: stored.append((m, r)),
            [True, False, False],
        )
        deferred.take(["m3"], torch.tensor([0.0]), results[3:], lambda m, r: stored.append((m, r)), [False])
    assert [m for m, _ in stored] == ["m0"]
    results[1].fill_(-1.0)  # the buffer reused before the end of backward
    deferred.run()
    assert [m for m, _ in stored] == ["m0", "m1"] and stored[1][1].tolist() == [1.0, 1.0]
    deferred.run()  # nothing left
    assert len(stored) == 2


class _Chain(nn.Module):
    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(6, 6, dtype=torch.float64) for _ in range(3)])
        self.unused = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _setup():
    model = _Chain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zp.setup(model, opt, zp.ZeroConfig(stage=3, unit_classes=["Linear"]))


def test_stage3_without_a_process_group_defers_and_keeps_unused_parameters_without_gradient():
    """One process, no process group: the buffered layout.  Deferred reads: the unused Linear has no
    gradient after backward (its zeros were dropped at the end of backward) and AdamW leaves it alone."""
    model, opt = _setup()
    before = {n: p.detach().clone() for n, p in zp.full_state_dict(model).items()}
    with deferred_on_cpu():
        for _ in range(2):
            model(torch.randn(4, 6, dtype=torch.float64)).square().mean().backward()
            engine = engine_of(model, "test")
            unused = [sp for sp in engine.sharded.values() if sp.param is model.unused.weight]
            assert unused and unused[0].sharded_grad is None
            opt.step()
            opt.zero_grad()
    after = zp.full_state_dict(model)
    assert torch.equal(after["unused.weight"], before["unused.weight"])
    assert not torch.equal(after["blocks.0.weight"], before["blocks.0.weight"])


def _mistag(unit) -> None:
    """This rank's all-gather rows carry the next unit's tag: the tag a gather appends, and the one written once
    into the trailer of the unit's flat shards ([Note: flat shards] in stage3/unit.py), which are sent as they
    are."""
    wrong = tag_of(unit.index + 1)
    unit._tag = lambda: wrong
    for flat in unit._flat.values():
        flat[-len(wrong) :] = torch.tensor(wrong, dtype=flat.dtype)


def test_stage3_deferred_tag_mismatch_raises_at_the_end_of_backward():
    """A gather whose tag is wrong (as if another rank gathered another unit) with its read still in
    flight: the forward runs, and the backward raises before any gradient is final."""
    model, opt = _setup()
    engine = engine_of(model, "test")
    unit = next(u for u in engine.units if u.name == "blocks.1")
    _mistag(unit)
    with deferred_on_cpu():
        loss = model(torch.randn(4, 6, dtype=torch.float64)).square().mean()
        with pytest.raises(RuntimeError, match=r"collective order diverged.*'blocks.1'"):
            loss.backward()
