"""Functions that run inside the ranks of ``tests/parity/test_fused_head.py``.

Module-level so the worker pool pickles them by reference.  ``build_model`` also builds the single-process
reference in the parent, so both sides start from the same weights.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from tests import models
from tests.parity.stage3_workers import train_loop

HIDDEN, VOCAB = models.REAL_HIDDEN, models.REAL_VOCAB  # the head: 2^20 elements, a leaf unit
CHUNK = 1000  # vocabulary rows per tile: 5 tiles whose edges never line up with the ranks' shards


class ChunkedLogProb(torch.autograd.Function):
    """Per-token log-probabilities of ``hidden @ weight.T`` tile by tile, recomputed in backward from the saved
    weight (the pattern of TRL's ``ChunkedLogProbFunction``, Liger and Cut Cross-Entropy): the weight is read in
    forward *and* in backward, outside any module's forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        log_z = torch.stack([torch.logsumexp(hidden @ w.t(), -1) for w in weight.split(CHUNK)], -1).logsumexp(-1)
        picked = (hidden * weight[targets]).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, log_z)
        return picked - log_z

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, log_z = ctx.saved_tensors
        grad_hidden = grad[:, None] * weight[targets]
        grad_weight = torch.zeros_like(weight).index_add_(0, targets, grad[:, None] * hidden)
        for start, w in zip(range(0, weight.shape[0], CHUNK), weight.split(CHUNK)):
            probs = torch.exp(hidden @ w.t() - log_z[:, None]) * -grad[:, None]
            grad_hidden += probs @ w
            grad_weight[start : start + w.shape[0]] += probs.t() @ hidden
        return grad_hidden, grad_weight, None


class DirectBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([DirectBlock(), DirectBlock()])
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class DirectHeadLM(nn.Module):
    """A float64 language model whose loss reads ``lm_head.weight`` outside ``lm_head.forward``, as TRL's fused
    head does: the backbone is ``base_model`` and the head ``get_output_embeddings()`` (the transformers names
    TRL and Liger look them up by).  ``chunked``: through ``ChunkedLogProb`` (weight read again in backward),
    else a plain ``hidden @ weight.T`` (autograd saves the weight)."""

    _no_split_modules = ["DirectBlock"]

    def __init__(self, tie: bool, chunked: bool) -> None:
        super().__init__()
        self.model = Backbone()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed.weight
        self.chunked = chunked

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        hidden = self.model(input_ids)[:, :-1].reshape(-1, HIDDEN)
        targets = labels[:, 1:].reshape(-1)
        weight = self.lm_head.weight
        if self.chunked:
            return -ChunkedLogProb.apply(hidden, weight, targets).mean()
        return F.cross_entropy(hidden @ weight.t(), targets)


def build_model(kind: str):
    """``direct`` / ``direct_tied`` (plain read), ``chunked`` / ``chunked_tied`` (float64, every weight trains);
    ``llama`` / ``llama_tied`` (a real-shaped transformers Llama with TRL's ``add_fused_lm_head``, every weight
    trains); ``lora`` (the same under PEFT LoRA on q/v: the head is frozen)."""
    from trl.trainer.utils import add_fused_lm_head

    base, tied = kind.split("_")[0], kind.endswith("_tied")
    if base in ("direct", "chunked"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            return DirectHeadLM(tie=tied, chunked=base == "chunked").to(torch.float64)
    model = models.make_real_llama(tie=tied)
    add_fused_lm_head(model)  # before PEFT, as TRL does
    if base == "llama":
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(2)
        model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B non-zero: the first step moves the loss
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def loss(model, batch):
    if isinstance(model, DirectHeadLM) or isinstance(getattr(model, "module", None), DirectHeadLM):
        return model(batch["input_ids"], batch["labels"])
    return model(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True).loss


def build_optimizer(model):
    return models.two_group_adamw(model)


def _counted_unshard(unit, unshard, gathers: list, *args, **kwargs):
    from zero_plugin.stage3.param import ShardedState

    if unit.state is ShardedState.SHARDED and not unit.gathering:  # a gather goes out (prefetch or on demand)
        gathers.append(unit.name)
    return unshard(*args, **kwargs)


def fused_head_worker(kind, batches, steps, accum, max_norm, slice_numel=0, stage=3) -> dict:
    """Train at stage 3; the LM head's whole gathers are counted (one per step: gathered at the end of the
    backbone, kept into backward)."""
    from zero_plugin.engines.engine import engine_of

    model = build_model(kind)
    config = zp.ZeroConfig(stage=stage, linear_slice_numel=slice_numel)
    model, opt = zp.setup(model, build_optimizer(model), config)
    engine = engine_of(model, "test")
    heads = [u for u in getattr(engine, "units", []) if u.name.endswith("lm_head")]
    gathers: list[str] = []
    for unit in heads:
        unit.unshard = functools.partial(_counted_unshard, unit, unit.unshard, gathers)
    out = train_loop(model, opt, batches, steps, accum, max_norm, loss_fn=loss)
    out["head_units"] = [(u.name, type(u).__name__) for u in heads]
    out["head_gathers"] = list(gathers)
    out["unsharded_units_after"] = [u.name for u in engine.unsharded_units()] if stage == 3 else []
    out["full_state_dict"] = zp.full_state_dict(model)
    return out


def teacher_read_worker(batches, slice_numel) -> dict:
    """An evaluation-only model at stage 3 run as TRL's distillation runs its teacher: the backbone alone under
    ``no_grad`` through the root (``_ForwardRedirection``), then ``get_output_embeddings().weight`` read after
    that forward returned ([Note: reads after a forward without grad] in zero_plugin/stage3/direct_reads.py)."""
    from trl.models.utils import _ForwardRedirection

    from zero_plugin.engines.engine import engine_of

    model = build_model("direct")
    model, _ = zp.setup(model, None, zp.ZeroConfig(stage=3, linear_slice_numel=slice_numel))
    engine = engine_of(model, "test")
    redirect = _ForwardRedirection()
    logits, held = [], []
    for batch in batches:
        with torch.no_grad():
            hidden = redirect(model, model, lambda m, ids: m.model(ids), model, batch["input_ids"])
        weight = model.get_output_embeddings().weight
        logits.append(hidden @ weight.t())
        held.append([u.name for u in engine.unsharded_units()])
    engine.runtime.forget_forward()  # the step's release point
    return {"logits": logits, "held": held, "after": [u.name for u in engine.unsharded_units()]}
