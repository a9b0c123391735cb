"""Checkpoint throughput and consolidation memory: zero_plugin stage 3 against torch DCP + FSDP2.

    python -m benchmarks.checkpoint_bench --params 1e9 --world-size 2 --dir /tmp/ckpt-bench

Both sides, in the same spawned ranks one after the other, use a Llama-style decoder of about
``--params`` parameters built on the meta device, one AdamW step (so the optimizer state exists),
then time:
  * save: barrier-to-barrier wall time of a sharded save of parameters + optimizer state
    (``zp.save_checkpoint`` / ``torch.distributed.checkpoint.save`` of ``get_state_dict``);
  * load: the same for loading it back into the live model and optimizer
    (``zp.load_checkpoint`` / ``dcp.load`` + ``set_state_dict``); files are in the page cache.
    zero_plugin's load includes the sha256 check of every file (split over the ranks); it is
    also timed with ``verify=False`` (sizes only), which is what DCP checks;
  * rank 0's peak host memory increase while consolidating the full model state on rank 0
    (``zp.full_state_dict`` / ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``).
Throughput is bytes of model state (parameters + optimizer state over all ranks) per second.
Memory is about 16 bytes per parameter per framework (spread over the ranks) plus 4 bytes per
parameter on rank 0 for the consolidation; the frameworks run one after the other.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .measure import RssPeak, local_tensor, release_memory

VOCAB = 32000


def llama_config(params: float):
    """A Llama config of about ``params`` parameters (untied embeddings, 12 h^2 per layer)."""
    from transformers import LlamaConfig

    hidden = 1024 if params < 4e8 else 2048 if params < 3e9 else 4096
    intermediate = 64 * round(8 / 3 * hidden / 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate
    layers = max(1, round((params - 2 * VOCAB * hidden) / per_layer))
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )


def _one_step(model, opt) -> None:
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _state_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _all_sum(value: int) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item())


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _peak(fn) -> int:
    release_memory()  # freed heap kept by malloc would hide the consolidation's growth
    meter = RssPeak()
    meter.start()
    result = fn()
    peak = meter.stop()
    del result
    return peak


def bench_zero(cfg, directory: str) -> dict:
    from transformers import LlamaForCausalLM

    import zero_plugin as zp
    from zero_plugin.loading.materialize import empty_model, from_init_fn

    model = empty_model(lambda: LlamaForCausalLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3), param_source=from_init_fn(model._init_weights))
    _one_step(model, opt)
    state = [p for p in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    total = _all_sum(_state_bytes(state))
    path = os.path.join(directory, "zero")
    out = {
        "state_bytes": total,
        "save_s": _timed(lambda: zp.save_checkpoint(path, model, opt, extra={"step": 1})),
        "load_s": _timed(lambda: zp.load_checkpoint(path, model, opt)),
        "load_noverify_s": _timed(lambda: zp.load_checkpoint(path, model, opt, verify=False)),
    }
    dist.barrier()
    out["consolidate_peak_bytes"] = _peak(lambda: zp.full_state_dict(model))
    out["files_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    dist.barrier()
    del model, opt, state
    release_memory()
    return out


def bench_fsdp2(cfg, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from zero_plugin.loading.materialize import empty_model

    model = empty_model(lambda: LlamaForCausalLM(cfg))  # parameters on meta, buffers real
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # to_empty would wipe them (rotary tables)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            local_tensor(p).normal_(0.0, 0.02)
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _one_step(model, opt)
    state = [p for p in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    total = _all_sum(_state_bytes(state))
    path = os.path.join(directory, "dcp")

    def save():
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def load():
        model_sd, optim_sd = get_state_dict(model, opt)
        both = {"model": model_sd, "optim": optim_sd}
        dcp.load(both, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=both["model"], optim_state_dict=both["optim"])

    out = {"state_bytes": total, "save_s": _timed(save), "load_s": _timed(load)}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    dist.barrier()
    out["consolidate_peak_bytes"] = _peak(lambda: get_model_state_dict(model, options=options))
    out["files_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    dist.barrier()
    del model, opt, state
    release_memory()
    return out


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = llama_config(args.params)
        results = {}
        for name, fn in (("zero_plugin", bench_zero), ("torch_dcp_fsdp2", bench_fsdp2)):
            if name == "torch_dcp_fsdp2" and args.skip_fsdp:
                continue
            results[name] = fn(cfg, args.dir)
            gc.collect()
        if rank == 0:
            _report(cfg, results, args)
    finally:
        dist.destroy_process_group()


def _report(cfg, results: dict, args) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    print(
        f"model: {n / 1e9:.3f}B params (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers), "
        f"{args.world_size} ranks, gloo/CPU"
    )
    print(
        f"{'':18}{'state GB':>9}{'files GB':>9}{'save s':>8}{'save GB/s':>10}{'load s':>8}{'load GB/s':>10}"
        f"{'rank0 consolidation peak GB':>29}"
    )
    for name, r in results.items():
        gb = r["state_bytes"] / 1e9
        print(
            f"{name:18}{gb:9.2f}{r['files_bytes'] / 1e9:9.2f}{r['save_s']:8.2f}{gb / r['save_s']:10.2f}"
            f"{r['load_s']:8.2f}{gb / r['load_s']:10.2f}{r['consolidate_peak_bytes'] / 1e9:29.2f}"
        )
        if "load_noverify_s" in r:
            print(f"{'  load, no sha256':36}{'':18}{r['load_noverify_s']:8.2f}{gb / r['load_noverify_s']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "world_size": args.world_size, "results": results}, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="approximate parameter count (default 1e9)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary directory)")
    parser.add_argument("--skip-fsdp", action="store_true", help="only zero_plugin")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(args.world_size, port, args), nprocs=args.world_size, join=True)
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
