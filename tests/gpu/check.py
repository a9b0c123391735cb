"""One-call GPU check (run by tests/gpu/run.sh on a lent GPU machine); writes one JSON of results.

  1. NCCL, world size 1: stages 0-3 (and stage 3 + offload) match a single-GPU reference (float64 MLP).
  1b. Stage-3 side streams (tests/gpu/overlap.py): the prefetched all-gather of unit i+1 overlaps unit i's
     compute, the control without side streams does not, and per-step peak memory is identical and bounded.
  1c. Optimizer offload (tests/gpu/offload.py): peak CUDA memory falls by the optimizer-state bytes, and the
     blocked offload step (per-master copy waits, block-wise write-back) is bitwise the whole-tensor one.
  1d. Lazy load (tests/gpu/lazy_load.py): a ~1.1 GB safetensors checkpoint through zero_plugin.run's lazy
     ``from_pretrained`` + LoRA + ``Accelerator.prepare`` (stage 3, parameter offload) under a 512 MiB cap:
     setup never holds the model on the device (peak < cap), two steps run.
  1e. QLoRA (tests/gpu/qlora.py): a bitsandbytes 4-bit base (bf16 storage) + LoRA at stage 3, with and without
     parameter offload, against the unsharded run; the packed weights stay bitwise the loaded ones.
  2. Fake process group, N = 8: per-rank peak CUDA memory of a ~1B-parameter model for stages 0-3
     against ``memory_report``'s theory.
  3. A 13B-parameter Llama-shaped model (random init, materialised unit by unit from the meta device)
     fine-tuned with LoRA under a 24 GiB cap (set_per_process_memory_fraction), stage 3 with parameter
     and optimizer offload, bf16 compute: at least 2 steps.
  4. Step time of stage 3 against torch FSDP2 (fully_shard) on the same ~1B model, world size 1.
Each part is independent: a failure is recorded in the JSON and the next part runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

GiB = 2**30


def _nccl_world1() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)


def part_parity() -> dict:
    import zero_plugin as zp
    from tests import models

    _nccl_world1()
    batches = [tuple(t.cuda() for t in b) for b in models.make_batches("mlp", 4, 1, 4)]
    ref = models.make_odd_mlp().cuda()
    ref_opt = models.two_group_adamw(ref)
    for x, y in batches:
        models.loss_fn(ref, (x, y)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = {k: v.detach().cpu() for k, v in ref.named_parameters()}
    out = {}
    for name, cfg in {
        "stage0": dict(stage=0),
        "stage1": dict(stage=1),
        "stage2": dict(stage=2),
        "stage3": dict(stage=3),
        "stage3_offload": dict(stage=3, offload_optimizer="cpu"),
    }.items():
        model = models.make_odd_mlp().cuda()
        model, opt = zp.setup(model, models.two_group_adamw(model), zp.ZeroConfig(**cfg))
        for x, y in batches:
            models.loss_fn(model, (x, y)).backward()
            opt.step()
            opt.zero_grad()
        got = zp.full_state_dict(model)
        out[name] = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    return {"max_abs_diff": out, "ok": all(v <= 1e-10 for v in out.values())}


def _llama(hidden: int, layers: int, inter: int, heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
    )
    return cfg, (lambda: LlamaForCausalLM(cfg))


def part_fake_pg_memory() -> dict:
    import subprocess
    import sys

    out = {}
    stages = [int(s) for s in os.environ.get("GPU_FAKE_PG_STAGES", "0 1 2 3").split()]
    for stage in stages:
        code = (
            "import json, torch, zero_plugin as zp\n"
            "from tests.gpu.fake_pg import fake_world\n"
            "from tests.gpu.check import _llama\n"
            "from zero_plugin.loading.materialize import empty_model, from_init_fn\n"
            "torch.cuda.set_device(0)\n"
            f"with fake_world(8):\n"
            "    cfg, build = _llama(2048, 16, 5504, 16)\n"
            "    model = empty_model(build)\n"
            "    opt = torch.optim.AdamW(model.parameters())\n"
            f"    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage={stage}), param_source=from_init_fn(model._init_weights))\n"
            "    model.cuda() if {stage} < 3 else None\n"
            "    torch.cuda.reset_peak_memory_stats()\n"
            "    ids = torch.randint(0, 32000, (1, 128), device='cuda')\n"
            "    for _ in range(2):\n"
            "        model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()\n"
            "    rep = zp.memory_report(model, opt)\n"
            "    print('RESULT' + json.dumps({'peak': torch.cuda.max_memory_allocated(), 'theory': rep['theory']['total'], 'measured': rep['measured']['total']}))\n"
        ).replace("{stage}", str(stage))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
        out[f"stage{stage}"] = (
            json.loads(res.stdout.split("RESULT", 1)[1]) if "RESULT" in res.stdout else {"error": res.stderr[-2000:]}
        )
    return out


def part_13b_lora() -> dict:
    from peft import LoraConfig, get_peft_model

    import zero_plugin as zp
    from zero_plugin.loading.materialize import empty_model, from_init_fn

    _nccl_world1()
    torch.cuda.set_per_process_memory_fraction(24 * GiB / torch.cuda.get_device_properties(0).total_memory)
    cfg, build = _llama(5120, 40, 13824, 40)
    model = empty_model(build)
    psi = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    t0 = time.time()
    model, opt = zp.setup(
        model,
        opt,
        zp.ZeroConfig(stage=3, offload_params=True, offload_optimizer="cpu", param_dtype="bf16"),
        param_source=from_init_fn(model.base_model.model._init_weights),
    )
    setup_s = time.time() - t0
    ids = torch.randint(0, 32000, (1, 128), device="cuda")
    losses, times = [], []
    for _ in range(2):
        t = time.time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        losses.append(loss.item())
        times.append(time.time() - t)
    return {
        "params": psi,
        "setup_s": setup_s,
        "step_s": times,
        "losses": losses,
        "peak_cuda_gib": torch.cuda.max_memory_allocated() / GiB,
    }


def speed_variant(name: str, build):
    """The model and optimizer ``part_speed_vs_fsdp2`` times: ``build()`` in bf16 on the device, under torch
    FSDP2 (``"fsdp2"``, one group per decoder layer) or zero_plugin stage 3 (``"zp3"``)."""
    from torch.distributed.fsdp import fully_shard

    import zero_plugin as zp

    torch.manual_seed(0)
    model = build().cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if name == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, opt
    return zp.setup(model, opt, zp.ZeroConfig(stage=3))


def part_speed_vs_fsdp2(steps: int = 10) -> dict:
    _nccl_world1()
    cfg, build = _llama(2048, 16, 5504, 16)
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    result = {}
    for name in ("fsdp2", "zp3", "fsdp2", "zp3"):
        model, opt = speed_variant(name, build)
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize()
            t = time.time()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.time() - t)
        result.setdefault(name, []).append(sorted(times)[len(times) // 2])
        del model, opt
        gc.collect()  # zero_plugin's engine and the model reference each other: freed by the cycle collector
        torch.cuda.empty_cache()
    result["zp3_over_fsdp2"] = min(result["zp3"]) / min(result["fsdp2"])
    return result


def part_lazy_load() -> dict:
    """tests/gpu/lazy_load.py in a fresh process (its own patches, memory cap and NCCL store port)."""
    import subprocess
    import sys

    env = {**os.environ, "MASTER_PORT": "29534"}
    res = subprocess.run(
        [sys.executable, "-m", "tests.gpu.lazy_load"], capture_output=True, text=True, timeout=300, env=env
    )
    if "RESULT" not in res.stdout:
        return {"error": (res.stdout + res.stderr)[-3000:], "ok": False}
    return json.loads(res.stdout.split("RESULT", 1)[1])


def part_overlap() -> dict:
    from tests.gpu.overlap import part_overlap as run

    return run()


def part_offload() -> dict:
    from tests.gpu.offload import part_offload as run

    return run()


def part_qlora() -> dict:
    """tests/gpu/qlora.py: a bitsandbytes 4-bit base + LoRA at stage 3 on CUDA against the unsharded run."""
    from tests.gpu.qlora import part_qlora as run

    return run()


PARTS = {
    "parity": part_parity,
    "overlap": part_overlap,
    "offload": part_offload,
    "fake_pg_memory": part_fake_pg_memory,
    "lazy_load": part_lazy_load,
    "qlora": part_qlora,
    "lora_13b": part_13b_lora,
    "speed_vs_fsdp2": part_speed_vs_fsdp2,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gpu_results.json")
    ap.add_argument("--parts", nargs="*", default=list(PARTS))
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name in args.parts:
        t = time.time()
        try:
            results[name] = PARTS[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = round(time.time() - t, 1)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(name, json.dumps(results[name], default=str)[:800], flush=True)


if __name__ == "__main__":
    main()
