"""Per-rank model-state memory at world size 8, measured in one process (fake process group).

Runs on CPU in CI; tests/gpu/run.sh runs the CUDA variant with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    import zero_plugin as zp
    from tests.gpu.fake_pg import fake_world
    stage = {stage}
    with fake_world(8):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        for i, layer in enumerate(model):
            layer.__class__ = type("Block", (torch.nn.Linear,), {{}})
        opt = torch.optim.AdamW(model.parameters())
        model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage, unit_classes=("Block",)))
        x = torch.randn(4, 512)
        model(x).sum().backward(); opt.step(); opt.zero_grad()
        model(x).sum().backward()
        rep = zp.memory_report(model, opt)
        print("REPORT" + json.dumps({{"measured": rep["measured"], "theory": rep["theory"]}}))
""")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_8_model_states_match_theory(stage):
    import json

    from tests.harness import REPO_ROOT

    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(root=REPO_ROOT, stage=stage)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout.split("REPORT", 1)[1])
    measured, theory = rep["measured"]["total"], rep["theory"]["total"]
    # within padding (< 8 elements per parameter) and AdamW's 4-byte step counters
    assert abs(measured - theory) <= 16 * (8 * 4 + 4) * 2, (measured, theory)
