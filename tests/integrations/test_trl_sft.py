"""TRL's ``SFTTrainer(model=PATH, peft_config=LoRA)`` under ``zero-plugin launch --stage 3 --num_processes 2``:
the base loaded lazily (a safetensors folder: SFTTrainer's own ``from_pretrained`` builds on meta, PEFT wraps
the meta model, the Trainer's prepare reads it unit by unit) trains exactly as the eager load of the same
weights (a pickle ``pytorch_model.bin``, which cannot load lazily: one fallback warning per rank).
``scripts/sft_trl.py`` has no zero_plugin in it; TRL is driven offline (``datasets.Dataset.from_list``).
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest

from tests.integrations.test_lazy_load import FALLBACK, LAUNCH, _checkpoint, _launch, common

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sft_trl.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    tokenizer = common.default_tokenizer(common.DEFAULT_DATA, tmp / "cache")
    folders = dict(zip(("lazy", "eager"), _checkpoint(tmp / "model", tokenizer, 64, 128, 2, "100KB")))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            kind: pool.submit(_launch, tmp, kind, [str(SCRIPT), "--model", path, "--out", str(tmp / f"{kind}_out")])
            for kind, path in folders.items()
        }
    results = {kind: f.result() for kind, f in futures.items()}
    for kind, result in results.items():
        assert result.returncode == 0, f"{kind} exited {result.returncode}:\n{result.output[-6000:]}"
        result.info = json.loads((tmp / f"{kind}_out" / "result.json").read_text())
    return results


def test_sft_peft_on_a_lazy_base_equals_the_eager_load(runs):
    lazy, eager = runs["lazy"], runs["eager"]
    assert LAUNCH[LAUNCH.index("--stage") + 1] == "3"
    assert FALLBACK not in lazy.output and eager.output.count(FALLBACK) == 2
    assert lazy.info["meta_before_train"] > 0 and eager.info["meta_before_train"] == 0
    assert lazy.info["world_size"] == eager.info["world_size"] == 2
    assert lazy.info["accelerator_class"] == "zero_plugin.integrations.accelerate"
    got, want = ([h["loss"] for h in r.info["log_history"] if "loss" in h] for r in (lazy, eager))
    assert len(got) == 4 and got[0] != got[-1]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-6, (got, want)
