"""``zero-plugin consolidate CKPT_DIR OUT.ckpt --format lightning``: the sharded directory a ZeRO strategy saves,
as the one file ``LightningModule.load_from_checkpoint`` and plain DDP read.

Two ranks train a tied tiny Llama (fp32, two-group AdamW, StepLR) for two epochs with ``ModelCheckpoint``;
the test process (no process group, no strategy) consolidates and loads.  Weights and optimizer state must
equal the trained ones exactly.  A DDP run resumed from the consolidated epoch-0 file must track the
uninterrupted ZeRO run's second epoch as DDP tracks ZeRO (summation order only: losses 1e-4 relative,
update error 1e-3, as in ``test_lightning.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import run_ranks
from tests.integrations import lightning_consolidate_workers as cw
from zero_plugin.launch import cli

LOSS_RTOL, UPDATE_TOL = 1e-4, 1e-3


@functools.cache
def _trained(strategy: str, root: str) -> dict:
    return run_ranks(2, cw.train_worker, strategy, root)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_consolidate")
    return lambda strategy: (_trained(strategy, str(root / strategy)), root / strategy)


def _consolidate(ckpt_dir, out) -> None:
    assert cli.main(["consolidate", str(ckpt_dir), str(out), "--format", "lightning"]) == 0


def _assert_same_optimizer_state(got: dict, want: dict) -> None:
    assert [{k: v for k, v in g.items()} for g in got["param_groups"]] == want["param_groups"]
    assert got["zero_plugin"]["optimizer_class"] == want["zero_plugin"]["optimizer_class"]
    assert sorted(got["state"]) == sorted(want["state"])
    for pos, entry in want["state"].items():
        assert sorted(got["state"][pos]) == sorted(entry), pos
        for key, value in entry.items():
            assert torch.equal(got["state"][pos][key], value), (pos, key)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_consolidated_file_loads_with_load_from_checkpoint(trained, tmp_path, strategy):
    run, ckpt_root = trained(strategy)
    ckpt_dir = ckpt_root / "epoch=1.ckpt"  # the last save: the trained weights
    assert ckpt_dir.is_dir()
    with pytest.raises(IsADirectoryError):  # Lightning's own loader, before any zero_plugin code runs
        cw.module_class().load_from_checkpoint(ckpt_dir)
    assert any("zero-plugin consolidate" in line and "--format lightning" in line for line in run["log"])
    out = tmp_path / "model.ckpt"
    _consolidate(ckpt_dir, out)
    model = cw.module_class().load_from_checkpoint(out)  # strict: every key, tied lm_head included
    assert model.hparams.layers == 2 and model.net.lm_head.weight is model.net.model.embed_tokens.weight
    state = model.state_dict()
    assert sorted(state) == sorted(run["state"])
    for name, value in run["state"].items():
        assert torch.equal(state[name], value), name
    saved = torch.load(out, weights_only=True)
    assert saved["epoch"] == 1 and saved["global_step"] == 2 * cw.STEPS_PER_EPOCH
    assert "zero_plugin" not in saved and "lr_schedulers" in saved and "loops" in saved
    _assert_same_optimizer_state(saved["optimizer_states"][0], run["optimizer"])


def test_plain_ddp_resumes_from_consolidated_file(trained, tmp_path):
    run, ckpt_root = trained("zero3")
    out = tmp_path / "epoch0.ckpt"
    _consolidate(ckpt_root / "epoch=0.ckpt", out)
    resumed = run_ranks(2, cw.ddp_resume_worker, str(out))
    assert resumed[0]["global_step"] == 2 * cw.STEPS_PER_EPOCH
    tail = run["losses"][len(run["losses"]) // 2 :]  # the uninterrupted run's second epoch (rank 0)
    assert len(resumed[0]["losses"]) == len(tail)
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed[0]["losses"], tail)) <= LOSS_RTOL
    start = torch.load(out, weights_only=True)["state_dict"]
    names = [k for k in run["state"] if run["state"][k].is_floating_point()]
    delta = torch.cat([(resumed[0]["state"][k].double() - start[k].double()).reshape(-1) for k in names])
    ref = torch.cat([(run["state"][k].double() - start[k].double()).reshape(-1) for k in names])
    assert ref.norm() > 0
    assert float((delta - ref).norm() / ref.norm()) <= UPDATE_TOL


def test_consolidate_lightning_refuses_a_plain_checkpoint_folder(tmp_path, capsys):
    (tmp_path / "not_lightning").mkdir()
    assert (
        cli.main(["consolidate", str(tmp_path / "not_lightning"), str(tmp_path / "x.ckpt"), "--format", "lightning"])
        == 2
    )
    assert "not a sharded Lightning checkpoint" in capsys.readouterr().err


def test_safetensors_export_accepts_the_lightning_directory(trained, tmp_path):
    """The other formats read the directory's zero/ part: the weights, each stored once (ties are not repeated)."""
    from safetensors.torch import load_file

    run, ckpt_root = trained("zero3")
    assert cli.main(["consolidate", str(ckpt_root / "epoch=1.ckpt"), str(tmp_path / "st")]) == 0
    weights = load_file(tmp_path / "st" / "model.safetensors")
    assert "net.lm_head.weight" not in weights  # tied: stored under its first name only
    for name, value in weights.items():
        assert torch.equal(value, run["state"][name]), name


def test_fabric_directory_consolidates_under_its_own_keys(tmp_path):
    """A ZeroFabricStrategy directory becomes Fabric's full format: the module and optimizer state under the
    keys passed to fabric.save, the other entries as saved."""
    from tests.integrations import lightning_fabric_workers as fw
    from tests.integrations import lightning_workers as lw

    save = tmp_path / "fabric.ckpt"
    run = run_ranks(2, fw.fabric_worker, "llama", "zero3", save=str(save))[0]
    assert save.is_dir()
    _consolidate(save, tmp_path / "one.ckpt")
    saved = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert saved["step"] == 3 and "zero_plugin" not in saved
    net = lw.build_net("llama")
    net.load_state_dict(saved["model"])  # strict, the tied lm_head name included
    for name, value in run["mid"].items():  # fabric.save came right after the state "mid" was taken
        assert torch.equal(net.state_dict()[name], value), name
    assert saved["optimizer"]["state"] and len(saved["optimizer"]["param_groups"]) == 2
