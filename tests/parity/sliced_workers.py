"""Functions that run inside the ranks of ``tests/parity/test_parity_sliced.py``.

Module-level so the worker pool pickles them by reference.  ``build_model`` also builds the
single-process reference in the parent, so both sides start from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from tests import models
from tests.parity.stage3_workers import train_loop

SLICE_NUMEL = 100  # tiny slices: the heads below are 1455-3880 elements, 15-40 rows wide -> 6-17 slices
VOCAB = 97  # odd: rows and flat shards of the head never align with the ranks' shards


class HeadMLP(nn.Module):
    """float64 OddMLP blocks and a wide output layer with a bias; ``tie``: an embedding shares its weight."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.body = models.make_odd_mlp()
        self.head = nn.Linear(models.MLP_OUT, VOCAB, dtype=torch.float64)
        self.embed = nn.Embedding(VOCAB, models.MLP_OUT, dtype=torch.float64) if tie else None
        if tie:
            self.embed.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.embed is not None:  # ids drawn from the input, as a tied embedding's would be
            h = h + 0.1 * self.embed((x[:, 0].abs() * 10).long() % VOCAB)
        return self.head(h)


def head_units(module: nn.Module, qualname: str) -> bool:
    """Decoder layers / OddBlocks, and the output layer, are units (tiny models sit below the leaf size)."""
    return type(module).__name__ in ("OddBlock", "LlamaDecoderLayer") or qualname.split(".")[-1] in ("head", "lm_head")


def head_and_embedding_units(module: nn.Module, qualname: str) -> bool:
    """``head_units`` and the input embedding, as the default policy makes a large untied one ([Note: leaf units])."""
    return head_units(module, qualname) or qualname.split(".")[-1] == "embed_tokens"


POLICIES = {"head": head_units, "head_embed": head_and_embedding_units, "default": None}


def build_model(kind: str, trainable_head: bool):
    """kind: ``mlp`` / ``mlp_tied`` (float64), ``llama`` / ``llama_tied`` (every weight trains but the head),
    ``lora`` / ``lora_tied`` (PEFT LoRA on q/v: the head is frozen anyway)."""
    base, tied = kind.split("_")[0], kind.endswith("_tied")
    if base == "mlp":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = HeadMLP(tie=tied)
        head = model.head
    elif base == "llama":
        model = models.make_tiny_llama(tie=tied, layers=2)
        head = model.lm_head
    else:
        model = models.make_tiny_llama_lora(tie=tied, layers=2)
        head = model.base_model.model.lm_head
    if not trainable_head and not tied:
        head.requires_grad_(False)
    return model


def batch_kind(kind: str) -> str:
    return "mlp" if kind.startswith("mlp") else "llama"


def loss(model, batch):
    if isinstance(batch, dict):
        return model(**batch).loss
    x, target = batch
    return F.cross_entropy(model(x), target.argmax(-1) % VOCAB)


def build_optimizer(model):
    return models.two_group_adamw(model)


def sliced_worker(
    kind, trainable_head, batches, steps, accum, max_norm, slice_numel, buffered=False, policy="head"
) -> dict:
    """``policy``: a key of ``POLICIES``; ``default`` is the default unit choice (decoder layers, [Note: frozen
    linear units])."""
    from tests.unit.memory_comm_workers import collectives_layout
    from zero_plugin.engines.engine import engine_of
    from zero_plugin.stage3.sliced import SlicedUnit

    model = build_model(kind, trainable_head)
    config = zp.ZeroConfig(stage=3, unit_policy=POLICIES[policy], linear_slice_numel=slice_numel)
    with collectives_layout(buffered):
        model, opt = zp.setup(model, build_optimizer(model), config)
        engine = engine_of(model, "test")
        sliced = [u for u in engine.units if isinstance(u, SlicedUnit)]
        whole_gathers = []
        for unit in sliced:  # the runtime must never gather a sliced unit whole
            unit.unshard = lambda *a, _u=unit, _f=unit.unshard, **k: (whole_gathers.append(_u.name), _f(*a, **k))[1]
        out = train_loop(model, opt, batches, steps, accum, max_norm, loss_fn=loss)
        out["sliced"] = [(u.name, len(u.slices)) for u in sliced]
        out["whole_gathers"] = whole_gathers
        out["unsharded_units_after"] = [u.name for u in engine.unsharded_units()]
        out["full_state_dict"] = zp.full_state_dict(model)
        out["eval_logits"] = _eval_logits(model, batches[0])
    return out


@torch.no_grad()
def _eval_logits(model, batch) -> torch.Tensor:
    """Outputs under no_grad after training: the forward-only path of a sliced unit."""
    if isinstance(batch, dict):
        return model(input_ids=batch["input_ids"]).logits
    return model(batch[0])
