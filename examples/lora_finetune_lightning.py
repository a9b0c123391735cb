"""LoRA fine-tune with a LightningModule and ``Trainer(strategy="zero3")``.

    python examples/lora_finetune_lightning.py                          # 2 processes, ZeRO-3 (Lightning starts rank 1)
    python examples/lora_finetune_lightning.py --strategy zero2_offload
    python examples/lora_finetune_lightning.py --strategy ddp           # Lightning's own DDP, for comparison

``import zero_plugin.integrations.lightning`` registers the strategy names ``zero1``, ``zero2``,
``zero2_offload``, ``zero3``, ``zero3_offload``; ``ZeroStrategy(config=zp.ZeroConfig(...))`` gives full
control.  Everything else is ordinary Lightning: the LightningModule does not know it is sharded.

Output (``--output_dir``): ``last.ckpt`` (``trainer.save_checkpoint``), ``adapter/`` (PEFT adapter +
tokenizer, loads with ``PeftModel.from_pretrained``), ``metrics.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import common
import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import zero_plugin as zp
import zero_plugin.integrations.lightning  # noqa: F401  (registers strategy="zero1" ... "zero3_offload")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_arguments(parser, max_steps=250, lr=5e-3, output_dir="out/lora_lightning")
    common.add_lora_arguments(parser)
    parser.add_argument("--strategy", default="zero3", help="zero1, zero2, zero2_offload, zero3, zero3_offload, ddp")
    parser.add_argument("--devices", type=int, default=2, help="processes per machine")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--warmup_steps", type=int, default=10)
    return parser.parse_args()


class LoRAModule(L.LightningModule):
    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        super().__init__()
        self.args = args
        self.model = common.add_lora(common.build_model(args, tokenizer), args)

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=self.args.lr, weight_decay=0.0
        )
        factor = common.lr_lambda(self.args.warmup_steps, self.args.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Report(L.Callback):
    """Sample answers before/after training, tokens/s and per-rank memory in the progress bar,
    the memory table and communication per step.  Every hook runs on every rank (collectives line up)."""

    def __init__(self, tokenizer, args: argparse.Namespace) -> None:
        self.tokenizer, self.args = tokenizer, args
        self.history: list[dict] = []
        self.reports: list[dict] | None = None
        self.samples_before: dict = {}
        self.comm: dict | None = None
        self.tokens, self.started = 0, 0.0

    def zero_stage(self, trainer) -> int | None:
        config = getattr(trainer.strategy, "config", None)
        return config.stage if isinstance(config, zp.ZeroConfig) else None

    def samples(self, trainer, module) -> dict:
        # Collective at ZeRO-3, and decoded through the LightningModule's forward, which gathers the
        # parameters zp.setup hooked on it; see [Note: generate at ZeRO-3 with PEFT] in common.py.
        if self.zero_stage(trainer) == 3:
            return common.samples(module, self.tokenizer, self.args.max_new_tokens, through_forward=True)
        return common.samples(module.model, self.tokenizer, self.args.max_new_tokens)

    def on_train_start(self, trainer, module):
        self.samples_before = self.samples(trainer, module)
        if trainer.is_global_zero:
            common.print_samples("Before training:", self.samples_before)
        if self.zero_stage(trainer) is not None:
            zp.reset_comm_stats()  # count the training steps only
        self.started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        step = trainer.global_step + 1  # gradients are held here: the peak of model state
        if self.zero_stage(trainer) is not None and (step % self.args.log_every == 0 or step == self.args.max_steps):
            reports = [None] * trainer.world_size
            dist.all_gather_object(reports, zp.memory_report(module, optimizer))
            self.reports = reports
            for report in reports:
                module.log(
                    f"mem_r{report['rank']}_MiB",
                    report["measured"]["total"] / 2**20,
                    prog_bar=True,
                    rank_zero_only=True,
                )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        totals = trainer.strategy.reduce(
            torch.tensor([float(outputs["loss"]), float(batch["attention_mask"].sum())], dtype=torch.float64),
            reduce_op="sum",
        )
        self.tokens += int(totals[1])
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.history.append(
            {"step": trainer.global_step, "loss": float(totals[0]) / trainer.world_size, "tokens": int(totals[1])}
        )
        module.log("tok/s", rate, prog_bar=True, rank_zero_only=True)

    def on_train_end(self, trainer, module):
        if self.zero_stage(trainer) is not None:
            self.comm = zp.comm_stats()


def main() -> None:
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)
    tokenizer = common.load_tokenizer(args)  # every process loads the same cached files
    rows = common.encode_all(common.load_records(args.data), tokenizer, args.max_length)
    loader = DataLoader(
        rows,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=common.Collator(tokenizer.pad_token_id),
    )
    module = LoRAModule(args, tokenizer)
    trainable, total = common.count_parameters(module)
    report = Report(tokenizer, args)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.grad_accum,
        gradient_clip_val=1.0,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        default_root_dir=args.output_dir,
        callbacks=[report],
        log_every_n_steps=args.log_every,
    )
    if trainer.is_global_zero:
        print(
            f"strategy={args.strategy!r} on {trainer.world_size} processes; {trainable:,} of {total:,} parameters "
            f"train (LoRA r={args.lora_r}); {len(rows)} examples"
        )
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started

    after = report.samples(trainer, module)  # still set up after fit: every rank
    trainer.save_checkpoint(os.path.join(args.output_dir, "last.ckpt"))  # collective
    state = zp.full_state_dict(module) if report.zero_stage(trainer) is not None else module.state_dict()
    adapter_dir = os.path.join(args.output_dir, "adapter")
    if trainer.is_global_zero:
        # The LightningModule's keys are the PeftModel's under "model."
        peft_state = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
        module.model.save_pretrained(adapter_dir, state_dict=peft_state)
        tokenizer.save_pretrained(adapter_dir)
        common.print_samples("After training:", after)
        reloaded = common.reload_adapter_samples(args, adapter_dir)
        common.print_samples(f"Adapter reloaded from {adapter_dir} onto a fresh base model:", reloaded)
        common.print_report(report.history, report.reports, report.comm, seconds, adapter_dir, trainer.global_step)
        common.write_json(
            os.path.join(args.output_dir, "metrics.json"),
            {
                "example": "lora_finetune_lightning",
                "strategy": args.strategy,
                "history": report.history,
                "losses": [h["loss"] for h in report.history],
                "seconds": seconds,
                "world_size": trainer.world_size,
                "trainable_params": trainable,
                "total_params": total,
                "samples_before": report.samples_before,
                "samples_after": after,
                "samples_reloaded": reloaded,
                "memory": report.reports,
                "comm": report.comm,
            },
        )
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()
