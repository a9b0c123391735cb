"""Step time of zero_plugin stage 3 against torch FSDP2 (``fully_shard``) on one Llama (``check.part_speed_vs_fsdp2``).

The main figure runs at 8 ranks on the one device under torch's fake process group
(``python -m tests.gpu.speed --world 8``, a process of its own: the fake group is its default group).  At
world size 1 FSDP2 issues no all-gather and no reduce-scatter at all, so a world-size-1 ratio compares
zero_plugin's collective path with none; under the fake group both issue every collective, copy-in and
copy-out of 8 ranks, with no data on a wire.  Both variants are checked to train before they are timed:
FSDP2 replaces the parameters in ``fully_shard``, so its optimizer is built after it (built before, the
optimizer steps the old tensors and FSDP2's parameters never change; ``step_check`` catches that).
``tests/gpu/test_speed_cpu.py`` runs this module on the CPU with a small Llama.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["llama_builder", "speed_variant", "step_check", "time_steps", "compare"]


def llama_builder(hidden: int, layers: int, inter: int, heads: int, vocab: int = 32000):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
    )
    return cfg, (lambda: LlamaForCausalLM(cfg))


def speed_variant(name: str, build, device: torch.device | str = "cuda"):
    """``build()`` in bf16 on ``device`` under FSDP2 (``"fsdp2"``, one group per decoder layer and the root)
    or zero_plugin stage 3 (``"zp3"``), with fused AdamW built where each needs it."""
    import zero_plugin as zp

    torch.manual_seed(0)
    model = build().to(device=device, dtype=torch.bfloat16)
    if name == "fsdp2":
        _fully_shard(model, torch.device(device))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # after: see the docstring
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return zp.setup(model, opt, zp.ZeroConfig(stage=3))


def _fully_shard(model: nn.Module, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param  # FSDP2's parameters are DTensors


def step_check(name: str, model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> dict:
    """One step: the optimizer holds the model's own parameters, FSDP2's all get a gradient, and the step
    changes the model's parameters (some bf16 ones may not move at lr 1e-5: any counts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    before = [_local(p).detach().clone() for p in params]
    model(input_ids=ids, labels=ids).loss.backward()
    with_grad = sum(p.grad is not None for p in params)
    opt.step()
    opt.zero_grad()
    changed = sum(not torch.equal(b, _local(p).detach()) for b, p in zip(before, params))
    holds_model = held == {id(p) for p in params}
    ok = holds_model and changed > 0 and (name != "fsdp2" or with_grad == len(params))
    return {
        "params": len(params),
        "optimizer_holds_model": holds_model,
        "with_grad": with_grad,
        "changed": changed,
        "ok": ok,
    }


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, steps: int) -> float:
    """Median seconds per step after 2 warm-up steps (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    times = []
    for i in range(steps + 2):
        sync()
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def compare(build, ids: torch.Tensor, steps: int, rounds: int = 2) -> dict:
    """FSDP2 and zp3 interleaved ``rounds`` times: each one's checks and median step, the ratio of minima."""
    result: dict = {"world_size": dist.get_world_size(), "checks": {}}
    for _ in range(rounds):
        for name in ("fsdp2", "zp3"):
            model, opt = speed_variant(name, build, ids.device)
            result["checks"][name] = step_check(name, model, opt, ids)
            result.setdefault(name, []).append(time_steps(model, opt, ids, steps))
            del model, opt
            gc.collect()  # zero_plugin's engine and the model reference each other: freed by the cycle collector
            if ids.is_cuda:
                torch.cuda.empty_cache()
    result["zp3_over_fsdp2"] = min(result["zp3"]) / min(result["fsdp2"])
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    return result


def main() -> None:
    """One run under the fake process group: prints ``RESULT`` and the JSON of :func:`compare`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 2-layer hidden-64 Llama (the CPU test)")
    args = ap.parse_args()
    from tests.gpu.fake_pg import fake_world

    if args.device == "cuda":
        torch.cuda.set_device(0)
    shape = (64, 2, 128, 4, 512) if args.small else (2048, 16, 5504, 16, 32000)
    _, build = llama_builder(*shape)
    batch = (2, 32) if args.small else (4, 512)
    ids = torch.randint(0, shape[-1], batch, device=args.device)
    with fake_world(args.world):
        print("RESULT" + json.dumps(compare(build, ids, args.steps, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
