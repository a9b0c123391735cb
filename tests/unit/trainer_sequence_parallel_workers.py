"""Functions that run inside the ranks of ``tests/unit/test_trainer_sequence_parallel.py``: the HF Trainer's
``compute_loss`` under sequence parallelism (K = 2 on 2 ranks) driven as ``Trainer.training_step`` drives it, on a
real-shaped float64 Llama ([Note: the Trainer's tiled loss] in ``zero_plugin/integrations/hf_trainer.py``), and the
same steps on one process on the whole sequences.  Module-level so the worker pool pickles them by reference."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import zero_plugin as zp
from tests import models
from zero_plugin.engines.engine import engine_of
from zero_plugin.integrations import hf_trainer
from zero_plugin.sequence.batch import expect_batch

K, STEPS, ACCUMULATION, BATCH, SEQ, LR = 2, 2, 2, 2, 16, 0.5
TILE_TOKENS = 5  # each rank's 2 x 8 tokens: tiles that straddle rows and a last short one


def make_model(tie: bool, lora: bool = False):
    model = models.make_real_llama(seed=0, tie=tie, dtype=torch.float64)
    model.set_attn_implementation("sdpa")  # eager's float32 softmax would differ at 1e-7 between the layouts
    if lora:  # the head frozen
        model = models.add_lora(model, seed=1, scale=0.05)
    return model


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_batches() -> list[list[dict]]:
    """``STEPS`` x ``ACCUMULATION`` micro-batches; a fifth of the labels and one row's first half are -100."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(ACCUMULATION):
            ids = torch.randint(0, models.REAL_VOCAB, (BATCH, SEQ), generator=gen)
            labels = ids.clone()
            labels[torch.rand(BATCH, SEQ, generator=gen) < 0.2] = -100
            labels[0, : SEQ // 2] = -100
            step.append({"input_ids": ids, "labels": labels})
        out.append(step)
    return out


class _Trainer:
    """The parts of a ``transformers.Trainer`` that its (installed) ``compute_loss`` and count read."""

    compute_loss = hf_trainer.compute_loss

    def __init__(self, world: int) -> None:
        self.args = SimpleNamespace(average_tokens_across_devices=True, world_size=world)
        self.model_accepts_loss_kwargs, self.compute_loss_func, self.label_smoother = True, None, None
        self.accelerator = SimpleNamespace(num_processes=world, gather=_all_gather)


def _all_gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


class _VocabRows(TorchDispatchMode):
    """The most rows of any tensor an op returns whose last dimension is the vocabulary (the logits or a tile),
    other than the head's weight transposed (``[hidden, vocab]``, its matmuls' operand and gradient)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.weight_numel, self.rows = vocab, vocab * hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.shape[-1] == self.vocab
                and t.numel() != self.weight_numel
            ):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def train_worker(
    stage: int,
    tie: bool,
    tiled: bool,
    lora: bool = False,
    checkpointing: bool = False,
    slice_numel: int = 1 << 22,
    counted: bool = True,
) -> dict:
    """``STEPS`` optimizer steps of ``ACCUMULATION`` micro-batches each, as ``Trainer.training_step`` runs them
    (count over the step's split micro-batches, ``compute_loss`` with it, backward): each micro-batch's loss on
    this rank, the most tokens the LM head module ran on, the most vocabulary rows of a tensor during the loss and
    its backward, the stage-3 units computed in slices, and the full parameters after training.  ``tiled=False``:
    the untiled loss on the logits (the Trainer's for a head it cannot tile)."""
    model = make_model(tie, lora)
    if checkpointing:  # backward recomputes the backbone's layers (and their exchanges), not the tiled loss
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    config = zp.ZeroConfig(stage=stage, sequence_parallel_size=K, linear_slice_numel=slice_numel)
    model, opt = zp.setup(model, torch.optim.SGD(trainable(model), lr=LR), config)
    trainer = _Trainer(dist.get_world_size())
    trainer.model_accepts_loss_kwargs = counted  # else no num_items_in_batch: the loss is each micro-batch's mean
    head = (model.get_base_model() if lora else model).lm_head
    head_tokens = []
    handle = head.register_forward_hook(lambda m, args, out: head_tokens.append(args[0].shape[:-1].numel()))
    vocab_rows = _VocabRows(models.REAL_VOCAB, models.REAL_HIDDEN)
    patches = [
        mock.patch.object(hf_trainer, "_sequence_parallel_size", lambda trainer: K),
        mock.patch.object(hf_trainer, "LOSS_TILE_TOKENS", TILE_TOKENS),
    ]
    if not tiled:
        patches.append(mock.patch.object(hf_trainer, "tiled_head", lambda model: None))
    losses = []
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        assert (hf_trainer.tiled_head(model) is not None) == tiled
        for step in make_batches():
            micro = list(zp.SequenceParallelLoader(step, model))
            count = hf_trainer._get_num_items_in_batch(trainer, micro, torch.device("cpu"))
            for inputs in micro:
                expect_batch(inputs, model)
                with vocab_rows:
                    loss = trainer.compute_loss(model, inputs, num_items_in_batch=count)
                    (loss if counted else loss / ACCUMULATION).backward()  # as Trainer.training_step
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    handle.remove()
    full = zp.full_state_dict(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    units = getattr(engine_of(model, "test"), "units", [])
    return {
        "sliced_units": [u.name for u in units if getattr(u, "gathers_on_read", False)],
        "losses": losses,
        "head_tokens": max(head_tokens),
        "vocab_rows": vocab_rows.rows,
        "params": {n: t for n, t in full.items() if n in names},
    }


def reference(tie: bool, lora: bool = False, counted: bool = True) -> dict:
    """One process on the whole sequences: per step the sum over its micro-batches of the token losses over the
    step's count of labels (what K = 1 and DDP compute with ``num_items_in_batch``), each micro-batch's share; not
    ``counted``: each micro-batch's mean, backward over the accumulation steps."""
    model = make_model(tie, lora)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(trainable(model), lr=LR)
    losses = []
    with models.ranks_threads():
        for step in make_batches():
            shifted = [F.pad(b["labels"][:, 1:], (0, 1), value=-100) for b in step]
            count = sum((s != -100).sum() for s in shifted)
            for batch, labels in zip(step, shifted):
                logits = model(input_ids=batch["input_ids"]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                loss = loss / (count if counted else (labels != -100).sum())
                (loss if counted else loss / ACCUMULATION).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "theta0": theta0, "params": params}
