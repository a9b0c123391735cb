"""Scale check for stage 3: 2 ranks train a model whose DDP model states would not fit this machine.

    python -m benchmarks.scale_stage3 --params 1.0e9 --steps 3

The model (Llama-shaped, random init) is built on the meta device and materialised one decoder
layer at a time by ``zp.setup(..., param_source=from_init_fn(model._init_weights))``, so no rank
ever holds the full model.  fp32 AdamW: DDP would need 16Ψ bytes per rank (16 GB at Ψ = 1e9, 32 GB
for two ranks on this 24 GiB machine); stage 3 needs 16Ψ/N.  Prints peak RSS per rank against that.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GiB = 2**30


def llama_config(params: float):
    from transformers import LlamaConfig

    hidden, layers = (2048, 18) if params >= 0.9e9 else (1024, 12)
    inter = int(hidden * 8 / 3) // 64 * 64
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def worker(rank: int, world: int, port: int, params: float, steps: int, out: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from transformers import LlamaForCausalLM

    import zero_plugin as zp
    from zero_plugin.loading.materialize import empty_model, from_init_fn

    cfg = llama_config(params)
    model = empty_model(lambda: LlamaForCausalLM(cfg))
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    t0 = time.time()
    model, optimizer = zp.setup(
        model, optimizer, zp.ZeroConfig(stage=3), param_source=from_init_fn(model._init_weights)
    )
    setup_s, rss_after_setup = time.time() - t0, rss_gib()
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(rank))
    times, losses = [], []
    for _ in range(steps):
        t = time.time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.time() - t)
        losses.append(loss.item())
    report = zp.memory_report(model, optimizer)
    out[rank] = {
        "psi": psi,
        "setup_s": setup_s,
        "rss_after_setup": rss_after_setup,
        "peak_rss": rss_gib(),
        "step_s": times,
        "losses": losses,
        "states": report["measured"]["total"] / GiB,
        "theory": report["theory"]["total"] / GiB,
    }
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.0e9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.world_size, port, args.params, args.steps, out), nprocs=args.world_size)
    psi = out[0]["psi"]
    print(f"Ψ = {psi / 1e9:.3f}B parameters, {args.world_size} ranks, fp32 AdamW, stage 3")
    print(
        f"DDP model states would need 16Ψ = {16 * psi / GiB:.1f} GiB per rank; stage 3 theory 16Ψ/N = "
        f"{16 * psi / args.world_size / GiB:.1f} GiB"
    )
    print("| rank | setup s | steps s | losses | model states GiB (theory) | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for r in range(args.world_size):
        o = out[r]
        print(
            f"| {r} | {o['setup_s']:.0f} | {', '.join(f'{t:.1f}' for t in o['step_s'])} | "
            f"{', '.join(f'{x:.3f}' for x in o['losses'])} | {o['states']:.2f} ({o['theory']:.2f}) | "
            f"{o['peak_rss']:.2f} |"
        )


if __name__ == "__main__":
    main()
