"""``tests/gpu/overlap.py``'s stand-in wire time reaches every stage-3 collective, forward and backward, through
every ``Comm`` the engine uses: checked on the CPU at 2 gloo ranks in the buffered (NCCL) layout, where the
reductions run on their own ``Comm`` ([Note: reductions on their own group] in stage3/hooks.py)."""

from __future__ import annotations

import json
import textwrap

from tests.harness import REPO_ROOT, run_script_ranks

_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    import zero_plugin as zp
    from zero_plugin.engines.engine import engine_of
    from tests.gpu import overlap

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = overlap.Chain(hidden=16, blocks=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3, prefetch_depth=1))
    engine = engine_of(model, "overlap")
    seen, phase = [], ["forward"]
    overlap.patch_collectives(engine, lambda kind, tag: seen.append((phase[0], kind)))
    for _ in range(2):
        seen.clear()
        phase[0] = "forward"
        loss = model(torch.randn(4, 16)).pow(2).mean()
        phase[0] = "backward"
        loss.backward()
        opt.step()
        opt.zero_grad()
    comms = overlap.comms_of(engine)
    if dist.get_rank() == 0:
        print("RESULT" + json.dumps({{"seen": seen, "comms": len(comms), "units": len(engine.units)}}))
    dist.destroy_process_group()
""")


def test_stand_ins_reach_forward_and_backward_gathers_and_the_reductions(tmp_path):
    script = tmp_path / "overlap_cpu.py"
    script.write_text(_SCRIPT.format(root=REPO_ROOT))
    env = lambda rank: {"RANK": str(rank), "ZERO_PLUGIN_BUFFERED_COLLECTIVES": "1"}  # noqa: E731
    runs = run_script_ranks([str(script)], rank_env=env)
    for code, output in runs:
        assert code == 0, output[-3000:]
    result = json.loads(runs[0][1].split("RESULT", 1)[1].splitlines()[0])
    seen = [tuple(s) for s in result["seen"]]
    assert result["comms"] == 2  # the gathers' Comm and the reductions' own one
    assert ("forward", "all_gather") in seen and ("backward", "all_gather") in seen
    assert ("backward", "reduce_scatter") in seen
