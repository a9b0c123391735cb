"""Sharded checkpoints: exact resume, resharding across stages and world sizes, crash safety, bad input.

* Exact resume (fp32 OddMLP, two-group AdamW, world size 2, stages 0-3, and 1-3 with optimizer offload,
  3 with parameter offload too): 6 steps straight equal 3 steps,
  save, and -- in a second ``run_ranks`` call that builds everything again -- load and 3 more,
  bitwise (parameters, optimizer state, LR schedule, every rank's RNG).
* fp16 exact resume: the dynamic loss scale (backed off by an overflow before the save) and the skip
  count survive the checkpoint and the optimizer's state dicts; one step after the resume overflows only
  at the initial scale, so a run that lost the scale departs.  Checkpoints without that record still load.
* State saved from another optimizer class (AdamW into SGD) is refused with both class names, before
  anything changes.
* Resharding (float64 OddMLP): save at (stage s1, N1), load at (s2, N2): the full parameters and
  optimizer state equal the saved ones exactly, and one more step matches the saving run's
  within 1e-10 (only the reduction order differs).  The whole 4x4 stage grid for N1=2 -> N2=4,
  and every (N1, N2) in {1, 2, 4}^2 for stage 3 -> stage 1.
* A save SIGKILLed after its first file leaves the previous checkpoint loadable and the partial
  directory reports "incomplete checkpoint".
* Corrupt or tampered checkpoints and mismatched models fail with errors naming the file or key,
  before the model or optimizer is touched; planted pickles are refused, never executed.
* PEFT under stage 3: ``save_peft_adapter`` writes an adapter that ``PeftModel.from_pretrained``
  loads into an unsharded base model with identical logits.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.harness import REPO_ROOT, run_ranks
from tests.unit import checkpoint_optimizer_workers as ow
from tests.unit import checkpoint_workers as w

STAGES = (0, 1, 2, 3)
STEP_TOL = 1e-10


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_opt_equal(a: dict, b: dict) -> None:
    assert a["groups"] == b["groups"]
    assert a["state"].keys() == b["state"].keys()
    for name in a["state"]:
        sa, sb = a["state"][name], b["state"][name]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (name, key)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


# -- exact resume ---------------------------------------------------------------------------------
OFFLOAD = {"offload_optimizer": "cpu"}


@pytest.mark.parametrize(
    "stage,config",
    [(s, {}) for s in STAGES] + [(1, OFFLOAD), (2, OFFLOAD), (3, OFFLOAD), (3, {**OFFLOAD, "offload_params": True})],
)
def test_exact_resume(stage, config, tmp_path):
    path = str(tmp_path / "ckpt")
    first = run_ranks(2, w.resume_first_half, stage, path, config, timeout=120)
    second = run_ranks(2, w.resume_second_half, stage, path, config, timeout=120)
    for rank in range(2):
        a, b = first[rank], second[rank]
        assert_params_equal(a["straight_params"], b["params"])
        assert_opt_equal(a["straight_opt"], b["opt"])
        assert b["lrs"] == a["split_lrs"]
        assert b["extra"]["step"] == 3 and b["extra"]["data_position"] == 3 * w.GLOBAL_ROWS
        rng_saved, rng_loaded = a["rng_after_save"], b["rng_after_load"]
        assert torch.equal(rng_saved[0], rng_loaded[0]) and rng_saved[1:] == rng_loaded[1:], f"rank {rank} RNG"
    assert not torch.equal(first[0]["rng_after_save"][0], first[1]["rng_after_save"][0]), "ranks should differ"


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_fp16_exact_resume_keeps_the_loss_scale(stage, tmp_path):
    """fp16, dynamic loss scale that overflows before the save (scale backed off to 2^15) and once more
    after it only at 2^16: interrupted + resumed equals uninterrupted -- scale and skip count after every
    step, parameters and optimizer state bitwise.  The optimizer's state dicts carry the scaler too."""
    path = str(tmp_path / "ckpt")
    first = run_ranks(2, ow.fp16_resume_first_half, stage, path, timeout=120)
    second = run_ranks(2, ow.fp16_resume_second_half, stage, path, timeout=120)
    for a, b in zip(first, second):
        straight = a["straight_trace"]
        assert [s for s, _ in straight] == [2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**15, 2.0**15], straight
        assert [n for _, n in straight] == [0, 1, 1, 1, 1, 1], "step 1 overflows; step 4 must not at 2^15"
        assert a["split_trace"] == straight[: ow.FP16_SAVE_AT]
        assert a["saved_scaler"] == straight[ow.FP16_SAVE_AT - 1]
        assert a["state_dict_scalers"] == {"sharded": a["saved_scaler"], "consolidated": a["saved_scaler"]}
        assert b["loaded_scaler"] == a["saved_scaler"]
        assert b["trace"] == straight[ow.FP16_SAVE_AT :]
        assert_params_equal(a["straight_params"], b["params"])
        assert_opt_equal(a["straight_opt"], b["opt"])


def test_checkpoint_without_loss_scale_record_still_loads(tmp_path):
    """A checkpoint written before the scaler was saved: loads, and the scaler keeps its fresh state."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, ow.fp16_resume_first_half, 2, path, timeout=120)
    for b in run_ranks(2, ow.fp16_resume_second_half, 2, path, strip_scaler=True, timeout=120):
        assert b["loaded_scaler"] == (2.0**16, 0)


# -- resharding --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    out = dict(run_ranks(2, w.reshard_save, list(STAGES), root, timeout=120)[0])
    for world in (1, 4):
        out.update(run_ranks(world, w.reshard_save, [3], root, timeout=120)[0])
    return root, out


def _check_loaded(saved_runs: dict, loaded: dict) -> None:
    for (path, stage), got in loaded.items():
        ref = saved_runs[path]
        assert_params_equal(ref["params"], got["params"])
        assert_opt_equal(ref["opt"], got["opt"])
        assert max_diff(ref["after"], got["after"]) <= STEP_TOL, (path, stage)


def test_reshard_every_stage_pair_2_to_4_ranks(saved):
    root, runs = saved
    paths = [os.path.join(root, f"s{s}-n2") for s in STAGES]
    results = run_ranks(4, w.reshard_load, paths, list(STAGES), timeout=240)
    assert len(results[0]) == 16
    for result in results:
        _check_loaded(runs, result)


@pytest.mark.parametrize("n1,n2", list(itertools.product((1, 2, 4), repeat=2)))
def test_reshard_every_world_size_pair_stage3_to_1(saved, n1, n2):
    root, runs = saved
    for result in run_ranks(n2, w.reshard_load, [os.path.join(root, f"s3-n{n1}")], [1], timeout=120):
        _check_loaded(runs, result)


def test_mixed_precision_masters_and_offload(tmp_path):
    """bf16 compute with fp32 masters saved at stage 2 on 2 ranks: the fp32 masters come back exactly at
    stage 3 with optimizer and parameter offload, at stage 1 on 4 ranks, and in plain fp32 at stage 0."""
    path = str(tmp_path / "mixed")
    mixed = {"param_dtype": "bf16"}
    saved_run = run_ranks(2, w.mixed_save, 2, path, mixed, timeout=120)[0]
    assert all(v.dtype == torch.float32 for v in saved_run["params"].values())
    targets = {
        2: [(3, {**mixed, "offload_optimizer": "cpu", "offload_params": True}), (0, {})],
        4: [(1, {**mixed, "offload_optimizer": "cpu"})],
    }
    for world, runs in targets.items():
        for result in run_ranks(world, w.mixed_load, path, runs, timeout=120):
            for loaded in result:
                assert_params_equal(saved_run["params"], loaded["params"])
                assert_opt_equal(saved_run["opt"], loaded["opt"])


# -- crash safety ------------------------------------------------------------------------------------------
def test_killed_save_keeps_previous_checkpoint(tmp_path):
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "first-file-written")
    old_params = w.save_small(path, steps=2)
    code = (
        f"import sys; sys.path.insert(0, {REPO_ROOT!r}); from tests.unit import checkpoint_workers as w; "
        f"w.crash_save({path!r}, {marker!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), f"the save never wrote its first file (exit code {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial = glob.glob(path + ".tmp-*")
    assert len(partial) == 1 and os.listdir(partial[0]), "the killed save should leave its partial directory"

    loaded, error = w.load_small(path)
    assert error is None and loaded["extra"] == {"step": 2}
    assert_params_equal(old_params, loaded["params"])
    loaded, error = w.load_small(partial[0])
    assert loaded is None and "incomplete checkpoint (interrupted save?)" in error and partial[0] in error

    new_params = w.save_small(path, steps=3)  # the next save replaces the old one and clears the leftovers
    assert glob.glob(path + ".tmp-*") == [] and glob.glob(path + ".old-*") == []
    loaded, _ = w.load_small(path)
    assert loaded["extra"] == {"step": 3}
    assert_params_equal(new_params, loaded["params"])


def test_crash_between_renames_points_to_previous(tmp_path):
    path = str(tmp_path / "ckpt")
    w.save_small(path, steps=1)
    os.rename(path, path + ".old-deadbeef")  # what a crash between "move aside" and "rename" leaves
    _, error = w.load_small(path)
    assert "no checkpoint at" in error and path + ".old-deadbeef" in error


# -- bad input and security ---------------------------------------------------------------------------------
EXPECTED = {
    "truncated": ("rank-00001-of-00002.safetensors", "bytes, the manifest says"),
    "flipped": ("rank-00000-of-00002.safetensors", "does not match its sha256"),
    "missing": ("rank-00001-of-00002.safetensors", "is missing"),
    "no_complete": ("incomplete checkpoint (interrupted save?)", "no_complete"),
    "planted_pickle": ("'evil.pkl'", "refusing to load it"),
    "pickle_as_shard": ("rank-00000-of-00002.safetensors", "not a valid safetensors file"),
    "torch_save_as_shard": ("rank-00001-of-00002.safetensors", "not a valid safetensors file"),
    "pickle_as_index": ("index.json", "cannot read checkpoint index"),
    "wrong_shape": ("rank-00001-of-00002.safetensors", "has shape"),
    "wider_head": ("shape mismatch for 'head.weight': checkpoint has (13, 15), the model has (15, 15)", "'head.bias'"),
    "extra_param": ("missing parameters (in the model, not in the checkpoint): ['extra_bias']", "different model"),
}


@pytest.mark.parametrize("stage", (1, 3))
def test_bad_checkpoints_fail_clearly_and_change_nothing(stage, tmp_path):
    sentinel = str(tmp_path / "pwned")
    results = run_ranks(2, w.bad_input, stage, str(tmp_path), sentinel, timeout=180)
    assert results[0]["errors"] == results[1]["errors"], "every rank must raise the same error"
    errors = results[0]["errors"]
    for case, needles in EXPECTED.items():
        assert errors[case] is not None, f"{case}: loaded without error"
        for needle in needles:
            assert needle in errors[case], f"{case}: {needle!r} not in {errors[case]!r}"
    assert errors["wider_head_unchanged"] and errors["extra_param_unchanged"]
    for r in results:
        assert_params_equal(r["before"]["params"], r["after"]["params"])
        assert_opt_equal(r["before"]["opt"], r["after"]["opt"])
        assert not r["sentinel_exists"]
        assert r["in_place"]["checked"] > 0 and r["in_place"]["moved"] == [], r["in_place"]
    assert not os.path.exists(sentinel), "a planted pickle was executed"
    # The payload is live: unpickling it would have run code.
    pickle.loads(pickle.dumps(w.Evil(str(tmp_path / "control"))))
    assert os.path.exists(tmp_path / "control")


def test_unstorable_extra_and_mismatched_optimizer(tmp_path):
    """One process, no process group: errors name the culprit and leave nothing behind or changed."""
    path = str(tmp_path / "ckpt")
    model, opt = w.build(1)
    with pytest.raises(w.CheckpointError, match=r"extra\['sampler'\] has type object"):
        w.save_checkpoint(path, model, opt, extra={"step": 1, "sampler": object()})
    assert os.listdir(tmp_path) == []
    w.train(model, opt, w.batches(torch.float64), 0, 1)
    w.save_checkpoint(path, model, opt)
    other = w.models.make_odd_mlp(seed=3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=w.LR)  # one group instead of two
    other, other_opt = w.zp.setup(other, other_opt, w.zp.ZeroConfig(stage=3))
    before = w.full_params(other)
    with pytest.raises(w.CheckpointError, match="has 2 optimizer param groups, this optimizer has 1"):
        w.load_checkpoint(path, other, other_opt)
    assert_params_equal(before, w.full_params(other))
    assert not other_opt.state
    w.load_checkpoint(path, other)  # the model alone loads fine
    assert_params_equal(w.full_params(model), w.full_params(other))


@pytest.mark.parametrize("world_size,stage", [(1, 1), (2, 2), (2, 3)])
def test_state_of_another_optimizer_class_is_refused_before_anything_changes(world_size, stage, tmp_path):
    """AdamW's checkpoint / state dicts into SGD: a ValueError naming both classes and the fix, raised by
    the checks, so the SGD run's parameters, state and hyper-parameters stay as they were."""
    results = run_ranks(world_size, ow.wrong_optimizer_class, stage, str(tmp_path / "ckpt"), timeout=120)
    for r in results:
        for kind, error in r["errors"].items():
            assert error is not None, f"{kind}: loaded without error"
            for needle in ("torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "same optimizer class"):
                assert needle in error, f"{kind}: {needle!r} not in {error!r}"
        assert_params_equal(r["before"]["params"], r["after"]["params"])
        assert_opt_equal(r["before"]["opt"], r["after"]["opt"])
        assert r["before"]["groups"] == r["after"]["groups"]


def test_writer_output_is_standard_safetensors(tmp_path):
    """Our streaming writer against the safetensors library's own reader, and its sha256 against the file's."""
    from safetensors.torch import load_file

    from zero_plugin.ckpt import format as fmt

    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0),
        "mask": torch.tensor([True, False]),
        "u32": torch.tensor([1, 2**31 + 5], dtype=torch.int64).to(torch.uint32),
        "view": torch.arange(10.0)[3:8],
    }
    path = str(tmp_path / "x.safetensors")
    record = fmt.write_safetensors(path, list(tensors.items()), {"note": "hi"})
    assert record.size == os.path.getsize(path) and record.sha256 == fmt.sha256_file(path)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


# -- PEFT under stage 3 -----------------------------------------------------------------------------------------
def test_peft_adapter_from_stage3_loads_unsharded(tmp_path):
    results = run_ranks(2, w.peft_adapter, str(tmp_path / "adapter"), timeout=180)
    for rank, r in enumerate(results):  # the export record is built on rank 0 alone: no collective state_dict()
        assert r["save_warnings"] == [], f"rank {rank}: {r['save_warnings']}"
    result = results[0]
    assert result["keys"] and all("lora_" in k for k in result["keys"])
    assert result["equal"], f"logits differ by up to {result['max_diff']}"
    assert result["adapter_effect"] > 1e-4, "the trained adapter should change the base model's logits"
    # Offline: the stage-3 checkpoint consolidated with --format hf is the same adapter, byte for byte.
    from safetensors.torch import load_file

    from zero_plugin.launch.cli import main

    out = tmp_path / "adapter-offline"
    assert main(["consolidate", str(tmp_path / "adapter-ckpt"), str(out), "--format", "hf"]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    live, offline = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "adapter", out))
    assert sorted(offline) == result["keys"] and all(torch.equal(live[k], offline[k]) for k in live)
    from peft import PeftConfig

    assert (
        PeftConfig.from_pretrained(str(out)).to_dict()
        == PeftConfig.from_pretrained(str(tmp_path / "adapter")).to_dict()
    )


@pytest.mark.parametrize("stage,config", [(3, {}), (1, {"param_dtype": "bf16"})])
def test_consolidate_to_hf_folder_loads_with_from_pretrained(stage, config, tmp_path):
    """Stage 3 (and stage 1 with bf16 compute, fp32 masters), 2 ranks: ``zero-plugin consolidate --format hf``
    gives a folder ``from_pretrained`` loads into the same fp32 weights, bitwise (and, in fp32, the same
    logits to 1e-5: the loaded model may pick another attention kernel);
    several shards with an index when --max-shard-size is small; --dtype bf16 casts."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from zero_plugin.launch.cli import main

    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(2, w.hf_export_source, ckpt, stage, config, timeout=180)[0]
    out = tmp_path / "hf"
    assert main(["consolidate", ckpt, str(out), "--format", "hf", "--max-shard-size", "40KiB"]) == 0
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert len([f for f in files if f.startswith("model-")]) > 2
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    got = loaded.state_dict()
    for name, value in ref["state"].items():
        assert torch.equal(got[name].float(), value.float()), name
    if not config:  # fp32 compute: the unsharded model computes what the sharded one did (kernels may differ)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ref["ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-6)
    flat = tmp_path / "flat"
    assert main(["consolidate", ckpt, str(flat), "--dtype", "bf16"]) == 0
    assert os.listdir(flat) == ["model.safetensors"]
    with safe_open(str(flat / "model.safetensors"), framework="pt") as f:
        # every parameter once: lm_head.weight is tied to the embedding (save_pretrained drops it too)
        assert set(f.keys()) == set(ref["state"]) - {"lm_head.weight"} and f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(k), ref["state"][k].to(torch.bfloat16)) for k in f.keys())


def test_consolidate_refuses_bad_input_and_leaves_nothing(tmp_path, capsys):
    from zero_plugin.ckpt import consolidate as cons
    from zero_plugin.launch.cli import main

    path = str(tmp_path / "ckpt")
    w.save_small(path, steps=1)  # OddMLP: no transformers config
    out = tmp_path / "out"
    assert main(["consolidate", path, str(out), "--format", "hf"]) == 2
    assert "records no transformers config" in capsys.readouterr().err and not out.exists()
    assert not list(tmp_path.glob("out.tmp-*"))
    with open(os.path.join(path, "rank-00000-of-00001.safetensors"), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff")
    assert main(["consolidate", path, str(out)]) == 2
    err = capsys.readouterr().err
    assert "rank-00000-of-00001.safetensors" in err and "sha256" in err and not out.exists()
    tampered = str(tmp_path / "tampered")
    w.save_small(tampered, steps=1)
    index = json.loads((tmp_path / "tampered" / "index.json").read_text())
    index["export"] = {"peft": {"default": {"keys": 5}}}
    w._replace_and_reseal(tampered, "index.json", json.dumps(index).encode())
    assert main(["consolidate", tampered, str(out), "--format", "hf"]) == 2
    assert "export record: adapter 'default'" in capsys.readouterr().err and not out.exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    with pytest.raises(cons.CheckpointError, match="not an empty folder"):
        cons.consolidate(path, tmp_path / "taken", verify=False)
    assert (tmp_path / "taken" / "x").read_text() == "keep me"


def test_consolidate_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """[Note: streaming consolidation]: each tensor is dropped before the next is assembled."""
    import weakref

    from zero_plugin.ckpt import consolidate as cons

    path = str(tmp_path / "ckpt")
    w.save_small(path, steps=1)
    alive, most, calls = [], [0], [0]
    original = cons.full_tensor

    def spy(*args):
        alive[:] = [r for r in alive if r() is not None]
        most[0] = max(most[0], len(alive))
        t = original(*args)
        alive.append(weakref.ref(t))
        calls[0] += 1
        return t

    monkeypatch.setattr(cons, "full_tensor", spy)
    written = cons.consolidate(path, tmp_path / "out", max_shard_bytes=10**9)
    assert [os.path.basename(p) for p in written] == ["model.safetensors"] and calls[0] > 3
    assert most[0] == 0, f"{most[0]} earlier tensors were still alive when another was assembled"


def test_export_record_never_blocks_a_save():
    from zero_plugin.ckpt.export_info import describe_model

    class Unserialisable:
        def to_json_string(self, use_diff=False):
            raise TypeError("object of type Foo is not JSON serializable")

    model = torch.nn.Linear(2, 2)
    model.config = Unserialisable()
    with pytest.warns(UserWarning, match="could not record"):
        assert describe_model(model) == {}
