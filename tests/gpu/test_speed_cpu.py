"""``tests/gpu/speed.py`` (the GPU speed check against FSDP2) on the CPU: both variants at 8 fake ranks are
built so that they train, and the check catches an FSDP2 optimizer built before ``fully_shard``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.harness import REPO_ROOT

_WRONG_ORDER = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests.gpu import speed
    from tests.gpu.fake_pg import fake_world
    _, build = speed.llama_builder(64, 2, 128, 4, 512)
    ids = torch.randint(0, 512, (2, 16))
    with fake_world(8):
        model = build().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # before fully_shard: the old bug
        speed._fully_shard(model, torch.device("cpu"))
        print("RESULT" + json.dumps(speed.step_check("fsdp2", model, opt, ids)))
""")


def _result(command: list[str]) -> dict:
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


def test_speed_check_trains_both_variants_at_8_fake_ranks():
    result = _result(
        [sys.executable, "-m", "tests.gpu.speed", "--device", "cpu", "--small", "--steps", "1", "--rounds", "1"]
    )
    assert result["world_size"] == 8
    assert result["ok"], result["checks"]
    fsdp2 = result["checks"]["fsdp2"]
    assert fsdp2["with_grad"] == fsdp2["params"] and fsdp2["changed"] > 0
    assert result["zp3_over_fsdp2"] > 0


def test_speed_check_catches_an_optimizer_built_before_fully_shard():
    result = _result([sys.executable, "-c", _WRONG_ORDER.format(root=REPO_ROOT)])
    assert not result["ok"] and not result["optimizer_holds_model"] and result["changed"] == 0, result


def test_check_fails_a_part_that_raised_or_reported_not_ok():
    from tests.gpu.check import _failed

    assert _failed({"error": "Traceback ..."}) and _failed({"ok": False, "checks": {}})
    assert not _failed({"ok": True}) and not _failed({"stage0": {"peak": 1}})  # a part that only measures
