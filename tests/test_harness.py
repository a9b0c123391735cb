"""Tests of the worker-pool harness and the reference models."""

import time

import pytest
import torch

from tests import models
from tests.harness import RankError, get_pool, run_ranks


def _rank_and_sum():
    import torch.distributed as dist

    ones = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(ones)
    return dist.get_rank(), dist.get_world_size(), ones.tolist()


def _fail_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 blocks here until the pool is killed
    return "unreachable"


def _fail_everywhere():
    import torch.distributed as dist

    raise KeyError(f"bad key on {dist.get_rank()}")


def _pid():
    import os

    return os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size):
    results = run_ranks(world_size, _rank_and_sum)
    assert results == [(r, world_size, [float(world_size)] * 3) for r in range(world_size)]


def test_failure_on_one_rank_kills_blocked_pool():
    pool = get_pool(2)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(_fail_on_rank1, timeout=20)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 1 failed" in message and "boom on purpose" in message
    assert "ranks 0 did not answer" in message
    assert info.value.missing == [0] and list(info.value.tracebacks) == [1]
    assert not pool.alive()
    fresh = get_pool(2)
    assert fresh is not pool
    assert [r for r, _, _ in fresh.run(_rank_and_sum)] == [0, 1]


def test_failure_on_all_ranks_keeps_pool():
    pool = get_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(_fail_everywhere, timeout=20)
    message = str(info.value)
    assert "rank 0 failed" in message and "rank 1 failed" in message
    assert "bad key on 1" in message
    assert get_pool(2) is pool and pool.alive()


def test_pool_reuses_workers():
    first = run_ranks(3, _pid)
    second = run_ranks(3, _pid)
    assert first == second and len(set(first)) == 3


def test_unpicklable_fn_is_rejected_in_parent():
    with pytest.raises(Exception, match="(?i)pickle|local"):
        run_ranks(1, lambda: 0)
    assert run_ranks(1, _pid)  # pool untouched


def _environment():
    import os

    return os.environ.get("ZERO_TEST_HARNESS_PROBE"), os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def test_fresh_pool_sees_the_parents_environment_and_one_thread(monkeypatch):
    """Workers forked from the preloaded server ([Note: workers forked from a preloaded server]) see the
    environment the parent has when their pool starts, as spawned ones did, with one intra-op thread."""
    get_pool(2).close()
    monkeypatch.setenv("ZERO_TEST_HARNESS_PROBE", "set before the pool started")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_ranks(2, _environment) == [("set before the pool started", "1", 1)] * 2


def _frozen_and_collected():
    import gc

    import torch

    made = torch.zeros(3)  # made by the call: tracked (and so listed as live) as without the freeze
    return gc.get_freeze_count(), any(o is made for o in gc.get_objects())


def test_workers_freeze_the_preloaded_heap():
    """[Note: the preloaded heap frozen in each worker]: the objects of the preloaded modules are frozen, so a
    collection after each call does not walk them; what a call makes is still tracked."""
    for frozen, listed in run_ranks(2, _frozen_and_collected):
        assert frozen > 100_000 and listed, (frozen, listed)


def test_reference_train_mlp_loss_decreases():
    batches = models.make_batches("mlp", 8, world_size=2, per_rank_batch=4, seed=0)
    assert batches[0][0].shape == (8, 7) and batches[0][1].dtype == torch.float64
    shards = [models.shard_batch(batches[0], r, 2) for r in range(2)]
    assert torch.equal(torch.cat([s[0] for s in shards]), batches[0][0])
    out = models.reference_train(models.make_odd_mlp, models.two_group_adamw, batches, steps=8, clip=1.0)
    assert out["losses"][-1] < out["losses"][0]
    assert len(out["clip_norms"]) == 8
    assert models.update_norm_error(out["params"], out["params"], out["init_params"]) == 0.0
    assert models.max_abs_diff(out["params"], out["init_params"]) > 0


def test_odd_mlp_structure():
    model = models.make_odd_mlp()
    assert _count_blocks(model) >= 3 and "OddBlock" in model._no_split_modules
    assert model.offset.shape == (3,) and model.scale.shape == (1,)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ref = models.make_odd_mlp()
    assert models.max_abs_diff(dict(model.named_parameters()), dict(ref.named_parameters())) == 0


def _count_blocks(model):
    return sum(isinstance(m, models.OddBlock) for m in model.modules())


def test_tiny_llama_ties_and_runs():
    model = models.make_tiny_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = models.make_tiny_llama(tie=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    batch = models.make_batches("llama", 1, world_size=2, per_rank_batch=2)[0]
    assert batch["input_ids"].shape == (4, 12) and int(batch["input_ids"].max()) < 97
    assert torch.isfinite(models.loss_fn(model, batch))


def test_tiny_llama_lora_only_lora_trainable():
    model = models.make_tiny_llama_lora()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    batches = models.make_batches("llama", 2, world_size=1, per_rank_batch=2)
    out = models.reference_train(models.make_tiny_llama_lora, models.two_group_adamw, batches, steps=1, accum=2)
    moved = {n for n in out["params"] if not torch.equal(out["params"][n], out["init_params"][n])}
    assert moved and all("lora_" in n for n in moved)
