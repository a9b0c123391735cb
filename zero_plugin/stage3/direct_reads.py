"""Stage 3: an output embedding (LM head) whose weight a loss reads directly, outside the head's forward.

[Note: direct reads of the output embedding]
TRL's trainers (``trl.trainer.utils.add_fused_lm_head``: SFT, DPO, GRPO, RLOO, KTO, distillation), Liger's
fused linear cross-entropy and Cut Cross-Entropy never call the LM head: inside the model's forward they run
the backbone (``model.base_model``, the transformers name), then hand ``model.get_output_embeddings().weight``
to a kernel that computes the loss tile by tile, saves the weight and reads it again in backward to recompute
the tiles.  A head that is a stage-3 unit of its own (an untied head of at least 2^20 elements, [Note: leaf
units] in ``policy.py``) holds only this rank's 1-D shard there, since its forward hooks never fire
(``RuntimeError: mat2 must be a matrix``).  DeepSpeed users get TRL's ``GatheredParameters`` around the read,
FSDP2 users ``DTensor.full_tensor()``; ours change nothing, because the runtime treats the end of the backbone's
forward as the head's entry:
  * forward: a forward hook on the backbone enters the head's unit there (``Stage3Runtime.pre_direct_read``):
    recorded in the forward order, checked with the peers, gathered, prefetched on the next step like any
    unit.  A sliced head ([Note: sliced linear units] in ``sliced.py``) is only armed there: the plain path
    computes it slice by slice as before, and a read of its ``weight`` (or ``bias``) before its own forward
    gathers it whole (``watch_reads``: the kernel takes the whole weight).
    It is then the last unit of the recorded order, so a forward with grad keeps it into backward ([Note: last
    unit kept] in ``hooks.py``); a forward without grad releases it at the end of the root's forward.  Where
    the head's own forward then runs (the plain path, ``generate``), it finds the unit gathered: nothing more
    is gathered than before;
  * backward: the backbone's outputs (the head's inputs) are wrapped in the post-backward identity, whose
    backward runs once their gradients are complete, i.e. after every kernel that read the weight from them
    computed its backward (autograd accumulates the weight's gradient first: leaf accumulation runs ahead of
    other ready nodes).  Each forward with grad opens one read (``DirectReads``) and the identity closes it;
    the unit's post-backward (released once its reduction is launched, or at once if it trains nothing) comes
    with the last read closed, so two forwards before one backward keep the head until both backwards ran.
    A trainable head's full gradient reaches its owners by the unit's ordinary reduce-scatter (the
    post-accumulate hook sees a full-shape gradient, as from its own forward).
Memory: the head is held whole exactly where its own forward would hold it (from the end of the backbone
into backward, released after its backward), so ``memory_report`` and the planner's replay of the plain
forward stand; a frozen head above ``2 x linear_slice_numel`` (a sliced unit) is the exception: held whole
for the read instead of one slice at a time.  Tied heads are in the root unit, gathered for the whole forward
and into backward: nothing to do.

[Note: reads after a forward without grad]
TRL's distillation runs the teacher (an evaluation-only model, or one that trains nothing) under ``no_grad``
through its backbone only, and its loss reads ``teacher.get_output_embeddings().weight`` after that forward
returned.  So a forward without grad keeps the head it entered at the backbone's end gathered past the end of
the forward (``Stage3Runtime._held_for_read``; a sliced head stays armed, and the read gathers it whole), until
the model's next forward, the optimizer step or a write to the shards releases it (a local release, no
collective).  Memory: one head unsharded between the teacher's forwards, as during its forward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .unit import Unit

__all__ = ["DirectReads", "output_embedding_backbones", "watch_reads"]


def output_embedding_backbones(model: nn.Module, units: list[Unit]) -> list[tuple[nn.Module, Unit]]:
    """``(backbone, head unit)`` for every module of ``model`` with ``get_output_embeddings()`` and
    ``base_model`` (transformers' causal-LM classes, and anything that names them the same way) whose output
    embedding is a unit of its own, or whose ``weight`` is a unit's (a wrapper around the head), and whose
    backbone does not contain it (so not a PEFT wrapper, whose ``base_model`` wraps the whole model)."""
    unit_of = {id(unit.module): unit for unit in units[1:]}
    unit_of_weight = {
        id(w): unit for unit in units[1:] if isinstance(w := getattr(unit.module, "weight", None), nn.Parameter)
    }
    found: dict[int, tuple[nn.Module, Unit]] = {}
    for module in model.modules():
        head = _output_embeddings(module)
        backbone = getattr(module, "base_model", None)
        if head is None or not isinstance(backbone, nn.Module) or backbone is module:
            continue
        unit = unit_of.get(id(head)) or unit_of_weight.get(id(_weight(head)))
        if unit is None or any(m is head for m in backbone.modules()):
            continue
        found.setdefault(id(backbone), (backbone, unit))
    return list(found.values())


def _weight(head: nn.Module):
    """The weight a read of ``head.weight`` gets: a wrapper's (PEFT's ``ModulesToSaveWrapper`` around the LM head
    under ``modules_to_save``: its active copy's) as well as a plain head's."""
    try:
        return head.weight
    except AttributeError:
        return None


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    getter = getattr(type(module), "get_output_embeddings", None)  # the class's: PEFT forwards unknown names
    if getter is None:
        return None
    try:
        head = getter(module)
    except (AttributeError, NotImplementedError):  # transformers models without a head
        return None
    return head if isinstance(head, nn.Module) else None


# [Note: watching weight reads]
# A sliced head ([Note: sliced linear units] in ``sliced.py``) must see a loss read ``head.weight`` outside its
# forward.  torch has no hook for that: module hooks fire on calls, tensor hooks in backward, and
# ``__torch_function__`` only once the tensor is used (too late: the kernel would get the 1-D shard).  A read of a
# parameter goes through ``nn.Module.__getattr__`` (parameters live in ``_parameters``), but special lookup finds
# ``__getattr__`` and properties on the type, not on the instance, so this one instance gets a subclass with
# properties for ``weight`` and ``bias``, as ``torch.nn.utils.parametrize`` does for the same reason (it too needs
# ``module.weight`` to run code on each read).  The subclass keeps the class's name and module, so ``repr``,
# ``isinstance`` and checks by class name (``_no_split_modules``) hold; only ``type(m) is cls`` does not.  The
# handle's ``remove()`` (from ``Stage3Runtime.remove``) restores the original class.
def watch_reads(module: nn.Module, on_read) -> _Watched:
    """Call ``on_read()`` whenever ``module.weight`` or ``module.bias`` is read, by giving this one instance a
    subclass with properties for them ([Note: watching weight reads]); the returned handle's ``remove()``
    restores the class.  Only for sliced heads: [Note: direct reads of the output embedding]."""
    cls = type(module)
    names = {name: property(functools.partial(_read, name, on_read)) for name in ("weight", "bias")}
    module.__class__ = type(cls.__name__, (cls,), {**names, "__module__": cls.__module__})
    return _Watched(module, cls)


def _read(name: str, on_read, module: nn.Module):
    on_read()
    return module._parameters[name]


class _Watched:
    def __init__(self, module: nn.Module, cls: type) -> None:
        self.module, self.cls = module, cls

    def remove(self) -> None:
        self.module.__class__ = self.cls


class DirectReads:
    """The reads still open per head unit: opened by a forward with grad, closed when the backward through
    the head's inputs ran ([Note: direct reads of the output embedding])."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}

    def open(self, unit: Unit) -> None:
        self._open[unit.index] = self._open.get(unit.index, 0) + 1

    def close(self, unit: Unit) -> bool:
        """True when this was the unit's last open read."""
        left = self._open.get(unit.index, 0) - 1
        if left > 0:
            self._open[unit.index] = left
            return False
        self._open.pop(unit.index, None)
        return True

    def is_open(self, unit: Unit) -> bool:
        return unit.index in self._open

    def clear(self) -> None:
        """End of backward: a read whose backward never reached the head's inputs is over too."""
        self._open.clear()
