"""ZeRO++ at stage 3 (arXiv 2306.10209): qwZ, qgZ and hpZ on 2 and 4 gloo ranks.

* qwZ (``quantized_weights``): every gathered element within half its block's scale of the exact value
  ([Note: qwZ gather] in zero_plugin/comm/quantized.py), off by more than 0 somewhere (it does quantize);
  ``zp.gathered_parameters`` still sees the exact shards.
* qgZ (``quantized_gradients``): every element of the reduced shard within the bound of [Note: qgZ reduction]
  (sum over source ranks of scale / 2, over N) of the exact average, measured against each rank's own
  unsharded gradients; a quantizer with half the scale breaks that bound.
* hpZ (``secondary_shard_size``): bit-identical to plain stage 3 at every step (lossless), with the backward
  gathers inside the node: counted under ``secondary_group``; also after a forward that got no backward followed
  by a write to the shards (a load, a step, a gathered edit: [Note: pending forward] in zero_plugin/stage3/hooks.py),
  in every later forward and backward.
* Bytes: ``comm_stats`` equals the formula from the launched records (int8 + scales + tag).
* Training: OddMLP (float64) with qwZ + qgZ (+ hpZ at 4 ranks) ends within 2% of the unquantized loss.
  The tiny Llama full and LoRA fine-tunes are in ``test_zeropp_finetune.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zero_plugin as zp
from tests import models
from tests.harness import run_ranks
from tests.parity import pending_forward_workers, zeropp_workers

STEPS, ROWS = 4, 8
BLOCK = 64  # small, so OddMLP's rows span several blocks and pad the last one


@functools.cache
def batches() -> list:
    return models.make_batches("mlp", STEPS, world_size=1, per_rank_batch=ROWS, seed=0)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_config_refuses_zeropp_below_stage_3_and_hpz_with_shard_groups():
    for field, value in (("quantized_weights", True), ("quantized_gradients", True), ("secondary_shard_size", 2)):
        with pytest.raises(ValueError, match=f"{field}.*requires ZeroConfig.stage=3"):
            zp.ZeroConfig(stage=2, **{field: value})
    with pytest.raises(ValueError, match="exclude each other"):
        zp.ZeroConfig(stage=3, secondary_shard_size=2, shard_group_size=2)
    with pytest.raises(ValueError, match="quantization_block"):
        zp.ZeroConfig(stage=3, quantized_weights=True, quantization_block=8)
    with pytest.raises(ValueError, match="must divide the world size 4"):
        zp.ZeroConfig(stage=3, secondary_shard_size=3).resolved_secondary_shard_size(4)
    assert (
        zp.ZeroConfig(stage=3, secondary_shard_size="node").resolved_secondary_shard_size(4, {"LOCAL_WORLD_SIZE": "2"})
        == 2
    )


@pytest.mark.parametrize("world, buffered", [(2, False), (2, True), (4, False)])
def test_qwz_gathered_weights_within_half_a_scale(world, buffered):
    results = run_ranks(world, zeropp_workers.qwz_gather_worker, "mlp", BLOCK, buffered)
    for rank, r in enumerate(results):
        assert r.pop("gathered_exact"), f"rank {rank}: gathered_parameters must see the exact shards"
        worst = 0.0
        for name, e in r.items():
            assert (e["err"] <= e["bound"] * (1 + 1e-12)).all(), f"rank {rank} {name}: {(e['err'] - e['bound']).max()}"
            worst = max(worst, e["err"].max().item() if e["err"].numel() else 0.0)
        assert worst > 0, "qwZ gathered exact values: nothing was quantized"


@pytest.mark.parametrize("world", [2, 4])
def test_qgz_reduced_shard_within_bound(world):
    results = run_ranks(world, zeropp_workers.qgz_bound_worker, "mlp", batches()[0], BLOCK)
    worst = 0.0
    for rank, r in enumerate(results):
        for name, e in r.items():
            assert (e["err"] <= e["bound"] * (1 + 1e-9) + 1e-15).all(), f"rank {rank} {name}"
            worst = max(worst, e["err"].max().item() if e["err"].numel() else 0.0)
    assert worst > 0, "qgZ reduced exactly: nothing was quantized"


def test_qgz_bound_fails_with_a_wrong_scale():
    results = run_ranks(2, zeropp_workers.qgz_bound_worker, "mlp", batches()[0], BLOCK, True)
    assert any((e["err"] > e["bound"] * (1 + 1e-9) + 1e-15).any() for r in results for e in r.values())


@pytest.mark.parametrize("k, buffered", [(2, False), (2, True), ("node", False)])
def test_hpz_bit_identical_to_plain_stage3(k, buffered):
    plain = run_ranks(4, zeropp_workers.train_worker, "mlp", batches(), STEPS, buffered)
    hpz = run_ranks(
        4, zeropp_workers.train_worker, "mlp", batches(), STEPS, buffered, secondary_shard_size=k, local_world_size=2
    )
    for rank in range(4):
        assert hpz[rank]["losses"] == plain[rank]["losses"]
        for step, (got, want) in enumerate(zip(hpz[rank]["params"], plain[rank]["params"])):
            for name in want:
                assert torch.equal(got[name], want[name]), f"rank {rank} step {step} {name}"
    assert not _same(plain[0]["params"][-1], plain[0]["params"][0]), "training moved nothing"


@pytest.mark.parametrize("sequence", list(pending_forward_workers.SEQUENCES))
def test_hpz_after_a_forward_without_backward_bit_identical_to_plain(sequence, tmp_path):
    """Issue #38: a forward under autograd that gets no backward keeps its secondary shards; a write to the
    shards (load, step, gathered edit, checkpoint load) before the next forward must not leave them to serve
    the old weights.  Every loss, shard gradient and shard as plain stage 3's, bit for bit."""
    ops = pending_forward_workers.SEQUENCES[sequence]
    plain = run_ranks(4, pending_forward_workers.sequence_worker, "mlp", batches(), ops, ckpt_dir=str(tmp_path / "p"))
    hpz = run_ranks(
        4,
        pending_forward_workers.sequence_worker,
        "mlp",
        batches(),
        ops,
        ckpt_dir=str(tmp_path / "h"),
        secondary_shard_size=2,
    )
    for rank in range(4):
        pending_forward_workers.assert_same_records(hpz[rank], plain[rank], f"{sequence} rank {rank}")
        assert plain[rank][-1] == ("gathered", []), plain[rank][-1]


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
def test_comm_bytes_equal_the_formula(buffered):
    batch = batches()[0]
    q = run_ranks(
        2,
        zeropp_workers.comm_worker,
        "mlp",
        batch,
        buffered,
        quantized_weights=True,
        quantized_gradients=True,
        quantization_block=BLOCK,
    )
    plain = run_ranks(2, zeropp_workers.comm_worker, "mlp", batch, buffered)
    for rank, r in enumerate(q):
        s = r["stats"]
        assert r["n_gathers"] > 0 and r["n_reduces"] > 0
        assert s["all_gather"]["bytes"] == r["gather_bytes"], (rank, s)
        assert s["all_to_all"]["bytes"] == r["all_to_all_bytes"], (rank, s)
        assert "reduce_scatter" not in s, "qgZ replaces the reduce-scatter"
        # float64 OddMLP: int8 + scales is well under 1/4 of the exact gather's and reduction's bytes
        ps = plain[rank]["stats"]
        assert s["all_gather"]["bytes"] < ps["all_gather"]["bytes"] / 4
        assert s["all_to_all"]["bytes"] < ps["reduce_scatter"]["bytes"] / 4


def test_hpz_backward_gathers_stay_in_the_node():
    batch = batches()[0]
    plain = run_ranks(4, zeropp_workers.comm_worker, "mlp", batch)
    hpz = run_ranks(4, zeropp_workers.comm_worker, "mlp", batch, secondary_shard_size=2)
    for rank in range(4):
        s, ps = hpz[rank]["stats"], plain[rank]["stats"]
        assert s["secondary_group"]["bytes"] > 0
        # the world moves only the forward gathers; the backward's run over 2 ranks instead of 4
        world_gathers = s["all_gather"]["bytes"] - s["secondary_group"]["bytes"]
        assert world_gathers < ps["all_gather"]["bytes"]
        assert s["reduce_scatter"] == ps["reduce_scatter"]


def test_hpz_secondary_memory_in_memory_report():
    for r in run_ranks(4, zeropp_workers.secondary_memory_worker, "mlp", batches()[0]):
        assert r["before"]["held"] == 0 and r["after"]["held"] == 0 and r["before"]["k"] == 2
        # float64: ~Ψ/k elements per rank (padding apart); what the forward kept (released units only)
        assert abs(r["before"]["between"] - 8 * r["psi"] / 2) <= 8 * 2 * 8
        assert 0 < r["during"]["held"] <= r["before"]["between"]


@pytest.mark.parametrize(
    "world, extra",
    [(2, {}), (4, {"secondary_shard_size": 2})],
    ids=["qwz_qgz_2", "qwz_qgz_hpz_4"],
)
def test_quantized_training_close_to_unquantized(world, extra):
    plain = run_ranks(world, zeropp_workers.train_worker, "mlp", batches(), STEPS)
    quant = run_ranks(
        world,
        zeropp_workers.train_worker,
        "mlp",
        batches(),
        STEPS,
        quantized_weights=True,
        quantized_gradients=True,
        quantization_block=BLOCK,
        **extra,
    )
    lp = sum(r["losses"][-1] for r in plain) / world
    lq = sum(r["losses"][-1] for r in quant) / world
    assert abs(lq - lp) <= 0.02 * lp, (lq, lp)
    assert not _same(quant[0]["params"][-1], plain[0]["params"][-1]), "quantization changed nothing"
