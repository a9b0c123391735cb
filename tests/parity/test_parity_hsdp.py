"""Hierarchical sharding (``ZeroConfig.shard_group_size``, HSDP / MiCS) on 4 gloo ranks as 2 "nodes" x 2.

States are sharded within shard groups {0, 1} and {2, 3} and replicated across them; gradients are
reduced in the shard group, then the reduced shard is all-reduced across the replica group {0, 2} / {1, 3}
([Note: hierarchical groups] in zero_plugin/comm/collectives.py, [Note: sum across replicas] in comm/layout.py).

Parity: OddMLP (float64, odd shapes that pad at k=2) against the single-process reference that sees the
whole global batch, with accumulation (``zp.no_sync``) and clipping, at stages 1-3, CPU offload, and the
buffered (NCCL) layout; every rank's full parameters within 1e-10, losses and clip norms 1e-10 relative
(only the summation order differs from the reference).  The clip norm is over one copy of the gradients:
summing over the replicas as well would give sqrt(2) times the true norm and fail these bounds.

Communication per step and rank, in logical bytes ([Note: logical bytes]): across groups one all-reduce of
this rank's reduced regions and their has-gradient flags per reduction record, 2 * (Ψ_local + flags) elements,
Ψ_local ~ Ψ/k; within the group what a world of k moves (stages 1-2: Ψ reduce-scatter + Ψ all-gather +
flags + the clip norm; stage 3: checked equal to a plain world-2 run's traffic).

Memory: ``memory_report``'s theory with N = k (16Ψ/k at stage 3), measured within 4 KiB of it.
Checkpoints: one copy written (files of a world of k), loaded at k=None / world 2 and back.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import hsdp_workers, workers

WORLD, K = 4, 2
STEPS, ACCUM, GLOBAL_ROWS = 5, 2, 12
MAX_NORM = 0.5
MEMORY_TOL_BYTES = 4096


@functools.cache
def batches() -> list:
    return models.make_batches("mlp", STEPS * ACCUM, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=0)


@functools.cache
def reference() -> dict:
    holder = {}

    def opt_fn(model):
        opt = holder["opt"] = workers.build_optimizer(model)
        return opt

    out = models.reference_train(
        functools.partial(workers.build_model, "mlp"), opt_fn, batches(), steps=STEPS, accum=ACCUM, clip=MAX_NORM
    )
    out["optim"] = holder["opt"].state_dict()
    return out


def _rel(got, want) -> float:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((got - want).abs() / want.abs()).max().item()


def test_reference_clip_bites_on_some_steps():
    norms = reference()["clip_norms"]
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms


@pytest.mark.parametrize(
    "stage, k, offload, buffered",
    [
        (1, K, False, False),
        (2, K, False, False),
        (3, K, False, False),
        (2, K, True, False),
        (3, K, True, False),
        (2, K, False, True),
        (3, K, False, True),
        (2, 1, False, False),  # shard groups of one rank: plain replication through the replica all-reduce
        (3, "node", False, False),  # LOCAL_WORLD_SIZE=2 in the workers' environment (set below)
    ],
)
def test_parity_with_reference(stage, k, offload, buffered):
    ref = reference()
    args = ("mlp", stage, k, batches(), STEPS, ACCUM, MAX_NORM, offload, buffered)
    results = run_ranks(WORLD, hsdp_workers.with_local_world_size, 2, hsdp_workers.parity_worker, *args)
    want_k = 1 if k == 1 else K
    for rank, r in enumerate(results):
        where = f"stage {stage} k={k} offload={offload} buffered={buffered} rank {rank}"
        assert (r["shard_world"], r["shard_rank"], r["dp_size"]) == (want_k, rank % want_k, WORLD), where
        assert _rel(r["clip_norms"], ref["clip_norms"]) <= 1e-10, f"{where}: clip norms {r['clip_norms']}"
        full = {n: r["full"][n] for n in ref["params"]}
        diff = models.max_abs_diff(full, ref["params"])
        assert diff <= 1e-10, f"{where}: max |θ - θ_ref| = {diff:.3g}"
        assert (r["full_rank0"] != {}) == (rank == 0), f"{where}: full_state_dict(rank0_only) on world rank 0 only"
        assert (r["optim_full"] != {}) == (rank == 0), f"{where}: consolidate_state_dict on world rank 0 only"
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0).tolist()
    assert _rel(losses, ref["losses"]) <= 1e-10
    state, want = results[0]["optim_full"]["state"], ref["optim"]["state"]
    for idx, entry in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[idx][key], entry[key], rtol=1e-8, atol=1e-14)


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_step_within_and_across_groups(stage, buffered):
    batch = batches()[0]
    hier = run_ranks(WORLD, hsdp_workers.comm_worker, "mlp", stage, K, batch, MAX_NORM, buffered)
    plain = run_ranks(K, hsdp_workers.comm_worker, "mlp", stage, None, batch, MAX_NORM, buffered)
    for rank, r in enumerate(hier):
        stats, where = r["stats"], f"stage {stage} rank {rank}"
        assert stats["replica_group"]["bytes"] == r["expected_replica"], f"{where}: {stats}"
        # 2 Ψ/k elements (float64) plus the flags: Ψ_local is this rank's share of Ψ.
        assert r["expected_replica"] >= 2 * 8 * r["local_psi"]
        if "expected_shard" in r:
            assert stats["shard_group"]["bytes"] == r["expected_shard"], f"{where}: {stats}"
        # Within the group: exactly what a world of k moves without replicas (same shard rank).
        mine = plain[rank % K]["stats"]
        assert "shard_group" not in mine and "replica_group" not in mine, "default path: no group entries"
        want = mine["total"]["bytes"] - mine.get("control", {"bytes": 0})["bytes"]
        assert stats["shard_group"]["bytes"] == want, f"{where}: shard group {stats['shard_group']} vs world-2 {mine}"
        kinds = stats["total"]["bytes"] - stats.get("control", {"bytes": 0})["bytes"]
        assert kinds == stats["shard_group"]["bytes"] + stats["replica_group"]["bytes"], f"{where}: {stats}"


def _theory(stage: int, n: int, psi: int) -> dict[str, float]:
    out = {  # fp32 AdamW: 4 + 4 + 8 bytes per parameter, sharded as the stage says
        "params": 4 * psi / (n if stage == 3 else 1),
        "grads": 4 * psi / (n if stage >= 2 else 1),
        "optimizer": 8 * psi / n,
    }
    out["total"] = sum(out.values())
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_matches_theory_of_the_shard_group(stage, offload):
    from tests.unit import memory_comm_workers

    psi, _ = memory_comm_workers.numel_of_model()
    want = _theory(stage, K, psi)
    assert stage < 3 or want["total"] == pytest.approx(16 * psi / K)
    for rank, report in enumerate(run_ranks(WORLD, hsdp_workers.memory_worker, stage, K, offload)):
        where = f"stage {stage} offload={offload} rank {rank}"
        assert (report["world_size"], report["replicas"]) == (K, WORLD // K), where
        for key, value in want.items():
            assert report["theory"][key] == pytest.approx(value, abs=1), f"{where}: theory[{key}]"
            got = report["measured"][key]
            assert abs(got - value) <= MEMORY_TOL_BYTES, f"{where}: measured[{key}] {got} vs theory {value:.0f}"


def _assert_same_state(a: dict, b: dict, tol: float, what: str) -> None:
    assert sorted(a) == sorted(b), what
    diff = models.max_abs_diff(a, b)
    assert diff <= tol, f"{what}: max diff {diff:.3g}"


@pytest.mark.parametrize("save_stage, load_stage", [(2, 2), (3, 1)])
def test_checkpoint_one_copy_and_reshard_both_ways(tmp_path, save_stage, load_stage):
    path = str(tmp_path / "ckpt")
    b = batches()
    # k=2 on 4 ranks -> k=None on 2 ranks
    saved = run_ranks(WORLD, hsdp_workers.checkpoint_worker, "mlp", save_stage, K, b, MAX_NORM, path, "save")
    files = saved[0]["files"]
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"], files
    loaded = run_ranks(K, hsdp_workers.checkpoint_worker, "mlp", load_stage, None, b, MAX_NORM, path, "load")
    for r in loaded:
        assert r["extra"] == {"step": 1}
        _assert_same_state(r["full"], saved[0]["full"], 0.0, "k=2 checkpoint loaded at world 2")
    # ... and back: k=None on 2 ranks -> k=2 on 4 ranks
    path2 = str(tmp_path / "ckpt2")
    saved2 = run_ranks(K, hsdp_workers.checkpoint_worker, "mlp", save_stage, None, b, MAX_NORM, path2, "save")
    back = run_ranks(WORLD, hsdp_workers.checkpoint_worker, "mlp", load_stage, K, b, MAX_NORM, path2, "load")
    for r in back:
        _assert_same_state(r["full"], saved2[0]["full"], 0.0, "world-2 checkpoint loaded at k=2, world 4")
    # The step after the load trains the same, whichever setting loaded it (optimizer state included).
    for r in back:
        _assert_same_state(r["after"], loaded[0]["after"], 1e-12, "a step after loading")


@pytest.mark.slow  # 48-80 s on the shared 2-core machine: six processes import torch
def test_torchrun_two_nodes_node_groups(tmp_path):
    """Two torchrun launchers on loopback (--nnodes 2 --nproc_per_node 2, node ranks 0 and 1), stage 3 with
    shard_group_size="node": each node is a shard group; parity with the reference as above."""
    import os
    import subprocess
    import sys

    from tests import launching
    from tests.harness import REPO_ROOT

    port = str(launching.free_port())
    script = os.path.join(REPO_ROOT, "tests", "parity", "hsdp_torchrun_script.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
            + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port]
            + [script, str(tmp_path), str(STEPS), str(ACCUM), str(MAX_NORM)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    ref = reference()
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        assert r["shard_world"] == 2
        assert _rel(r["clip_norms"], ref["clip_norms"]) <= 1e-10, f"rank {rank}: clip norms"
        diff = models.max_abs_diff({n: r["full"][n] for n in ref["params"]}, ref["params"])
        assert diff <= 1e-10, f"rank {rank}: max |θ - θ_ref| = {diff:.3g}"


def test_node_group_size_must_agree_on_every_rank():
    for message in run_ranks(WORLD, hsdp_workers.node_disagreement_worker):
        assert 'shard_group_size="node" must give one group size on every rank' in message, message
        assert "[2, 2, None, None]" in message, message


def test_evaluation_only_stage3_shards_within_the_group():
    psi = sum(p.numel() for p in workers.build_model("mlp").parameters())
    results = run_ranks(WORLD, hsdp_workers.evaluation_worker, batches()[0])
    for rank, r in enumerate(results):
        assert r["diff"] == 0.0 and r["shard_world"] == K, (rank, r)
    assert sum(r["held"] for r in results[:K]) == psi  # one copy per shard group
    assert [r["held"] for r in results[:K]] == [r["held"] for r in results[K:]]
