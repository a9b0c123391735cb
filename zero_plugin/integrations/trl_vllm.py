"""TRL's weight sync to vLLM (GRPO, RLOO) at stage 3.

[Note: vLLM weight sync at stage 3]
TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` push the policy's weights to vLLM before generating, through
``VLLMGeneration.sync_weights`` (``trl/generation/vllm_generation.py``), which reads them from
``VLLMGeneration._iter_named_params``.  That method gathers only under DeepSpeed ZeRO-3
(``trl.distributed.DistributedBackend.gather_params``) or FSDP; any other model yields ``param.data`` as it
is: at stage 3 a 1-D shard under the full name (vLLM gets shards), and with PEFT ``merge_adapter`` fails on
the shards ("inconsistent tensor size").  Under ZeRO-3 TRL gathers a PEFT model whole to merge it.

:func:`install` replaces that method: a model set up at stage 3 is walked one *gather group* at a time, a
group being a unit, or several units joined by a PEFT tuner layer that has parameters in each (a LoRA base
projection that is a sliced unit of its own, [Note: frozen linear units] in ``stage3/policy.py``, and its
adapters in the block's unit).  Per group: ``zp.gathered_parameters`` (no modifier rank, so the shards are
untouched whatever the merge leaves), its tuner layers merged as ``merge_adapter`` merges them, its
parameters yielded under the names TRL gives vLLM, the layers unmerged, the group released.  Peak: one group
above the shards.  Every rank walks the same groups (each gather is collective), as TRL's ranks other than
the main one iterate without pushing.  Any other model (stages 0-2, no ``zp.setup``) takes TRL's own path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin import upstream
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.engine import Stage3Engine

__all__ = ["install"]

_ORIGINAL: dict[str, Any] = {}


@dataclasses.dataclass
class _GatherGroup:
    """What one gather covers: its named parameters (``named_parameters`` order) and its tuner layers."""

    named: list[tuple[str, nn.Parameter]] = dataclasses.field(default_factory=list)
    tuner_layers: list[nn.Module] = dataclasses.field(default_factory=list)


def install() -> None:
    """Patch ``VLLMGeneration._iter_named_params`` (idempotent); called by ``zero_plugin.run`` once
    ``trl.generation.vllm_generation`` is imported."""
    from trl.generation.vllm_generation import VLLMGeneration

    if "iter_named_params" in _ORIGINAL:
        return
    upstream.check("trl.generation.vllm_generation.VLLMGeneration", VLLMGeneration)  # [Note: patched upstream names]
    _ORIGINAL["iter_named_params"] = VLLMGeneration._iter_named_params
    VLLMGeneration._iter_named_params = _iter_named_params


def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
    engine = _stage3_engine(self.model)
    if engine is None:
        yield from _ORIGINAL["iter_named_params"](self)
        return
    model = self.model
    peft = _is_peft(model)
    if peft:
        model.base_model._check_merge_allowed()  # what merge_adapter checks first
    for group in gather_groups(model, engine.unit_of, _tuner_layers(model) if peft else []):
        params = [p for _, p in group.named] + [p for layer in group.tuner_layers for p in layer.parameters()]
        with zp.gathered_parameters(params, model=model):
            with torch.no_grad():
                for layer in group.tuner_layers:
                    layer.merge()
            try:
                for name, param in group.named:
                    vllm_name = _vllm_name(self, model, name, peft)
                    if vllm_name is not None:
                        yield vllm_name, param.data
            finally:
                for layer in group.tuner_layers:
                    layer.unmerge()


def gather_groups(model: nn.Module, unit_of: dict[int, Any], layers: list[nn.Module]) -> list[_GatherGroup]:
    """The model's named parameters and tuner layers by gather group ([Note: vLLM weight sync at stage 3]),
    groups in the order of their first parameter; parameters outside every unit (replicated) form one group."""
    parent: dict[int, int] = {}

    def root(index: int) -> int:
        while parent.setdefault(index, index) != index:
            index = parent[index]
        return index

    def key(param: nn.Parameter) -> int | None:
        unit = unit_of.get(id(param))
        return None if unit is None else root(unit.index)

    for layer in layers:
        indices = [unit_of[id(p)].index for p in layer.parameters() if id(p) in unit_of]
        for index in indices[1:]:
            parent[root(index)] = root(indices[0])
    groups: dict[int | None, _GatherGroup] = {}
    for name, param in model.named_parameters():
        groups.setdefault(key(param), _GatherGroup()).named.append((name, param))
    for layer in layers:
        keys = [key(p) for p in layer.parameters()]
        owner = next((k for k in keys if k is not None), None)
        groups.setdefault(owner, _GatherGroup()).tuner_layers.append(layer)
    return list(groups.values())


def _vllm_name(generation: Any, model: nn.Module, name: str, peft: bool) -> str | None:
    """The name TRL's ``_iter_named_params`` gives vLLM, None for what it skips (adapters, merged already;
    the original of a ``modules_to_save`` copy)."""
    if not peft:
        return generation._fix_param_name_to_vllm(name)
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if model.prefix in name or "original_module" in name:
        return None
    return generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])


def _stage3_engine(model: nn.Module) -> Stage3Engine | None:
    try:
        engine = engine_of(model, "vLLM weight sync")
    except ValueError:  # not set up by zp.setup
        return None
    return engine if isinstance(engine, Stage3Engine) else None


def _is_peft(model: nn.Module) -> bool:
    from accelerate.utils import is_peft_model  # what TRL asks

    return is_peft_model(model)


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
