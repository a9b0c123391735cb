"""Full fine-tune (every weight trains) with the plain PyTorch API: ``zp.setup`` and a hand-written loop.

    torchrun --nproc-per-node 2 examples/full_finetune.py --stage 3
    torchrun --nproc-per-node 2 examples/full_finetune.py --stage 2 --offload cpu
    ZERO_PLUGIN_STAGE=1 torchrun --nproc-per-node 2 examples/full_finetune.py   # ZeroConfig.from_env()
    python examples/full_finetune.py                                            # one process works too

On GPUs each process uses ``cuda:LOCAL_RANK`` and NCCL; without GPUs, the CPU and gloo.  The loop is
what ``zp.setup`` asks for: ``loss.backward()``, ``zp.clip_grad_norm_``, ``optimizer.step()``, with
``zp.no_sync`` around all but the last micro-batch of an accumulated step.

Output (``--output_dir``): ``checkpoint/`` (``zp.save_checkpoint``: sharded, reloads at any stage and
world size), ``model/`` (``save_pretrained`` of the gathered weights + tokenizer; loads with
``AutoModelForCausalLM.from_pretrained``), ``metrics.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import common
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import zero_plugin as zp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_arguments(parser, max_steps=250, lr=2e-3, output_dir="out/full_finetune")
    parser.add_argument(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage (default: ZERO_PLUGIN_STAGE, else ZeroConfig's default)",
    )
    parser.add_argument("--offload", choices=("none", "cpu"), default=None, help="optimizer state on the CPU")
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    return parser.parse_args()


def init_distributed() -> torch.device:
    """One process per device under torchrun (NCCL on GPUs, gloo on CPUs); a single process otherwise."""
    if "RANK" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def zero_config(args: argparse.Namespace) -> zp.ZeroConfig:
    """``ZeroConfig.from_env()`` (ZERO_PLUGIN_* variables) with --stage / --offload on top."""
    fields = zp.ZeroConfig.from_env().to_dict()
    if args.stage is not None:
        fields["stage"] = args.stage
    if args.offload is not None:
        fields["offload_optimizer"] = args.offload
    return zp.ZeroConfig.from_dict(fields)


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    config = zero_config(args)
    torch.manual_seed(args.seed)

    tokenizer = common.load_tokenizer(args)  # every rank loads the same cached files
    rows = common.encode_all(common.load_records(args.data), tokenizer, args.max_length)
    sampler = DistributedSampler(rows, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(
        rows,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=common.Collator(tokenizer.pad_token_id),
    )
    model = common.build_model(args, tokenizer).to(device)
    trainable, total = common.count_parameters(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms: no weight decay
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    model, optimizer = zp.setup(model, optimizer, config)  # collective; shards in place
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.lr_lambda(args.warmup_steps, args.max_steps))

    label = f"ZeRO-{config.stage}" + (" + CPU offload" if config.offload_optimizer == "cpu" else "")
    if rank == 0:
        print(
            f"{label} on {world_size} process(es), {device}; all {trainable:,} parameters train; "
            f"{len(rows)} examples, {args.batch_size} per process per micro-batch"
        )
    before = common.samples(model, tokenizer, args.max_new_tokens)  # collective at ZeRO-3: every rank
    if rank == 0:
        common.print_samples("Before training:", before)
    zp.reset_comm_stats()  # count the training steps only

    history, reports, seconds = train(args, model, optimizer, scheduler, loader, sampler, device, rank)
    comm = zp.comm_stats()
    after = common.samples(model, tokenizer, args.max_new_tokens)

    zp.save_checkpoint(
        os.path.join(args.output_dir, "checkpoint"),
        model,
        optimizer,
        extra={"step": len(history), "scheduler": scheduler.state_dict()},
    )
    model_dir = os.path.join(args.output_dir, "model")
    state = zp.full_state_dict(model)  # collective: full CPU tensors on rank 0, {} elsewhere
    if rank == 0:
        model.save_pretrained(model_dir, state_dict=state)
        tokenizer.save_pretrained(model_dir)
        common.print_samples("After training:", after)
        reloaded = reload_and_generate(args, model_dir)
        common.print_samples(f"Reloaded from {model_dir} with AutoModelForCausalLM.from_pretrained:", reloaded)
        common.print_report(history, reports, comm, seconds, model_dir)
        common.write_json(
            os.path.join(args.output_dir, "metrics.json"),
            {
                "example": "full_finetune",
                "history": history,
                "losses": [h["loss"] for h in history],
                "seconds": seconds,
                "num_processes": world_size,
                "zero_config": config.to_dict(),
                "trainable_params": trainable,
                "total_params": total,
                "samples_before": before,
                "samples_after": after,
                "samples_reloaded": reloaded,
                "memory": reports,
                "comm": comm,
            },
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(args, model, optimizer, scheduler, loader, sampler, device, rank):
    """Returns (per-step history, every rank's memory report at the last step, seconds)."""
    progress = common.Progress(args.max_steps, rank == 0, desc="train")
    history, reports, micro_batches = [], None, []
    epoch = 0
    model.train()
    while len(history) < args.max_steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            micro_batches.append({k: v.to(device) for k, v in batch.items()})
            if len(micro_batches) < args.grad_accum:
                continue
            log = (len(history) + 1) % args.log_every == 0 or len(history) + 1 == args.max_steps
            loss, tokens, memory = step(args, model, optimizer, micro_batches, log)
            scheduler.step()
            micro_batches = []
            totals = torch.tensor([loss, tokens], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(totals)  # not a zero_plugin collective: not in zp.comm_stats()
            mean_loss = float(totals[0]) / (dist.get_world_size() if dist.is_initialized() else 1)
            history.append(
                {
                    "step": len(history) + 1,
                    "loss": mean_loss,
                    "tokens": int(totals[1]),
                    "lr": scheduler.get_last_lr()[0],
                }
            )
            memory_bytes = None
            if memory is not None:
                reports = gather_objects(memory)
                memory_bytes = [r["measured"]["total"] for r in reports]
            progress.update(len(history), mean_loss, int(totals[1]), memory_bytes, log=log)
            if len(history) >= args.max_steps:
                break
    return history, reports, progress.close()


def step(args, model, optimizer, micro_batches, want_memory: bool):
    """One optimizer step over ``micro_batches``: (mean loss, tokens, memory report or None)."""
    loss_sum, tokens = 0.0, 0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else zp.no_sync(model):  # reduce once, on the last micro-batch
            loss = model(**batch).loss
            (loss / len(micro_batches)).backward()
        loss_sum += float(loss.detach())
        tokens += int(batch["attention_mask"].sum())
    zp.clip_grad_norm_(model, 1.0)
    memory = zp.memory_report(model, optimizer) if want_memory else None  # gradients are held here
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum / len(micro_batches), tokens, memory


def gather_objects(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reload_and_generate(args, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return common.samples(model, tokenizer, args.max_new_tokens)


if __name__ == "__main__":
    main()
