"""Stage-3 behaviour beyond the training loop: generation, evaluation without autograd, unusual module
structures, ``zp.gathered_parameters``, the prefetch bound, memory and communication accounting, a branch
taken on one rank only, and LoRA with activation checkpointing.

Two ranks unless a test says otherwise; the workers are in ``stage3_behaviour_workers.py``, except those
for generation and evaluation (``stage3_generate_workers.py``) and for the prefetch bound, memory and
communication (``stage3_accounting_workers.py``); each builds its own single-process reference from the
same seeded model.  Tests that could hang pass a short ``timeout=`` to ``run_ranks`` so that a hang fails the
test (the harness kills the pool) instead of the suite.
"""

from __future__ import annotations

import math

import pytest

from tests.harness import RankError, get_pool, run_ranks
from tests.unit import stage3_accounting_workers as aw
from tests.unit import stage3_behaviour_workers as w
from tests.unit import stage3_generate_workers as gw

F64 = 1e-10  # float64 parity: only summation order differs
FP32_UPDATE = 1e-3  # fp32 update-norm error ||θ - θ_ref|| / ||θ_ref - θ0||
FP32_REL = 1e-4  # fp32 loss / clip-norm relative error


def check_parity_f64(r: dict, what: str) -> None:
    assert r["moved"] > 1e-3, f"{what}: the reference did not move, the check would be vacuous"
    assert r["max_abs_diff"] <= F64, f"{what}: max |θ - θ_ref| = {r['max_abs_diff']:.3g} > {F64}"
    assert r["loss_rel"] <= F64, f"{what}: loss relative error {r['loss_rel']:.3g}"
    assert r["clip_rel"] <= F64, f"{what}: clip-norm relative error {r['clip_rel']:.3g}"


# -- generate ---------------------------------------------------------------------------------------------------


def test_generate_matches_unsharded_model():
    results = run_ranks(2, gw.generate_worker, [5, 5], [8, 8], None, timeout=120)
    for rank, r in enumerate(results):
        assert r["got"] == r["want"], f"rank {rank}: stage-3 generate {r['got']} != unsharded {r['want']}"
        assert len(r["got"][0]) > 5, f"rank {rank}: nothing generated"
        assert r["unsharded_after"] == [] and r["sharded_after"], r


def test_generate_ranks_of_different_lengths_with_synced_gpus():
    # Rank 1 has a longer prompt and stops after 3 tokens; with synced_gpus=True it keeps running forwards
    # (whose output it discards) until rank 0 is done, so both ranks issue the same collectives.
    results = run_ranks(2, gw.generate_worker, [5, 7], [8, 3], True, timeout=120)
    for rank, r in enumerate(results):
        assert r["got"] == r["want"], f"rank {rank}: stage-3 generate {r['got']} != unsharded {r['want']}"
        assert r["unsharded_after"] == [] and r["sharded_after"], r


def test_generate_ranks_of_different_lengths_default_synced_gpus():
    # The user passes nothing: generate() must sync by itself (transformers turns synced_gpus on for modules
    # marked _is_fsdp_managed_module, which stage-3 setup sets). Without it rank 0 would block forever in the
    # all-gather of its 4th forward; the short timeout turns that into a failure.
    results = run_ranks(2, gw.generate_worker, [5, 7], [8, 3], None, timeout=30)
    for rank, r in enumerate(results):
        assert r["got"] == r["want"], f"rank {rank}: stage-3 generate {r['got']} != unsharded {r['want']}"


# -- eval without autograd -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_without_autograd_then_train(mode):
    for rank, r in enumerate(run_ranks(2, gw.eval_worker, mode, timeout=120)):
        assert max(r["logit_diffs"]) <= 1e-6, f"rank {rank}: |logits - unsharded logits| = {r['logit_diffs']}"
        assert r["unsharded_after_eval"] == [], f"rank {rank}: still gathered after eval {r['unsharded_after_eval']}"
        assert r["sharded_after_eval"], f"rank {rank}: some param.data is not its 1-D shard after eval"
        assert r["update_norm_error"] <= FP32_UPDATE, f"rank {rank}: training after eval: {r}"
        assert r["loss_rel"] <= FP32_REL and r["clip_rel"] <= FP32_REL, f"rank {rank}: {r}"
        assert r["unsharded_after_train"] == [], r


# -- unusual structures --------------------------------------------------------------------------------------------


def test_unit_called_twice_per_forward():
    for rank, r in enumerate(run_ranks(2, w.twice_worker, timeout=120)):
        check_parity_f64(r, f"rank {rank}")
        assert r["n_units"] == 4 and r["unsharded_after"] == [], r


def test_tied_weight_between_modules_of_different_units():
    for rank, r in enumerate(run_ranks(2, w.tied_worker, timeout=120)):
        check_parity_f64(r, f"rank {rank}")
        assert r["still_tied"], "head.weight is no longer embed.weight"
        assert {"embed", "head"} <= set(r["units"]), f"embedding and head must be units: {r['units']}"
        # The shared weight has exactly one owner; the policy gives it to the root unit.
        assert r["tied_weight_unit"] == "<root>", r["tied_weight_unit"]


def test_flat_shards_are_the_gather_input():
    # [Note: flat shards]: shards stored in the compute dtype live in one tensor per unit, sent as they are.
    for rank, r in enumerate(run_ranks(2, w.flat_shards_worker, None)):
        check_parity_f64(r, f"rank {rank}")
        assert set(r["storages"].values()) == {1}, f"rank {rank}: a unit's shards in several tensors: {r['storages']}"
        assert r["copy_ins"] == 0, f"rank {rank}: {r['copy_ins']} gathers copied the shards in"
    # fp32 shards under bf16 compute: cast in at each gather (one batched copy per gather)
    for rank, r in enumerate(run_ranks(2, w.flat_shards_worker, "bfloat16")):
        assert r["copy_ins"] > 0, f"rank {rank}: mixed precision gathers must cast the fp32 shards in"
        assert all(map(math.isfinite, r["losses"])), r["losses"]


# -- gathered_parameters -----------------------------------------------------------------------------------------


def test_gathered_parameters_read_and_modify():
    for rank, r in enumerate(run_ranks(2, w.gathered_worker, timeout=120)):
        assert r["shapes_inside"] == r["ref_shapes"], f"rank {rank}: shapes inside {r['shapes_inside']}"
        assert r["diff_inside"] <= F64, f"rank {rank}: gathered values differ from the reference by {r['diff_inside']}"
        assert len(r["unsharded_inside"]) == 4, r["unsharded_inside"]  # root + three blocks
        assert r["sharded_after_plain"] and r["sharded_after_modify"], r
        assert r["subset_unsharded"] == ["blocks.1"], f"subset gathered {r['subset_unsharded']}"
        assert r["subset_shape"] == (15, 15), r["subset_shape"]
        if rank == 0:
            assert r["diff_full_state_dict_after_edit"] <= F64, r
        assert r["diff_gathered_after_edit"] <= F64, f"rank {rank}: rank 0's edit not visible: {r}"
        assert r["moved_by_next_step"] > 1e-4, r
        assert r["diff_after_next_step"] <= F64, f"rank {rank}: training after the edit: {r}"


# -- prefetch bound -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch_depth", [1, 2])
def test_at_most_prefetch_depth_plus_one_units_gathered(prefetch_depth):
    for rank, r in enumerate(run_ranks(2, aw.prefetch_worker, prefetch_depth, timeout=120)):
        peak = r["peak"]
        assert r["n_blocks"] == 6
        for phase in ("forward", "backward"):
            assert peak[phase] <= prefetch_depth + 1, f"rank {rank} {phase}: {peak[phase]} units gathered at once"
            # The bound is reached: prefetching really overlaps the next unit's gather with this unit.
            assert peak[phase] == prefetch_depth + 1, f"rank {rank} {phase}: peak {peak} (no prefetch?)"
        assert peak.get("async_gathers", 0) > 0, peak
        assert r["max_abs_diff"] <= F64, r


# -- memory -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,world_size", [("llama", 2), ("llama", 4), ("mlp32", 4)])
def test_memory_report_matches_theory_and_storage_count(kind, world_size):
    """fp32 AdamW after backward, before step: params 4Ψ/N + grads 4Ψ/N + moments 8Ψ/N = 16Ψ/N, up to the
    padding of each parameter's last shard and AdamW's 4-byte step tensor per parameter."""
    for rank, r in enumerate(run_ranks(world_size, aw.memory_worker, kind, timeout=120)):
        if kind == "mlp32":
            assert r["padded"] > r["psi"], "the mlp case is there to exercise padding"
        measured, theory, own, exact = r["measured"], r["theory"], r["own"], r["exact"]
        assert r["unsharded_bytes"] == 0 and r["unsharded_units"] == [], r
        assert r["param_grads"] == 0, "param.grad must be None after the reduce-scatter"
        for key in ("params", "grads", "optimizer", "total"):
            assert measured[key] == own[key] == exact[key], (rank, key, measured, own, exact)
        assert theory["total"] == pytest.approx(r["sixteen_psi_over_n"]), theory
        # Padding: a rank's valid range differs from numel / N by at most N - 1 elements per parameter
        # (16 bytes each over params, grads and Adam moments); plus AdamW's 4-byte step tensor per parameter.
        slack = 16 * (world_size - 1) * r["n_params"] + r["step_bytes"]
        for key, per_elem in (("params", 4), ("grads", 4), ("optimizer", 8)):
            bound = per_elem * (world_size - 1) * r["n_params"] + (r["step_bytes"] if key == "optimizer" else 0)
            assert abs(measured[key] - theory[key]) <= bound, (rank, key, measured, theory)
        assert abs(measured["total"] - theory["total"]) <= slack, (rank, measured, theory, slack)


# -- communication ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
@pytest.mark.parametrize("kind,world_size", [("llama", 2), ("mlp", 4)])
def test_comm_bytes_per_step(kind, world_size, buffered):
    """Per step (forward + backward + step), per rank, in logical bytes (see collectives.py):
    all-gather = root once + every block twice (forward, and again in backward after resharding);
    reduce-scatter = every trainable unit once; each parameter padded to a multiple of N.  Collectives
    may add a few metadata elements (unit tag, has-gradient flags): the excess over the payload is
    checked against a small structural bound, and reported on failure."""
    for rank, r in enumerate(run_ranks(world_size, aw.comm_worker, kind, 2, buffered, timeout=120)):
        per_step, payload, meta = r["per_step"], r["payload"], r["metadata_bound"]
        assert set(per_step) == {"all_gather", "reduce_scatter", "all_reduce", "control", "total"}, (
            f"unexpected {per_step}"
        )
        for op in ("all_reduce", "control"):
            assert per_step[op] == payload[op], (op, per_step[op], payload[op])
        per_step["total"] = {
            key: per_step["total"][key] - payload["all_reduce"][key] - payload["control"][key]
            for key in ("calls", "bytes")
        }
        for op in ("all_gather", "reduce_scatter"):
            got = per_step[op]
            assert got["calls"] == payload[op]["calls"], (rank, op, got, payload[op])
            excess = got["bytes"] - payload[op]["bytes"]
            assert 0 <= excess <= meta[op], (
                f"rank {rank} {op}: {got['bytes']} bytes/step, payload "
                f"{payload[op]['bytes']}, metadata bound {meta[op]}"
            )
        # Against the paper's 3Ψ: the root and the last unit are gathered once, not twice (they stay gathered
        # from forward into backward); collectives carry each parameter's padding (at most N - 1 elements, three times).
        elem, total = r["elem"], per_step["total"]["bytes"]
        three_psi = 3 * r["psi"] * elem
        slack = 3 * r["padding_bound"] + meta["all_gather"] + meta["reduce_scatter"]
        assert three_psi - r["root_padded_bytes"] <= total <= three_psi + slack, (rank, total, three_psi, r)


# -- a branch taken on one rank only ------------------------------------------------------------------------------


def _discard_pool(world_size: int) -> None:
    """After a collective-order divergence the ranks' process group may still hold unmatched collectives
    (gloo aborts a process whose pending broadcast meets one of another size): the next test gets fresh
    workers."""
    get_pool(world_size).close(force=True)


@pytest.mark.parametrize("skipped_is_larger", [False, True], ids=["same-size", "larger"])
def test_branch_on_one_rank_works_or_fails_fast(skipped_is_larger):
    """Rank 1 skips block 2. Acceptable outcomes: DDP-semantics training (the skipped block's gradient from
    rank 1 is zero), or a prompt error that names the unit. Never a hang, never silently wrong weights.

    Same-size: rank 0's gather of blocks.2 meets rank 1's gather of blocks.3 and both have the same size,
    so without a check the weights would be silently mixed.  Larger: the paired gathers differ in size."""
    try:
        results = run_ranks(2, w.branch_worker, skipped_is_larger, timeout=30)
    except RankError as err:
        _discard_pool(2)
        assert not err.missing, f"hang: ranks {err.missing} did not answer\n{err}"
        assert "blocks.2" in str(err), f"the error must name the unit blocks.2:\n{err}"
        return
    for rank, r in enumerate(results):
        assert r["max_abs_diff"] <= F64, f"rank {rank}: silently wrong weights, max diff {r['max_abs_diff']:.3g}"


def test_branch_on_one_rank_with_debug_collectives_names_the_unit_on_every_rank():
    """debug_collectives adds a fixed-size order check before each gather, so even gathers of different
    sizes (which gloo cannot pair) end in the same clear error on every rank."""
    with pytest.raises(RankError) as info:
        run_ranks(2, w.branch_worker, True, debug=True, timeout=30)
    _discard_pool(2)
    err = info.value
    assert not err.missing and sorted(err.tracebacks) == [0, 1], err
    for rank, text in err.tracebacks.items():
        assert "collective order diverged" in text and "blocks.2" in text or "blocks.3" in text, (rank, text)


# -- LoRA + activation checkpointing through transformers ---------------------------------------------------------


def test_lora_with_gradient_checkpointing_trains_adapters():
    for rank, r in enumerate(run_ranks(2, w.lora_checkpointing_worker, timeout=120)):
        assert r["finite"], r["losses"]
        assert r["n_lora"] == 8, r["n_lora"]  # A and B on q_proj and v_proj of two layers
        assert r["lora_moved"] > 0, f"rank {rank}: some adapter did not change"
        assert r["base_moved"] == 0, f"rank {rank}: frozen base changed by {r['base_moved']}"
        assert r["update_norm_error"] <= FP32_UPDATE, r
        assert r["unsharded_after"] == [], r


@pytest.mark.parametrize("trim", [True, False])
def test_trim_host_heap_switch_reaches_the_runtime(trim, monkeypatch):
    """``ZeroConfig.trim_host_heap`` ([Note: heap trimming]): on CPU the stage-3 hooks trim the heap only
    when it is on."""
    import torch

    import zero_plugin as zp
    import zero_plugin.stage3.hooks as hooks

    calls = []
    monkeypatch.setattr(hooks, "trim_host_heap", lambda *a, **k: calls.append(1) or True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3, trim_host_heap=trim))
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert bool(calls) == trim


def test_choose_heap_trim():
    """[Note: eager trimming when memory is tight]: before every unit's gather only when the rank holds more
    than ``trim_each_unit_above`` of its share of the host's memory (or the bound is 0); never when off or
    on CUDA; at the end of forward otherwise, also where the share is unknown."""
    from zero_plugin.engines.hostmem import HeapTrim, choose_heap_trim

    assert choose_heap_trim(True, True, 0.33, 0.5) is HeapTrim.EACH_UNIT
    assert choose_heap_trim(True, True, 0.33, 0.2) is HeapTrim.FORWARD
    assert choose_heap_trim(True, True, 0.33, None) is HeapTrim.FORWARD
    assert choose_heap_trim(True, True, 0.0, None) is HeapTrim.EACH_UNIT
    assert choose_heap_trim(True, True, 1.0, 0.9) is HeapTrim.FORWARD
    assert choose_heap_trim(False, True, 0.0, 0.9) is HeapTrim.OFF
    assert choose_heap_trim(True, False, 0.0, 0.9) is HeapTrim.OFF


_PRELOAD_PROBE = """
import json, torch, zero_plugin as zp
from zero_plugin.engines.engine import engine_of
from zero_plugin.engines.hostmem import malloc_preloaded
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), zp.ZeroConfig(stage=3))
model(torch.ones(3, 4)).sum().backward()
opt.step()
engine = engine_of(model, "probe")
print(json.dumps([malloc_preloaded(), engine.storage_pool is not None, engine.runtime.trim_heap.value]))
"""


def test_stage3_neither_trims_nor_pools_under_a_preloaded_allocator(tmp_path):
    """[Note: host allocator]: with a malloc preloaded in front of glibc's (here a stand-in built by the test that
    forwards to glibc's, so the process runs as before) stage 3 drops its two ways around glibc's heap, the trim
    and the storage pool; without one both stay."""
    import json
    import os
    import subprocess
    import sys

    source = tmp_path / "shim.c"
    source.write_text(
        "#include <stddef.h>\nextern void *__libc_malloc(size_t);\nvoid *malloc(size_t n) { return __libc_malloc(n); }\n"
    )
    shim = tmp_path / "libshim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    base.update(OMP_NUM_THREADS="1")

    def probe(env):
        out = subprocess.run(
            [sys.executable, "-c", _PRELOAD_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert probe(base) == [False, True, "forward"]
    assert probe({**base, "LD_PRELOAD": str(shim)}) == [True, False, "off"]


def test_local_processes_reads_local_world_size():
    import zero_plugin as zp

    assert zp.ZeroConfig.local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert zp.ZeroConfig.local_processes({}) == 1
    assert zp.ZeroConfig.local_processes({"LOCAL_WORLD_SIZE": "x"}) == 1
    # Lightning's launcher sets no LOCAL_WORLD_SIZE: the engine passes the world size instead
    assert zp.ZeroConfig.local_processes({}, default=3) == 3
    assert zp.ZeroConfig.local_processes({"LOCAL_WORLD_SIZE": "2"}, default=4) == 2


@pytest.mark.parametrize("above", [0.0, 1.0])
def test_trim_each_unit_reaches_the_runtime_and_leaves_the_numbers(above, monkeypatch):
    """``trim_each_unit_above=0`` (always): the hooks trim before every unit's gather in forward and backward
    and at the end of forward; ``1.0`` (never, this small process): at the end of forward only.  Trimming
    frees pages, never values: loss and gradients equal those with trimming off, bit for bit."""
    import torch

    import zero_plugin as zp
    import zero_plugin.stage3.hooks as hooks

    def run(config, calls=None):
        if calls is not None:
            monkeypatch.setattr(hooks, "trim_host_heap", lambda *a, **k: calls.append(1) or True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        unit_classes = (torch.nn.Linear,)
        model, opt = zp.setup(model, opt, config.replace(unit_classes=unit_classes))
        loss = model(torch.linspace(-1, 1, 12).view(3, 4)).square().sum()
        loss.backward()
        opt.step()
        with zp.gathered_parameters(list(model.parameters()), model=model):
            return loss.item(), [p.detach().clone() for p in model.parameters()]

    calls: list = []
    loss, params = run(zp.ZeroConfig(stage=3, trim_each_unit_above=above), calls)
    monkeypatch.undo()
    ref_loss, ref_params = run(zp.ZeroConfig(stage=3, trim_host_heap=False))
    assert loss == ref_loss and all(torch.equal(p, q) for p, q in zip(params, ref_params))
    # 3 units (root + 2 Linears): with every unit, 3 gathers in forward, 3 in backward, plus the forward's end
    assert len(calls) == (7 if above == 0.0 else 1), calls
