"""Rank workers of ``test_embedding_backward.py``: a real-shaped Llama (its untied 4096 x 256 ``embed_tokens`` a
stage-3 unit of its own) trained at stage 3, with the embedding unit's gathers counted."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import zero_plugin as zp
from tests import models
from tests.parity.stage3_workers import train_loop
from tests.unit.memory_comm_workers import collectives_layout
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.unit import GatherMode


def build_model(tie: bool = False, checkpointing: bool = False):
    """float64, one layer, every weight trains; ``checkpointing``: transformers' activation checkpointing of the
    layers."""
    model = models.make_real_llama(tie=tie, dtype=torch.float64, layers=1)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_optimizer(model):
    return models.two_group_adamw(model)


def loss(model, batch):
    """Next-token cross-entropy in float64 (transformers' own loss casts the logits to float32)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))


def embedding_worker(
    batches: list,
    steps: int,
    accum: int,
    max_norm: float,
    buffered: bool,
    tie: bool,
    checkpointing: bool,
    against_gathered: bool = False,
) -> dict:
    """Train at stage 3; every gather of the embedding's unit is recorded with whether a backward was running.
    ``against_gathered``: train the same again with the embedding gathered for backward as every other unit
    is (its unit's ``backward_reads_weights`` set, on that engine only), and say whether every full parameter
    came out bit for bit the same."""
    out = _train(batches, steps, accum, max_norm, buffered, tie, checkpointing, gathered=False)
    if against_gathered:
        other = _train(batches, steps, accum, max_norm, buffered, tie, checkpointing, gathered=True)
        mine, theirs = out["full_state_dict"], other["full_state_dict"]
        out["equal_to_gathered"] = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        out["gathered_embed_gathers"] = other["embed_gathers"]
    return out


def _train(batches, steps, accum, max_norm, buffered, tie, checkpointing, gathered: bool) -> dict:
    model = build_model(tie, checkpointing)
    with collectives_layout(buffered):
        model, opt = zp.setup(model, build_optimizer(model), zp.ZeroConfig(stage=3))
    engine = engine_of(model, "test")
    embeds = [u for u in engine.units if u.name.endswith("embed_tokens")]
    out_units = [(u.name, u.backward_reads_weights) for u in embeds]
    if gathered:
        for unit in embeds:  # the control: the same unit gathered for backward as any other
            unit.spec = dataclasses.replace(unit.spec, backward_reads_weights=True)
    gathers: list[str] = []
    for unit in embeds:
        unshard = unit.unshard

        def counted(mode=GatherMode.ON_DEMAND, _unit=unit, _unshard=unshard):
            if not _unit.holds_gathered:  # a gather goes out
                gathers.append("backward" if torch._C._current_graph_task_id() != -1 else "forward")
            return _unshard(mode)

        unit.unshard = counted
    out = train_loop(model, opt, batches, steps, accum, max_norm, loss_fn=loss)
    out["embed_units"] = out_units
    out["embed_gathers"] = gathers
    out["unsharded_units_after"] = [u.name for u in engine.unsharded_units()]
    out["full_state_dict"] = zp.full_state_dict(model)
    return out
