"""Where a step's peak RSS goes, DDP against zero_plugin: live heap bytes, saved activations, allocator slack.

    torchrun --nproc_per_node 2 --master_port 29611 -m benchmarks.heap_budget --variant ddp
    torchrun --nproc_per_node 2 --master_port 29611 -m benchmarks.heap_budget --variant zp

Builds a ``benchmarks.models`` model (fp32, AdamW, batch x seq random tokens per rank), wraps it as tuned DDP
(``gradient_as_bucket_view=True``, ``broadcast_buffers=False``) or ``zp.setup`` at ``--stage``, and for each step
prints (rank 0, one JSON line, MiB above the RSS before the model was built): the step's peak (``VmHWM``, reset
at the step's start), the RSS the step starts from (after the previous step's ``zero_grad``), the forward's
peak and end RSS, the backward's end RSS, the bytes of distinct storages autograd saved in forward that are
not parameters (the activations), and glibc's heap bytes in use and free at the ends of forward and backward
(``mallinfo2``, absolute, not above the baseline).  The gap between a peak and the bytes in use is allocator
slack: it tells whether a peak-RSS target is reachable at all for the shape (issue #21's 0.60x DDP at
``blocks34m``).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from .measure import _reset_hwm, exit_rank
from .models import SIZES, build_model, make_batch
from .step_memory import _heap, _status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("ddp", "zp"), default="zp")
    ap.add_argument("--stage", type=int, default=3, help="zero_plugin's stage (--variant zp)")
    ap.add_argument("--size", default="blocks34m", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="ZeroConfig fields (--variant zp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = _status()["VmRSS"]
    model = build_model(args.size, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    else:
        import zero_plugin as zp

        model, optimizer = zp.setup(
            model,
            optimizer,
            zp.ZeroConfig.from_dict({"stage": args.stage, **dict(kv.split("=", 1) for kv in args.set)}),
        )
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            is_param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
            saved[storage.data_ptr()] = (storage.nbytes(), is_param)
        return t

    vocab = SIZES[args.size].vocab
    for step in range(args.steps):
        ids = make_batch(vocab, args.batch, args.seq, 0, rank, step)
        saved.clear()
        start = _status()["VmRSS"] - base
        _reset_hwm()  # VmHWM := current RSS
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        forward, heap = _status(), _heap()
        loss.backward()
        backward, heap_backward = _status(), _heap()
        optimizer.step()
        optimizer.zero_grad()
        row = {
            "variant": args.variant if args.variant == "ddp" else f"zp{args.stage}",
            "step": step,
            "peak_MiB": _status()["VmHWM"] - base,
            "forward_peak_MiB": forward["VmHWM"] - base,
            "forward_end_MiB": forward["VmRSS"] - base,
            "backward_end_MiB": backward["VmRSS"] - base,
            "saved_activations_MiB": round(sum(n for n, p in saved.values() if not p) / 2**20),
            **{f"forward_end_{k}": v for k, v in heap.items()},
            **{f"backward_end_{k}": v for k, v in heap_backward.items()},
            "step_start_MiB": start,
        }
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    exit_rank()


if __name__ == "__main__":
    main()
