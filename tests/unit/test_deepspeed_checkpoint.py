"""DeepSpeed ZeRO checkpoints read here (issue 40): safety, offline export, resume, unsupported layouts.

The fixtures in ``tests/fixtures/deepspeed/stage<s>/`` were written by the real DeepSpeed 0.19.8 (ZeRO stage s,
2 ranks, CPU, gloo) with ``tests/fixtures/deepspeed/make_deepspeed_ckpt.py``, together with DeepSpeed's own
consolidation (``zero_to_fp32``) and its own resumed run (losses, weights and Adam moments after it).
DeepSpeed is not needed to run these tests.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import run_ranks
from tests.unit import deepspeed_workers as w
from zero_plugin.ckpt.consolidate import consolidate
from zero_plugin.ckpt.format import CheckpointError
from zero_plugin.launch.cli import main as cli

STAGES = (1, 2, 3)
VARIANTS = [
    1,
    2,
    3,
    "1_bf16",
    "2_bf16",
    "3_bf16",
    "2_fp16",
    "3_fp16",
]  # fixtures: stage; bf16 and fp16 runs (fp32 masters)
TAG = "global_step2"


def _copy(tmp_path, ds_stage: int) -> str:
    ckpt = os.path.join(tmp_path, f"ds{ds_stage}")
    shutil.copytree(w.fixture(ds_stage)[0], ckpt)
    return ckpt


def _files(ckpt: str) -> list[str]:
    return sorted(os.listdir(os.path.join(ckpt, TAG)))


# -- (1) safety: nothing but tensors, containers and DeepSpeed's records is unpickled --------------------------
class _Payload:
    """Unpickling this writes ``marker``: what a tampered checkpoint would do with a plain ``torch.load``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _plant(path: str, marker: str, nested: bool) -> None:
    payload = _Payload(marker)
    if nested:  # deep inside what looks like DeepSpeed's optimizer record
        value = {"optimizer_state_dict": {"zero_stage": 1, "base_optimizer_state": {"state": {0: {"step": payload}}}}}
    else:
        value = payload
    torch.save(value, path)


@pytest.mark.parametrize("ds_stage", STAGES)
@pytest.mark.parametrize("which", ["model", "optim0", "optim1"])
def test_planted_payload_is_refused_naming_the_file_and_never_runs(tmp_path, ds_stage, which):
    ckpt = _copy(tmp_path, ds_stage)
    files = _files(ckpt)
    kind = "model_states" if which == "model" else f"rank_{which[-1]}_mp_rank_00_optim_states"
    target = os.path.join(ckpt, TAG, next(f for f in files if kind in f))
    marker = os.path.join(tmp_path, "marker")
    _plant(target, marker, nested=which == "optim1")
    with pytest.raises(CheckpointError) as info:
        consolidate(ckpt, os.path.join(tmp_path, "out"))
    assert target in str(info.value) and "refus" in str(info.value)
    assert not os.path.exists(marker), "the planted payload ran"
    assert not os.path.exists(os.path.join(tmp_path, "out"))


def test_planted_payload_is_refused_by_load_checkpoint(tmp_path):
    ckpt = _copy(tmp_path, 3)
    target = os.path.join(ckpt, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    marker = os.path.join(tmp_path, "marker")
    _plant(target, marker, nested=True)
    for message in run_ranks(2, w.load_error, ckpt, marker, timeout=120):
        assert target in message and "refus" in message
    assert not os.path.exists(marker)


def test_latest_naming_a_folder_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = _copy(tmp_path, 1)
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("../../elsewhere")
    with pytest.raises(CheckpointError, match="which is not a folder inside"):
        consolidate(ckpt, os.path.join(tmp_path, "out"))


# -- (3) offline export --------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16) if t.is_floating_point() else t


@pytest.mark.parametrize("ds_stage", VARIANTS)
def test_consolidate_equals_deepspeeds_zero_to_fp32_bit_for_bit(tmp_path, ds_stage, capsys):
    ckpt = w.fixture(ds_stage)[0]
    out = os.path.join(tmp_path, "out")
    assert cli(["consolidate", ckpt, out, "--format", "safetensors"]) == 0, capsys.readouterr().err
    ours = load_file(os.path.join(out, "model.safetensors"))
    theirs = load_file(os.path.join(w.FIXTURES, f"stage{ds_stage}", "zero_to_fp32.safetensors"))
    for key, value in theirs.items():
        assert key in ours, f"{key} missing from the export"
        assert ours[key].dtype == value.dtype and torch.equal(_bits(ours[key]), _bits(value)), key
    # zero_to_fp32 leaves out frozen parameters at stage 1 (DeepSpeed records none there); the export keeps them
    assert set(ours) - set(theirs) <= {"pos"}
    assert set(ours) >= {"pos", "scale", "head.weight"}


def test_consolidate_reads_the_tag_folder_too(tmp_path):
    ckpt = w.fixture(3)[0]
    a, b = os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")
    consolidate(ckpt, a)
    consolidate(os.path.join(ckpt, TAG), b)
    ours, again = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert all(torch.equal(ours[k], again[k]) for k in ours) and ours.keys() == again.keys()


def test_consolidate_hf_trainer_folder_to_a_from_pretrained_folder(tmp_path):
    """The HF Trainer's checkpoint-N/ under DeepSpeed ZeRO-3 (no weights file in it) to a folder that
    from_pretrained loads, with DeepSpeed's own zero_to_fp32 weights bit for bit."""
    from transformers import LlamaForCausalLM

    root = os.path.join(w.FIXTURES, "hf_trainer")
    out = os.path.join(tmp_path, "out")
    consolidate(os.path.join(root, "checkpoint-2"), out, format="hf")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    theirs = load_file(os.path.join(root, "zero_to_fp32.safetensors"))
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(_bits(loaded[key]), _bits(value)), key


def test_consolidate_hf_without_a_transformers_config_says_what_to_use(tmp_path):
    with pytest.raises(CheckpointError, match="--format safetensors"):
        consolidate(w.fixture(2)[0], os.path.join(tmp_path, "out"), format="hf")


# -- (4) resume ----------------------------------------------------------------------------------------------
CONFIGS = [(ds, zs, False) for ds in STAGES for zs in (1, 2, 3)] + [(1, 3, True), (2, 2, True), (3, 3, True)]
CONFIGS += [("1_bf16", 3, False), ("2_bf16", 1, False), ("3_bf16", 2, True)]
CONFIGS += [("2_no_frozen", 3, False), ("3_no_frozen", 1, True)]  # saved without the frozen base (PEFT)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_matches_deepspeeds_own_resumed_run(world):
    """Weights and Adam moments equal DeepSpeed's at the save bit for bit, step counts too; the next two losses and
    the state after them equal DeepSpeed's own resumed run (world size 2) to fp tolerance."""
    for extras in run_ranks(world, w.resume_all, CONFIGS, timeout=240):
        for extra in extras:
            assert extra["deepspeed"]["global_steps"] == 2
            assert extra["deepspeed"]["client_state"] == {"data_step": 2}


@pytest.mark.parametrize("zp_stage", [1, 3])
def test_accelerate_load_state_of_a_deepspeed_save_state(zp_stage):
    """Accelerate's save_state under DeepSpeed ZeRO-2 (pytorch_model/ + latest, scheduler.bin, RNG files),
    loaded by zero_plugin's Accelerator: the next losses and learning rates equal DeepSpeed's resumed run's."""
    root = os.path.join(w.FIXTURES, "accelerate")
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    for losses, lrs in run_ranks(2, w.accelerate_resume, os.path.join(root, "state"), zp_stage, timeout=120):
        torch.testing.assert_close(losses, expected["resumed_losses"], rtol=1e-5, atol=0)
        assert lrs == expected["resumed_lrs"]


def test_model_only_load_takes_the_fp32_masters():
    for ds, zs in [(1, 3), (3, 1), ("2_bf16", 2)]:
        run_ranks(2, w.load_model_only, ds, zs, timeout=120)


def test_resume_into_another_optimizer_kind_is_refused(tmp_path):
    message = run_ranks(1, w.sgd_load_error, w.fixture(1)[0], timeout=120)[0]
    assert "SGD" in message and "exp_avg" in message


# -- (5) layouts this reader does not handle --------------------------------------------------------------------
def _add(ckpt: str, name: str, marker: str) -> None:
    path = os.path.join(ckpt, TAG, name)
    if name.endswith("/"):
        os.makedirs(path)
    else:
        _plant(path, marker, nested=False)  # refused by its name, before anything is unpickled


@pytest.mark.parametrize(
    "name, says, fix",
    [
        ("mp_rank_01_model_states.pt", "tensor parallel", "ds_to_universal"),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "tensor parallel", "ds_to_universal"),
        ("layer_01-model_00-model_states.pt", "pipeline parallel", "ds_to_universal"),
        ("layer_0_expert_0_mp_rank_00_model_states.pt", "MoE expert", "save_16bit_model"),
        ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE expert", "save_16bit_model"),
        ("offloaded_tensors/", "NVMe", "offload_optimizer"),
    ],
)
def test_unsupported_layouts_are_named_with_what_to_do(tmp_path, name, says, fix):
    ckpt = _copy(tmp_path, 2)
    marker = os.path.join(tmp_path, "marker")
    _add(ckpt, name, marker)
    with pytest.raises(CheckpointError) as info:
        consolidate(ckpt, os.path.join(tmp_path, "out"))
    message = str(info.value)
    assert says in message and name.rstrip("/") in message and fix in message, message
    assert not os.path.exists(marker)


def test_a_missing_rank_file_is_named(tmp_path):
    ckpt = _copy(tmp_path, 1)
    os.remove(os.path.join(ckpt, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        consolidate(ckpt, os.path.join(tmp_path, "out"))


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_resume_keeps_deepspeeds_loss_scale_and_its_growth_schedule(world):
    """DeepSpeed fp16 (dynamic scaler: scale 16 at the save, grown to 32 at the first resumed step, window 2):
    the scale loads, grows on DeepSpeed's step, masters and Adam state load bit for bit, and the next two losses
    equal DeepSpeed's resumed run's to fp16 rounding ([Note: DeepSpeed's loss scaler] in deepspeed_reader.py)."""
    configs = [("2_fp16", 1, False), ("3_fp16", 3, False), ("2_fp16", 2, True)]
    results = run_ranks(world, _resume_fp16_all, configs, timeout=240)[0]
    for (variant, _, _), got in zip(configs, results):
        expected = w.fixture(variant)[1]
        scaler = expected["loss_scaler"]
        assert got["scale_at_load"] == scaler["saved"]["cur_scale"], (variant, got)
        assert got["scale_after"] == scaler["resumed"]["cur_scale"] and got["skipped"] == 0, (variant, got)
        assert got["steps"] == {expected["resumed_step"]}, (variant, got)
        # the first loss is the loaded weights' own; the second follows an fp16 step whose gradients round unlike
        # DeepSpeed's (another reduction order), which Adam amplifies: as for bf16, within 2**-7
        torch.testing.assert_close(got["losses"][0], expected["resumed_losses"][0], rtol=2**-10, atol=0)
        torch.testing.assert_close(got["losses"], expected["resumed_losses"], rtol=2**-7, atol=0)


def _resume_fp16_all(configs):
    return [w.resume_fp16(*config) for config in configs]


@pytest.mark.parametrize("where", ["converted folder", "root with latest_universal"])
def test_a_universal_checkpoint_is_named_with_what_to_do(tmp_path, where):
    """ds_to_universal.py's output (``<tag>_universal/``: the model-states files copied, ``zero/<param>/fp32.pt``,
    ``exp_avg.pt`` ...; ``latest_universal`` beside it) is refused naming the layout and the ZeRO checkpoint to pass."""
    root = os.path.join(tmp_path, "run")
    os.makedirs(os.path.join(root, "global_step2_universal", "zero", "embed.weight"))
    shutil.copy(os.path.join(w.fixture(2)[0], TAG, "mp_rank_00_model_states.pt"), f"{root}/global_step2_universal")
    for name in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
        torch.save(
            {"param": torch.zeros(11, 6)}, os.path.join(root, "global_step2_universal", "zero", "embed.weight", name)
        )
    with open(os.path.join(root, "latest_universal"), "w") as f:
        f.write("global_step2_universal")
    target = os.path.join(root, "global_step2_universal") if where == "converted folder" else root
    with pytest.raises(CheckpointError) as info:
        consolidate(target, os.path.join(tmp_path, "out"))
    message = str(info.value)
    assert "universal checkpoint" in message and "zero_pp_rank_*_optim_states.pt" in message, message
    assert "load_universal" in message and target in message, message
