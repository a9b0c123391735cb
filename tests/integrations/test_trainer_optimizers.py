"""The HF ``Trainer`` with ``optim="adafactor"`` (transformers' Adafactor: factored second moments) under
``zero-plugin launch --stage 3`` against the same script under plain DDP (``accelerate launch``), on a Llama whose
embedding and untied head are units of their own.  Before the parameter partition ([Note: optimizer partitions] in
``zero_plugin/optim/partition.py``) stage 3 stepped 1-D shards and trained to other weights; now the weights
match DDP's to float32 tolerance (relative update error) and the losses to 1e-4.  Two launches, ~20 s each.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import models
from tests.integrations import launches

SCRIPT = Path(__file__).parent / "scripts" / "trainer_optim.py"


def _weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def test_trainer_adafactor_stage3_matches_ddp(tmp_path) -> None:
    runs = {"ddp": launches.DDP, "stage3": launches.zero(3)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        procs = {
            name: pool.submit(launches.run_script, launcher, SCRIPT, tmp_path / name) for name, launcher in runs.items()
        }
        done = {name: proc.result() for name, proc in procs.items()}
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    results = {name: json.loads((tmp_path / name / "result.json").read_text()) for name in runs}
    assert results["ddp"]["optimizer"] == "Adafactor"
    assert len(results["stage3"]["losses"]) == len(results["ddp"]["losses"]) == 4
    assert results["stage3"]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-4)
    ddp, ours = _weights(tmp_path / "ddp"), _weights(tmp_path / "stage3")
    assert ddp.keys() == ours.keys()
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM, set_seed

    set_seed(0)
    from tests.models import llama_config

    init = LlamaForCausalLM(llama_config(4096, 256, intermediate=384, layers=2, heads=4, kv_heads=2, use_cache=False))
    theta0 = {k: v for k, v in init.state_dict().items() if k in ddp}
    error = models.update_norm_error(ours, ddp, theta0)
    assert error < 1e-3, f"stage 3 vs DDP relative update error {error:.3g}"
