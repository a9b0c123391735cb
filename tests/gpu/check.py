"""One-call GPU check (run by tests/gpu/run.sh on a lent GPU machine); writes one JSON of results.

  1. NCCL, world size 1: stages 0-3 (and stage 3 + offload) match a single-GPU reference (float64 MLP).
  1b. Stage-3 side streams (tests/gpu/overlap.py): the prefetched all-gather of unit i+1 overlaps unit i's
     compute, the control without side streams does not, and per-step peak memory is identical and bounded.
  1c. Optimizer offload (tests/gpu/offload.py): peak CUDA memory falls by the optimizer-state bytes, and the
     blocked offload step (per-master copy waits, block-wise write-back) is bitwise the whole-tensor one.
  1c'. Colocate (tests/gpu/colocate.py): zp.offload_states frees the model states' device memory (allocated and
     reserved) into pinned host copies, zp.reload_states brings them back and training continues bitwise.
  1c''. Activation offload (tests/gpu/activation_offload.py): the checkpointed layer inputs leave the device
     (forward memory falls by the layer inputs) and the gradients, and stage 3's training, stay bitwise.
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
  4. Step time of stage 3 against torch FSDP2 (fully_shard, optimizer built after it) on the same ~1B model
     (tests/gpu/speed.py): the main figure at 8 ranks under the fake process group on the one GPU (at world
     size 1 FSDP2 issues no collective), world size 1 over NCCL beside it; both variants must train (FSDP2's
     parameters get gradients and change) or the part fails.
Each part is independent: a failure is recorded in the JSON and the next part runs; the exit status is 1
when any part raised or reported ``ok: false``.
"""

from __future__ import annotations

import argparse
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
    from tests.gpu.speed import llama_builder

    return llama_builder(hidden, layers, inter, heads)


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


def part_speed_vs_fsdp2(steps: int = 10) -> dict:
    """Stage 3 against FSDP2 on the ~1B Llama, bf16, 4 x 512 tokens (``tests/gpu/speed.py``).  The main
    figure is 8 ranks under the fake process group on this one GPU (a process of its own): at world size 1
    FSDP2 issues no collective, so the NCCL world-size-1 ratio beside it compares unlike paths."""
    import subprocess
    import sys

    from tests.gpu.speed import compare

    res = subprocess.run(
        [sys.executable, "-m", "tests.gpu.speed", "--world", "8", "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    fake = json.loads(res.stdout.split("RESULT", 1)[1]) if "RESULT" in res.stdout else {"error": res.stderr[-3000:]}
    _nccl_world1()
    _, build = _llama(2048, 16, 5504, 16)
    world1 = compare(build, torch.randint(0, 32000, (4, 512), device="cuda"), steps)
    return {
        "zp3_over_fsdp2": fake.get("zp3_over_fsdp2"),  # the main figure: 8 fake ranks
        "fake_world8": fake,
        "nccl_world1": world1,
        "ok": bool(fake.get("ok")) and world1["ok"],
    }


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


def part_colocate() -> dict:
    """tests/gpu/colocate.py: zp.offload_states / zp.reload_states free and restore the device (issue #37)."""
    from tests.gpu.colocate import part_colocate as run

    return run()


def part_activation_offload() -> dict:
    """tests/gpu/activation_offload.py: offload_activations="cpu" moves the checkpointed inputs off the device and
    changes no bit of the gradients (issue #50)."""
    from tests.gpu.activation_offload import part_activation_offload as run

    return run()


def part_qlora() -> dict:
    """tests/gpu/qlora.py: a bitsandbytes 4-bit base + LoRA at stage 3 on CUDA against the unsharded run."""
    from tests.gpu.qlora import part_qlora as run

    return run()


PARTS = {
    "parity": part_parity,
    "overlap": part_overlap,
    "offload": part_offload,
    "colocate": part_colocate,
    "activation_offload": part_activation_offload,
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
    failed = [name for name in args.parts if _failed(results[name])]
    print("failed parts:", failed or "none", flush=True)
    raise SystemExit(1 if failed else 0)  # run.sh's exit status says whether every part passed


def _failed(result) -> bool:
    """A part failed when it raised or reports ``ok: false``; parts without ``ok`` only measure."""
    return isinstance(result, dict) and ("error" in result or result.get("ok") is False)


if __name__ == "__main__":
    main()
