"""Which modules are stage-3 units, and which unit owns each parameter.

Default: one unit per instance of the model's ``_no_split_modules`` classes
(transformers decoder layers), found on the model or any submodule (PEFT
wraps the transformers model).  Parameters outside every unit, and
parameters shared by modules of different units (tied embedding and LM
head), belong to the root unit, which is gathered for the whole forward.

[Note: leaf units] Unless ``unit_policy`` decides, a module outside every block whose own parameters
hold at least ``LEAF_UNIT_MIN_NUMEL`` elements, none shared with another module, becomes a unit
of its own (an untied ``embed_tokens`` or ``lm_head``): it is gathered only around its own
forward and backward instead of for the whole step.  A 32k-vocabulary embedding is as large as
several decoder layers, so keeping it and the LM head in the root unit would hold them
unsharded through every layer's forward and backward.  Tied weights stay in the root unit.

[Note: frozen linear units] Unless ``unit_policy`` decides, an ``nn.Linear`` inside a block whose own
parameters are all frozen at setup, not shared, with at least ``2 x ZeroConfig.linear_slice_numel``
weight elements (the MLP projections of a multi-billion-parameter model under LoRA) becomes a unit of
its own, which the engine computes slice by slice ([Note: sliced linear units] in ``sliced.py``): the
block's unit then gathers only the rest (attention, norms, adapters), and the large frozen weights
are never whole in memory.  Memory per rank over step time: slices are gathered when used, not
prefetched (on CPU, where this matters most, a gather barely overlaps compute anyway).

[Note: persistent parameters] ``persistence_threshold`` > 0: every parameter with at most that many
elements (norm weights, biases) belongs to the root unit, whatever block it sits in.  Their shards
and optimizer state stay partitioned, but they are gathered once per step in one batched gather
(with the root, kept from forward into backward) instead of once per block per pass: fewer, larger
collectives for a memory cost of at most ``threshold`` elements per such parameter held unsharded
during the step (e.g. 2 norm weights x hidden per decoder layer).
"""

from __future__ import annotations

from torch import nn

from ..config import ZeroConfig
from .sliced import sliceable

__all__ = ["assign_units", "backward_reads_weights", "LEAF_UNIT_MIN_NUMEL"]

LEAF_UNIT_MIN_NUMEL = 1 << 20  # see [Note: leaf units]


def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if value:
            names.update(str(v) for v in value)
    return names


def _matcher(model: nn.Module, config: ZeroConfig):
    if config.stage3.unit_policy is not None:
        return config.stage3.unit_policy
    wanted = config.stage3.unit_classes or tuple(_no_split_names(model))
    types = tuple(c for c in wanted if isinstance(c, type))
    names = {c for c in wanted if isinstance(c, str)}

    def match(module: nn.Module, qualname: str) -> bool:
        cls = type(module)
        return isinstance(module, types) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return match


def assign_units(model: nn.Module, config: ZeroConfig) -> tuple[list[tuple[str, nn.Module]], dict[int, int]]:
    """Return the unit modules (index 0 is the root) and a map id(param) -> unit index."""
    match = _matcher(model, config)
    units: list[tuple[str, nn.Module]] = [("<root>", model)]
    unit_of_module: dict[int, int] = {id(model): 0}
    owner: dict[int, int] = {}

    def visit(module: nn.Module, prefix: str, current: int) -> None:
        for _pname, p in module.named_parameters(recurse=False):
            if p is None:
                continue
            previous = owner.get(id(p))
            owner[id(p)] = current if previous in (None, current) else 0
        for cname, child in module.named_children():
            qual = f"{prefix}.{cname}" if prefix else cname
            index = current
            if id(child) in unit_of_module:
                index = unit_of_module[id(child)]
            elif match(child, qual):
                units.append((qual, child))
                index = unit_of_module[id(child)] = len(units) - 1
            visit(child, qual, index)

    visit(model, "", 0)
    if config.stage3.unit_classes and len(units) == 1:
        _no_unit_matched(model, config.stage3.unit_classes)
    if config.stage3.unit_policy is None:  # the default blocks or unit_classes; a custom policy decides alone
        _split_leaf_units(model, units, owner)
        _split_frozen_linears(model, units, owner, config.stage3.linear_slice_numel)
    if config.stage3.persistence_threshold:
        for p in model.parameters():  # [Note: persistent parameters]
            if p.numel() <= config.stage3.persistence_threshold:
                owner[id(p)] = 0
    return units, owner


# [Note: weights unread in backward]
# An embedding's backward scatters the output gradient into the rows its indices name: it needs the indices
# and the number of rows, never the weight's values.  A unit that is exactly one plain ``nn.Embedding`` (an
# untied ``embed_tokens`` leaf unit, [Note: leaf units]) is therefore not gathered for backward: its gradient
# arrives while the unit is sharded, is accumulated into the full shape lent for it ([Note: uses outside the
# unit] in ``param.py``) and reduced as any other.  That saves the embedding's all-gather in every backward
# (its share of stage 3's 3Psi, and the host work of a gather of a vocabulary-sized tensor) where FSDP2 keeps
# it gathered through the step in its root group.  Only the exact class with the default forward, dense
# gradients and no ``max_norm`` (which rewrites rows in forward); a subclass, a PEFT wrapper or a unit holding
# anything more is gathered as before.  A backward that does read it (a recomputed forward under activation
# checkpointing, a direct read of its weight) gathers it on the way, as any unit.
def backward_reads_weights(module: nn.Module) -> bool:
    """Whether a unit on ``module`` needs its weights gathered for its backward ([Note: weights unread in
    backward])."""
    if type(module) is not nn.Embedding or module.sparse or module.max_norm is not None:
        return True
    return [name for name, _ in module.named_parameters()] != ["weight"]


def _no_unit_matched(model: nn.Module, wanted: tuple) -> None:
    """Explicit ``unit_classes`` that match no module would silently make the whole model one unit,
    gathered at once (no memory saved over stage 2): refuse, listing what the model has."""
    asked = sorted(c.__name__ if isinstance(c, type) else c for c in wanted)
    present = sorted({type(m).__name__ for m in model.modules() if m is not model})
    raise ValueError(
        f"zp.setup: ZeroConfig.unit_classes={asked} matches no module of {type(model).__name__}, so the whole "
        f"model would be one stage-3 unit, gathered at once; its module classes are {present}. Pass the "
        "repeated block's class (e.g. the decoder layer), or leave unit_classes empty to use the model's "
        "_no_split_modules"
    )


def _split_leaf_units(model: nn.Module, units: list[tuple[str, nn.Module]], owner: dict[int, int]) -> None:
    """Large root-owned modules become units of their own ([Note: leaf units]); one that is a PEFT tuner
    layer's ``base_layer`` brings the tuner layer along ([Note: tuner layers around a leaf])."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    inside = {id(m) for _, unit_module in units[1:] for m in unit_module.modules()}
    heads = {id(m) for _, m in units[1:]}
    wrapper_of = {
        id(m.base_layer): (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", None), nn.Module)
    }
    for name, module in model.named_modules():
        if module is model or id(module) in inside or any(id(m) in heads for m in module.modules()):
            continue
        own = [p for p in module.parameters(recurse=False) if p is not None]
        if not own or any(owner.get(id(p)) != 0 or users[id(p)] > 1 for p in own):
            continue
        if sum(p.numel() for p in own) < LEAF_UNIT_MIN_NUMEL:
            continue
        if id(module) in wrapper_of:
            name, module = wrapper_of[id(module)]
            own = [p for p in module.parameters() if owner.get(id(p)) == 0 and users[id(p)] == 1]
        units.append((name, module))
        inside.update(id(m) for m in module.modules())
        for p in own:
            owner[id(p)] = len(units) - 1


# [Note: tuner layers around a leaf]
# PEFT wraps a layer it adapts in a tuner layer holding it as ``base_layer`` (LoRA's ``Embedding`` / ``Linear``,
# ``TrainableTokensLayer`` for ``trainable_token_indices``), and the tuner's forward may read
# ``base_layer.weight`` itself instead of calling ``base_layer`` (``TrainableTokensLayer`` runs ``F.embedding``
# on it): a leaf unit on ``base_layer`` alone would never be gathered there.  So the tuner layer is the unit,
# with its adapter parameters (issue 37: ``trainable_token_indices`` on a 4096 x 256 embedding).


def _split_frozen_linears(
    model: nn.Module, units: list[tuple[str, nn.Module]], owner: dict[int, int], slice_numel: int
) -> None:
    """Large frozen linears inside blocks become units of their own ([Note: frozen linear units])."""
    if not slice_numel:
        return
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    heads = {id(m) for _, m in units}
    for name, module in model.named_modules():
        if id(module) in heads:
            continue
        own = [p for p in module.parameters(recurse=False) if p is not None]
        if not own or any(owner.get(id(p), 0) == 0 or users[id(p)] > 1 for p in own):
            continue  # outside every block (the root's or a leaf unit's business), or shared
        if isinstance(module, nn.Linear) and sliceable(module, own, slice_numel, module.weight.numel()):
            units.append((name, module))
            for p in own:
                owner[id(p)] = len(units) - 1
