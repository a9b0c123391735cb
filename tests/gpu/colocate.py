"""``zp.offload_states`` / ``zp.reload_states`` on a real device (issue #37, vLLM colocate mode), run by
tests/gpu/check.py part "colocate".

For stages 1, 2, 3 and 3 + ``offload_optimizer``, world size 1 over NCCL, an fp32 MLP of ~12.6M parameters:
one step, then a backward (gradients held, as between micro-batches), then ``offload_states``:

* ``torch.cuda.memory_allocated()`` falls by at least the bytes ``offload_states`` reports moved (params,
  grads, optimizer state with masters; stage 3's pooled buffers too), ``memory_reserved()`` by at least 90% of
  that (the caching allocator's free segments are given back, so a colocated vLLM can take them);
* ``memory_report``'s device bytes are 0 and its host bytes hold the moved ones; the host copies are pinned;
* after ``reload_states`` the step and two more steps give parameters bitwise equal to a run that never
  offloaded.
``run(device)`` also runs on the CPU (gloo), without the CUDA figures, to check the script itself.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

CONFIGS = {
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "stage3_offload_optimizer": dict(stage=3, offload_optimizer="cpu"),
}


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).to(device)


def _allocated(device: str) -> dict:
    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def _train(device: str, config: dict, offload: bool) -> dict:
    import zero_plugin as zp

    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(**config))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 1024, generator=gen).to(device) for _ in range(4)]
    out: dict = {}
    for i, x in enumerate(xs):
        model(x).square().mean().backward()
        if i == 1 and offload:  # between a backward and the step: gradients, optimizer state and params held
            out = _cycle(device, model, opt)
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().cpu().clone() for p in model.parameters()]
    del model, opt
    gc.collect()  # [Note in docs/architecture.md]: the engine's cycles hold device memory until collected
    return out


def _cycle(device: str, model, opt) -> dict:
    import zero_plugin as zp
    from zero_plugin.engines.engine import engine_of

    engine = engine_of(model, "colocate check")
    before, report_before = _allocated(device), zp.memory_report(model, opt)
    summary = zp.offload_states(model)
    during, report_during = _allocated(device), zp.memory_report(model, opt)
    parked = engine.offloaded_states.parked
    pinned = all(e.host.is_pinned() for entries in parked.values() for e in entries) if device == "cuda" else None
    zp.reload_states(model)
    after = _allocated(device)
    moved = sum(summary["moved"].values())
    out = {
        "summary": summary,
        "moved": moved,
        "device_bytes": [report_before["placement"]["device"]["total"], report_during["placement"]["device"]["total"]],
        "host_bytes": [report_before["placement"]["host"]["total"], report_during["placement"]["host"]["total"]],
        "pinned": pinned,
    }
    if device == "cuda":
        out.update(
            allocated=[before["allocated"], during["allocated"], after["allocated"]],
            reserved=[before["reserved"], during["reserved"], after["reserved"]],
            freed=before["allocated"] - during["allocated"],
        )
    return out


def run(device: str) -> dict:
    results, ok = {}, True
    for name, config in CONFIGS.items():
        plain = _train(device, config, offload=False)
        cycled = _train(device, config, offload=True)
        same = all(torch.equal(a, b) for a, b in zip(plain.pop("params"), cycled.pop("params")))
        checks = {
            "bitwise_after_reload": same,
            "device_bytes_zero": cycled["device_bytes"][1] == 0,
            "host_holds_moved": cycled["host_bytes"][1] - cycled["host_bytes"][0] == cycled["moved"] > 0,
        }
        if device == "cuda":
            checks.update(
                pinned=cycled["pinned"],
                allocated_fell_by_moved=cycled["freed"] >= cycled["moved"],
                # empty_cache gives back whole segments only: most, not necessarily all, of the moved bytes
                reserved_released=cycled["reserved"][0] - cycled["reserved"][1] >= 0.9 * cycled["moved"],
                allocated_back=cycled["allocated"][2] >= cycled["allocated"][0] - (cycled["freed"] - cycled["moved"]),
            )
        ok = ok and all(checks.values())
        results[name] = {**cycled, "checks": checks}
    return {**results, "ok": ok}


def part_colocate() -> dict:
    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    return run("cuda")


if __name__ == "__main__":  # on the CPU: python -m tests.gpu.colocate
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(run("cpu"))
