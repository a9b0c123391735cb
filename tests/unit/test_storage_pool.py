"""[Note: lent storage] in zero_plugin/stage3/storage_pool.py: memory swapped into a parameter's storage
object and back, reused from gather to gather, bounded when not lent."""

from __future__ import annotations

import torch

from zero_plugin.stage3.storage_pool import StoragePool, can_lend_storage


def _empty_target(shape) -> torch.Tensor:
    t = torch.empty(shape)
    t.untyped_storage().resize_(0)
    return t


def test_lent_memory_is_reused_and_views_follow_it():
    assert can_lend_storage(torch.device("cpu"))
    pool = StoragePool(max_free_bytes=1 << 20, max_idle_lends=4)
    target = _empty_target((3, 5))
    storage = target.untyped_storage()
    husk = pool.lend(storage, 15 * 4)
    assert storage.nbytes() == 60 and husk.nbytes() == 0
    target.copy_(torch.arange(15.0).view(3, 5))
    view = target.t()  # as autograd saves weight.t() in F.linear
    address = storage.data_ptr()
    pool.take_back(storage, husk)
    assert storage.nbytes() == 0 and pool.held_bytes() == 60
    husk = pool.lend(storage, 60)  # the same size: the same memory again, no allocation
    assert storage.data_ptr() == address and pool.held_bytes() == 0
    target.mul_(2)
    assert torch.equal(view, (torch.arange(15.0).view(3, 5) * 2).t())
    pool.take_back(storage, husk)


def test_other_sizes_allocate_and_the_pool_stays_bounded():
    pool = StoragePool(max_free_bytes=100, max_idle_lends=10)
    targets = [_empty_target((n,)) for n in (10, 10, 20)]  # 40, 40, 80 bytes
    husks = [pool.lend(t.untyped_storage(), t.numel() * 4) for t in targets]
    assert len({t.untyped_storage().data_ptr() for t in targets}) == 3
    for t, h in zip(targets, husks):
        pool.take_back(t.untyped_storage(), h)
    # 160 bytes returned, at most 100 kept: the oldest (the first 40-byte storage) was dropped
    assert pool.held_bytes() == 80  # the two 40-byte storages were dropped, oldest first
    for t in targets:
        assert t.untyped_storage().nbytes() == 0


def test_lend_refuses_a_storage_that_holds_memory():
    pool = StoragePool(max_free_bytes=100, max_idle_lends=10)
    try:
        pool.lend(torch.empty(4).untyped_storage(), 16)
    except AssertionError:
        return
    raise AssertionError("lend accepted a storage that already holds memory")


def test_a_storage_idle_for_too_many_lends_is_let_go():
    pool = StoragePool(max_free_bytes=1 << 20, max_idle_lends=2)
    big, small = _empty_target((100,)), _empty_target((10,))
    pool.take_back(big.untyped_storage(), pool.lend(big.untyped_storage(), 400))  # released, like the embedding
    assert pool.held_bytes() == 400
    for _ in range(3):  # three gathers of another size later, the big storage is gone
        pool.take_back(small.untyped_storage(), pool.lend(small.untyped_storage(), 40))
    assert pool.held_bytes() == 40
