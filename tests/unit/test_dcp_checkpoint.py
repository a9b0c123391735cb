"""FSDP / torch.distributed.checkpoint (DCP) checkpoints, both ways (issue 40).

The fixtures (``tests/fixtures/fsdp``) were written by torch FSDP2 at world size 2 on gloo: a pure-torch
MLP saved as ``dcp.save({"model", "optim"})`` of ``get_state_dict``, a tiny Llama in the folder layout
Accelerate / the HF Trainer write (``pytorch_model_fsdp_0/`` + ``optimizer_0/``), with FSDP2's own state
at the save and after its own resumed run.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import REPO_ROOT, run_ranks
from tests.unit import dcp_workers as w

MLP, LLAMA = (os.path.join(w.FIXTURES, name, "ckpt") for name in ("mlp", "llama"))


# -- (2) safety: .metadata is a pickle ---------------------------------------------------------
class _Payload:
    """Unpickling this writes the marker file: what a planted .metadata would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _planted(tmp_path, source: str) -> tuple[str, str]:
    ckpt, marker = str(tmp_path / "planted"), str(tmp_path / "ran")
    shutil.copytree(source, ckpt)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    return ckpt, marker


def test_planted_metadata_is_refused_naming_the_file_and_never_runs(tmp_path):
    from zero_plugin.ckpt.consolidate import consolidate
    from zero_plugin.ckpt.format import CheckpointError

    ckpt, marker = _planted(tmp_path, MLP)
    with pytest.raises(CheckpointError, match=r"planted/\.metadata.*io\.open") as info:
        consolidate(ckpt, str(tmp_path / "out"))
    assert "not unpickled" in str(info.value)
    assert not os.path.exists(marker), "the planted payload ran"
    message = run_ranks(1, w.load_error, "mlp", ckpt)[0]
    assert ".metadata" in message and not os.path.exists(marker)


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    from zero_plugin.ckpt.consolidate import consolidate
    from zero_plugin.ckpt.format import CheckpointError

    ckpt = str(tmp_path / "escape")
    shutil.copytree(MLP, ckpt)
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:  # same length, so the pickle stays valid
        f.write(data.replace(b"__0_0.distcp", b"../_0.distcp"))
    with pytest.raises(CheckpointError, match="is outside the folder"):
        consolidate(ckpt, str(tmp_path / "out"))


# -- (3) resume an FSDP2 checkpoint at stages 1-3 (+ offload), world sizes 1-3 -------------------
@pytest.mark.parametrize(
    "world, configs",
    [
        (1, [("mlp", 3, False), ("llama", 1, False)]),
        (2, [("mlp", 1, False), ("mlp", 2, True), ("llama", 3, False)]),
        (3, [("mlp", 3, True), ("llama", 2, False)]),
    ],
)
def test_resume_fsdp2_checkpoint_continues_as_fsdp2(world, configs):
    run_ranks(world, w.resume_all, configs)


def test_accelerate_model_folder_alone(tmp_path):
    """``pytorch_model_fsdp_0/`` without its ``optimizer_0/``: model only loads; asking for the optimizer
    names the layout and what to do."""
    lonely = str(tmp_path / "alone")
    shutil.copytree(os.path.join(LLAMA, "pytorch_model_fsdp_0"), os.path.join(lonely, "pytorch_model_fsdp_0"))
    message = run_ranks(2, w.load_error, "llama", lonely)[0]
    assert "optimizer_0" in message and "optimizer=None" in message, message
    run_ranks(2, w.load_model_only, "llama", lonely)


def test_fsdp1_flat_parameters_are_refused_with_what_to_do(tmp_path):
    import torch.distributed.checkpoint as dcp

    flat = str(tmp_path / "fsdp1")
    dcp.save({"model": {"_fsdp_wrapped_module._flat_param": torch.zeros(10)}}, checkpoint_id=flat, no_dist=True)
    message = run_ranks(1, w.load_error, "mlp", flat)[0]
    assert "FSDP1" in message and "flat" in message and "SHARDED_STATE_DICT" in message, message


# -- (4) offline: equal to DCP's own dcp_to_torch_save -----------------------------------------
def _dcp_to_torch_save(dcp_dir: str, tmp_path, key: str = "model") -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / f"{os.path.basename(dcp_dir)}.pt")
    dcp_to_torch_save(dcp_dir, out)
    return torch.load(out, weights_only=False)[key]


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "zero_plugin.launch.cli", "consolidate", *args]
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO_ROOT}
    )
    assert done.returncode == 0, done.stderr


def _assert_bit_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


def test_consolidate_dcp_equals_dcp_to_torch_save(tmp_path):
    from zero_plugin.ckpt.consolidate import consolidate

    consolidate(MLP, str(tmp_path / "mlp"))
    _assert_bit_equal(load_file(str(tmp_path / "mlp" / "model.safetensors")), _dcp_to_torch_save(MLP, tmp_path))
    theirs = _dcp_to_torch_save(os.path.join(LLAMA, "pytorch_model_fsdp_0"), tmp_path)
    consolidate(LLAMA, str(tmp_path / "llama"))
    _assert_bit_equal(load_file(str(tmp_path / "llama" / "model.safetensors")), theirs)
    _cli(LLAMA, str(tmp_path / "hf"), "--format", "hf")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    _assert_bit_equal({k: v for k, v in model.state_dict().items() if k in theirs}, theirs)


def test_consolidate_hf_without_a_config_says_so(tmp_path):
    from zero_plugin.ckpt.consolidate import consolidate
    from zero_plugin.ckpt.format import CheckpointError

    with pytest.raises(CheckpointError, match="config.json.*--format safetensors"):
        consolidate(MLP, str(tmp_path / "out"), format="hf")


# -- (5) our checkpoint to FSDP2 ---------------------------------------------------------------
@pytest.mark.parametrize("stage", [3])
def test_export_dcp_fsdp2_resumes_as_we_continue(tmp_path, stage):
    run_ranks(2, w.export_to_fsdp2, str(tmp_path), stage)


def test_export_dcp_holds_about_one_tensor_at_a_time(tmp_path):
    """[Note: DCP export]: of the 8 weights and their 16 Adam moments (1 MiB each, 24 MiB in all) the export
    assembles, at most two are alive at once (the one being written, and its successor's while DCP's writer lets go
    of the first); before, the whole state was assembled before DCP saw it."""
    layers, width = 8, 512
    count = run_ranks(1, w.export_memory, str(tmp_path), layers, width)[0]
    one = width * width * 4
    assert count["assembled"] == 3 * layers * one, count
    assert count["peak"] <= 2 * one, count
    assert count["live"] == 0, count


def test_tied_weights_saved_twice_export_both_names_and_saved_once_load(tmp_path):
    """FSDP2's get_model_state_dict saves a tied embedding / head under both names (Lightning's ModelParallelStrategy
    fixture): the export writes both, bit-equal to dcp_to_torch_save (loading it is test_lightning_foreign_checkpoints);
    saved under the second name only, it loads as the model's first name ([Note: tied names in DCP])."""
    from zero_plugin.ckpt.consolidate import consolidate

    fixture = os.path.join(REPO_ROOT, "tests", "fixtures", "lightning", "fsdp2", "ckpt")
    consolidate(fixture, str(tmp_path / "out"))
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    theirs = _dcp_to_torch_save(fixture, tmp_path, key="state_dict")
    assert {"model.embed.weight", "model.head.weight"} <= set(ours)
    _assert_bit_equal(ours, theirs)
    assert set(ours) == set(theirs)
    run_ranks(2, w.load_tied_saved_once, str(tmp_path))
