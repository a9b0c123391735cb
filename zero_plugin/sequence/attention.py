"""The Ulysses attention: a transformers ``AttentionInterface`` function that runs the model's own attention
(sdpa, eager, flash) on the whole sequence for 1/K of the heads.

[Note: Ulysses attention]
A decoder layer computes q, k, v (rotary applied at the tokens' global positions, which the batch split passed
as ``position_ids``) for this rank's 1/K of the sequence.  The wrapper exchanges them ([Note: Ulysses exchange] in
``exchange.py``) into the whole sequence for this rank's H/K query heads and the key/value heads those use, runs
the original attention there with causality over the whole sequence (``attention_mask=None`` with the module's
``is_causal`` for sdpa and flash; eager gets an explicit causal mask: it has no causal flag), and exchanges the
output ``[batch, seq, H/K, head_dim]`` back into ``[batch, seq/K, H, head_dim]``, which the layer's ``o_proj``
reads as if nothing happened.  Every rank of the group must run every layer's attention together.

GQA: query head h uses key/value head h // G (G = H / H_kv).  When K divides H_kv, rank r's query heads
[r H/K, (r+1) H/K) use exactly the key/value heads [r H_kv/K, (r+1) H_kv/K), so k and v are split like q.  When it
does not, each key/value head is first repeated R = K / gcd(H_kv, K) times (``repeat_interleave``; its backward
sums the copies' gradients): H_kv R = lcm(H_kv, K) heads, a multiple of K and a divisor of H, so each rank again
gets whole heads, now with G' = H / (H_kv R) query heads each, which the original attention is told through the
module it receives (``_HeadGroups``).  H must be a multiple of K; a model where it is not is refused at setup.

What the wrapper cannot do is refused where it is seen: a padding or custom mask (the layer would get one shaped
for 1/K of the sequence), a KV cache (generation: keys longer than the queries), sliding-window attention, an
encoder's non-causal attention, flex or paged attention.  The model's masks are not built at all (the wrapper's
name is not one of ``AttentionMaskInterface``'s, so ``create_causal_mask`` returns None).
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import torch
from torch import nn

from .exchange import exchange

__all__ = ["ATTENTION_NAME", "check_model", "switch_attention", "switch_back", "ulysses_attention"]

ATTENTION_NAME = "zero_plugin_ulysses"
"""The name the wrapper is registered under in transformers' ``AttentionInterface``."""

_WRAPPABLE = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# id(config) -> (weak reference to the config, SequenceParallel): configs are not hashable (transformers compares
# them by value), and the attention modules reach theirs as ``module.config``.
_BY_CONFIG: dict[int, tuple[Any, Any]] = {}


def check_model(model: nn.Module, k: int) -> tuple[nn.Module, str]:
    """The transformers model inside ``model`` (PEFT-wrapped or not) and its attention implementation, or
    ``ValueError`` naming what stops sequence parallelism over ``k`` ranks."""
    pretrained = next((m for m in model.modules() if hasattr(m, "set_attn_implementation")), None)
    if pretrained is None:
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={k} needs a transformers model (a PreTrainedModel with "
            f"set_attn_implementation) inside {type(model).__name__}: its attention is what the Ulysses all-to-all "
            "wraps; set sequence_parallel_size=1 for other models"
        )
    config = pretrained.config
    original = config._attn_implementation
    if original == ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} is already set up for sequence parallelism; call zp.setup once")
    if original not in _WRAPPABLE:
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={k}: attn_implementation={original!r} cannot run under the Ulysses "
            f"wrapper; load the model with attn_implementation one of {', '.join(_WRAPPABLE)}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % k:
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={k} must divide the model's num_attention_heads={heads!r} (each "
            f"rank runs attention for 1/{k} of the heads); pick a sequence_parallel_size that divides it"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={k}: sliding-window attention (sliding_window="
            f"{config.sliding_window}) is not supported by the Ulysses wrapper, which masks causally only"
        )
    return pretrained, original


def switch_attention(pretrained: nn.Module, setting: Any) -> None:
    """Register the wrapper (once per process) and point every config of ``pretrained`` at it, remembering the
    ``setting`` each config's attention modules run under."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    pretrained.set_attn_implementation(ATTENTION_NAME)
    for module in pretrained.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation") and id(config) not in _BY_CONFIG:  # a transformers config
            key = id(config)
            _BY_CONFIG[key] = (weakref.ref(config, lambda _, key=key: _BY_CONFIG.pop(key, None)), setting)


def switch_back(pretrained: nn.Module, original: str) -> None:
    """Undo :func:`switch_attention`: ``pretrained`` runs ``original`` again and its configs forget their setting
    (the memory planner's trace switches a model for one forward + backward)."""
    pretrained.set_attn_implementation(original)
    for module in pretrained.modules():
        _BY_CONFIG.pop(id(getattr(module, "config", None)), None)


def _setting_of(module: nn.Module) -> Any:
    entry = _BY_CONFIG.get(id(getattr(module, "config", None)))
    if entry is None or entry[0]() is not module.config:
        raise ValueError(
            f"{type(module).__name__} runs attn_implementation={ATTENTION_NAME!r} but was not set up by zp.setup "
            "with ZeroConfig(sequence_parallel_size=K); set it up, or load the model with its own attention"
        )
    return entry[1]


class _HeadGroups:
    """The attention module as the original attention sees it after the key/value heads were repeated: the same
    module with ``num_key_value_groups`` G' ([Note: Ulysses attention])."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _kv_repeats(kv_heads: int, k: int) -> int:
    """R: how many times each key/value head is repeated so that K ranks get whole heads ([Note: Ulysses
    attention])."""
    return k // math.gcd(kv_heads, k)


def _original_function(module: nn.Module, name: str):
    if name == "eager":
        found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if found is None:
            raise ValueError(
                f"{type(module).__name__}'s modeling file has no eager_attention_forward for the Ulysses wrapper to "
                "run; load the model with attn_implementation='sdpa'"
            )
        return found
    from transformers import AttentionInterface

    return AttentionInterface()[name]


def _causal_mask(query: torch.Tensor) -> torch.Tensor:
    """The additive causal mask of transformers' eager attention over the whole sequence, ``[1, 1, s, s]``."""
    s = query.shape[2]
    future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
    mask = torch.zeros(s, s, dtype=query.dtype, device=query.device).masked_fill(future, torch.finfo(query.dtype).min)
    return mask.view(1, 1, s, s)


def _refuse_unsupported(module: nn.Module, query, key, attention_mask, kwargs: dict) -> None:
    if attention_mask is not None:
        raise ValueError(
            "sequence parallelism: the attention got a mask; the Ulysses wrapper masks causally over the whole "
            "sequence only (no padding or custom masks): pass no attention_mask (zp.sequence_parallel_batch "
            "drops an all-ones one and refuses padding)"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"sequence parallelism: keys of length {key.shape[2]} for queries of length {query.shape[2]} (a KV "
            "cache, as in generate()) are not supported by the Ulysses wrapper; generate inside "
            "`with zp.sequence_parallel_of(model).paused():`"
        )
    if kwargs.get("sliding_window") is not None or not getattr(module, "is_causal", True):
        raise ValueError(
            f"sequence parallelism: {type(module).__name__} asks for sliding-window or non-causal attention, which "
            "the Ulysses wrapper does not do (causal over the whole sequence only)"
        )


def _check_split(setting: Any, query: torch.Tensor) -> None:
    """[Note: unsplit batches]
    A batch that did not go through ``zp.sequence_parallel_batch`` (a loop that does not know about sequence
    parallelism: the HF Trainer, TRL, Accelerate today) holds whole sequences, different on each rank; exchanged as
    if they were slices they would train on garbage without an error.  So the queries' (batch, length) must be the
    last split's, or the attention refuses."""
    seen, split = (query.shape[0], query.shape[2]), setting.split.get("shape")
    if seen != split:
        raise ValueError(
            f"sequence parallelism: the attention got {seen[0]} x {seen[1]} tokens per rank, but the last "
            f"zp.sequence_parallel_batch gave {'none' if split is None else ' x '.join(map(str, split))}: pass every "
            "batch through zp.sequence_parallel_batch / zp.SequenceParallelLoader (the HF Trainer, TRL and "
            "Accelerate loops do not split batches yet), or run whole sequences inside "
            "`with zp.sequence_parallel_of(model).paused():`"
        )


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """[Note: Ulysses attention]: ``query`` ``[b, H, s/K, d]``, ``key`` / ``value`` ``[b, H_kv, s/K, d]`` of this
    rank's slice in, ``[b, s/K, H, d]`` out; collective over the module's sequence-parallel group."""
    setting = _setting_of(module)
    _refuse_unsupported(module, query, key, attention_mask, kwargs)
    _check_split(setting, query)
    comm, heads, kv_heads = setting.comm, query.shape[1], key.shape[1]
    repeats = _kv_repeats(kv_heads, comm.world_size)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    groups = heads // (kv_heads * repeats)
    seen = module if groups == getattr(module, "num_key_value_groups", groups) else _HeadGroups(module, groups)
    query, key, value = (exchange(t, comm, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    mask = _causal_mask(query) if setting.original_attention == "eager" else None
    output, _ = _original_function(module, setting.original_attention)(seen, query, key, value, mask, **kwargs)
    return exchange(output, comm, scatter_dim=1, gather_dim=2), None
