"""``model.state_dict()`` / ``load_state_dict()`` of a set-up model see full tensors at every stage (issue 19,
item 1; [Note: stage-3 state dicts] in zero_plugin/stage3/state_dict_hooks.py).

Stage 3 is the case that matters (its parameters hold 1-D shards between uses); the references are the
unsharded model's own ``state_dict()`` keys and single-process torch training on the same global batches
(float64 MLP with odd shapes: padding at 2 and 3 ranks).  The one-rank call tests pass a short
``ZeroConfig.timeout_s`` and a short harness timeout, and discard the pool after (unmatched collectives).
``save_pretrained`` through Accelerate is in tests/integrations/test_save_pretrained.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import harness, models
from tests.harness import run_ranks
from tests.unit import state_dict_workers as w

F64 = 1e-10


def _reference(kind: str, steps: int, world: int, load: dict | None = None, steps_before: int = 0) -> dict:
    """Single-process torch: ``steps`` steps on the global batches, loading ``load`` after ``steps_before``."""
    model = w.make(kind)
    opt = models.two_group_adamw(model, lr=w.LR)
    for i, batch in enumerate(w.batches(kind, steps, world)):
        if load is not None and i == steps_before:
            model.load_state_dict(load)
        models.loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_mlp_state_dict_is_full_and_matches_single_process_torch(world_size):
    results = run_ranks(world_size, w.entry_points_worker, "mlp", 2, timeout=120)
    ref = _reference("mlp", 2, world_size)
    shapes = {k: tuple(v.shape) for k, v in w.make("mlp").state_dict().items()}
    for rank, r in enumerate(results):
        assert r["keys"] == list(ref), f"rank {rank}: keys/order {r['keys']} != torch's {list(ref)}"
        assert r["saved_shapes"] == shapes, f"rank {rank}: torch.save(model.state_dict()) shapes {r['saved_shapes']}"
        assert r["devices"] == ["cpu"] and not r["still_sharded"], r["still_sharded"]
        err = models.max_abs_diff(r["state"], ref)
        assert err <= F64, f"rank {rank}: max |state_dict - torch| = {err:.3g}"
        assert r["submodule"] and r["prefixed"] and r["keep_vars"], (
            rank,
            r["submodule"],
            r["prefixed"],
            r["keep_vars"],
        )
    after = _reference("mlp", 3, world_size)
    err = models.max_abs_diff(results[0]["after"], after)
    assert err <= F64, f"a step after the state_dict calls: max |θ - θ_torch| = {err:.3g}"


@pytest.mark.parametrize("kind", ["llama", "llama_untied", "lora"])
def test_transformers_and_peft_state_dicts_are_full(kind):
    results = run_ranks(2, w.entry_points_worker, kind, 1, timeout=180)
    unsharded = w.make(kind).state_dict()
    shapes = {k: tuple(v.shape) for k, v in unsharded.items()}
    for rank, r in enumerate(results):
        assert r["keys"] == list(unsharded), f"rank {rank}: keys differ from the unsharded model's"
        assert r["saved_shapes"] == shapes, f"rank {rank}: saved shapes {r['saved_shapes']}"
        for key, value in r["state"].items():
            assert torch.equal(value, r["full"][key]), f"rank {rank}: {key} != zp.full_state_dict"
        assert r["submodule"] and r["prefixed"] and r["keep_vars"], (
            rank,
            r["submodule"],
            r["prefixed"],
            r["keep_vars"],
        )
        if kind == "llama":  # tied keys share one tensor, as torch's entries share storage
            assert r["tied_shared"], f"rank {rank}: lm_head.weight and embed_tokens.weight are separate tensors"
    moved = [k for k in unsharded if not torch.equal(results[0]["state"][k], unsharded[k])]
    assert moved, "training changed nothing: the comparison with zp.full_state_dict would be vacuous"


def test_rank0_only_switch_gives_rank0_the_full_state_and_others_nothing():
    results = run_ranks(2, w.rank0_only_worker, "llama", timeout=120)
    full = results[0]["full"]
    assert list(results[0]["state"]) == list(full)
    assert all(torch.equal(results[0]["state"][k], full[k]) for k in full)
    assert results[1]["state"] == {} and results[1]["sub_keys"] == [], (
        list(results[1]["state"]),
        results[1]["sub_keys"],
    )
    assert results[0]["sub_keys"], "rank 0's submodule state_dict is empty"


@pytest.mark.parametrize("world_size,stage", [(1, 3), (2, 3), (3, 3), (2, 0), (2, 2)])
def test_load_state_dict_changes_training_as_in_single_process_torch(world_size, stage):
    loaded = w.make("mlp").state_dict()
    loaded = {k: v * 0.5 + 0.01 for k, v in loaded.items()}
    r = run_ranks(world_size, w.load_worker, stage, loaded, 1, 2, timeout=120)[0]
    assert r["result"] == ([], [])
    assert models.max_abs_diff(r["right_after"], loaded) == 0.0, "the loaded values are not the model's values"
    ref = _reference("mlp", 3, world_size, load=loaded, steps_before=1)
    err = models.max_abs_diff(r["final"], ref)
    assert err <= F64, f"stage {stage}, {world_size} ranks: max |θ - θ_torch| = {err:.3g} after load + 2 steps"


def test_load_state_dict_strict_semantics_are_torchs():
    good = {k: v + 1 for k, v in w.make("mlp").state_dict().items()}
    missing = {k: v for k, v in good.items() if k != "head.bias"}
    extra = {**missing, "head.extra": torch.zeros(2)}
    wrong = {**good, "blocks.1.fc.weight": torch.zeros(15, 14, dtype=torch.float64)}
    cases = {
        "missing": (missing, {}),
        "lenient": (extra, {"strict": False}),
        "wrong_shape": (wrong, {}),
        "assign": (good, {"assign": True}),
    }
    got = run_ranks(2, w.strict_worker, cases, timeout=120)[0]
    plain = w.make("mlp")
    for name in ("missing", "wrong_shape"):
        with pytest.raises(RuntimeError) as torch_error:
            plain.load_state_dict(cases[name][0])
        assert got[name] == ("RuntimeError", str(torch_error.value)), (name, got[name])
    result = plain.load_state_dict(extra, strict=False)
    assert got["lenient"] == ("ok", result.missing_keys, result.unexpected_keys)
    assert got["assign"][0] == "ValueError" and "assign" in got["assign"][1]


def _discard_pool(world_size: int) -> None:
    """A call on one rank leaves an unmatched exchange on the control channel: the next test gets fresh workers."""
    pool = harness._POOLS.get(world_size)
    if pool is not None and pool.alive():
        pool.close(force=True)


@pytest.mark.parametrize("verb", ["state_dict", "load_state_dict"])
def test_call_on_one_rank_is_a_clear_error_within_the_timeout(verb):
    try:
        results = run_ranks(2, w.one_rank_worker, "idle", verb, 3.0, timeout=60)
    finally:
        _discard_pool(2)
    outcome, message, seconds = results[0]
    assert outcome == "RuntimeError", f"rank 0 alone in {verb}(): {outcome} {message}"
    assert f"called {verb}()" in message and "every rank" in message and "state_dict_rank0_only" in message, message
    assert seconds < 30, f"the error came after {seconds:.0f} s"
    assert results[1][0] == "returned"


def test_state_dict_against_a_forward_on_the_other_rank_fails_on_both():
    try:
        results = run_ranks(2, w.one_rank_worker, "forward", "state_dict", 3.0, timeout=60)
    finally:
        _discard_pool(2)
    (outcome0, message0, _), (outcome1, message1, _) = results
    assert outcome0 == "RuntimeError" and "state_dict() was called on some ranks only" in message0, message0
    assert "rank 1 is in a forward" in message0, message0
    assert outcome1 == "RuntimeError" and "collective order diverged" in message1, message1


def test_state_dict_peak_memory_is_one_unit_above_the_result():
    r = run_ranks(2, w.memory_worker, 4, timeout=120)[0]
    largest = max(r["units"])
    print(
        f"state_dict at stage 3, 2 ranks: peak {r['peak']} B, result {r['result']} B, largest unit "
        f"{largest} B, whole model {r['model']} B, live at the end {r['end']} B, gloo's threads' peak "
        f"{r['other_peak']} B"
    )
    assert largest * 3 < r["model"], "the model must have several units for the bound to mean anything"
    assert r["result"] == r["model"]
    assert r["end"] >= r["result"], f"the allocation events miss the result: {r}"
    assert r["peak"] <= r["result"] + largest, r
    assert r["other_peak"] <= largest, f"gloo's threads staged more than one unit at a time: {r}"


def test_rank0_only_switch_is_validated():
    import zero_plugin as zp

    assert zp.ZeroConfig.from_dict({"state_dict_rank0_only": "true"}).state_dict_rank0_only is True
    with pytest.raises(ValueError, match="state_dict_rank0_only"):
        zp.ZeroConfig(state_dict_rank0_only="sometimes")


def test_a_call_abandoned_by_an_exception_does_not_spoil_the_next_one():
    """A user hook raising inside state_dict() leaves the hooks' call half done; the next call starts afresh."""
    import zero_plugin as zp

    model, _ = w.build("mlp")  # one process: a one-rank world
    failing = [True]

    def hook(module, destination, prefix, local_metadata):
        if failing.pop() if failing else False:
            raise KeyError("user hook")

    handle = model.blocks[1].norm.register_state_dict_post_hook(hook)
    with pytest.raises(KeyError):
        model.state_dict()
    expected = {k: v + 1 for k, v in w.make("mlp").state_dict().items()}
    model.load_state_dict(expected)  # values the abandoned call did not see
    for call in (model.state_dict, model.blocks[2].state_dict):
        got = call()
        want = (
            expected
            if call == model.state_dict
            else {k[len("blocks.2.") :]: v for k, v in expected.items() if k.startswith("blocks.2.")}
        )
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    handle.remove()
    zp.engines.engine.engine_of(model, "test").remove()
