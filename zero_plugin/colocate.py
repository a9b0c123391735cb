"""``zp.offload_states`` / ``zp.reload_states``: free the device for a colocated generator (vLLM) and take it back.

The equivalent of DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``, at every stage; the
mechanics and what is refused meanwhile are in [Note: parked states] (``engines/state_offload.py``).
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from .engines.engine import engine_of
from .engines.state_offload import CATEGORIES, OffloadedStates

__all__ = ["offload_states", "reload_states"]

# DeepSpeed's OffloadStateTypeEnum values, for scripts written against engine.offload_states(include=[...])
_DEEPSPEED_NAMES = {
    "optim_states": "optimizer",
    "hp_params": "optimizer",  # fp32 masters: counted with the optimizer state, as memory_report does
    "lp_params": "params",
    "lp_grads": "grads",
    "contiguous_grad_buffer": "grads",
}


def offload_states(model: nn.Module, include: str | Iterable[str] | None = None) -> dict:
    """Move this rank's model states from the device to host memory (pinned on CUDA) and free their device
    memory; :func:`reload_states` brings them back bit for bit.  Not collective.

    ``include``: any of ``"params"``, ``"grads"``, ``"optimizer"`` (optimizer state with the fp32 masters),
    ``memory_report``'s categories, or DeepSpeed's names (``optim_states``, ``hp_params``, ``lp_params``,
    ``lp_grads``, ``contiguous_grad_buffer``); ``None``: all three.  States already on the host (ZeRO-Offload's
    optimizer state with ``offload_optimizer="cpu"``, stage-3 shards with ``offload_params``) stay where they
    are.  Until :func:`reload_states`, a forward, ``optimizer.step()``, ``zero_grad`` or a ``zp`` verb other
    than ``memory_report`` raises an error naming it.  Call it after a backward or a step, not between a
    forward and its backward.

    Returns the bytes per category: ``moved`` to the host, ``already_on_host``, ``kept`` on the device (storages
    that cannot be resized)."""
    categories = _categories(include)
    engine = engine_of(model, "offload_states")
    if engine.offloaded_states is not None:
        raise RuntimeError(
            "zp.offload_states: the model states are already offloaded; call zp.reload_states(model) first"
        )
    _settle_stage3(engine)
    engine.hold_offloaded(OffloadedStates.offload(engine, categories))
    return engine.offloaded_states.summary()


def reload_states(model: nn.Module) -> dict:
    """Bring back what :func:`offload_states` moved, into the same tensors; a no-op when nothing is offloaded.
    Returns the bytes per category moved back."""
    engine = engine_of(model, "reload_states")
    parked = engine.offloaded_states
    if parked is None:
        return {}
    moved = parked.moved_bytes()
    parked.reload()
    engine.hold_offloaded(None)
    return moved


def _categories(include: str | Iterable[str] | None) -> tuple[str, ...]:
    if include is None:
        return CATEGORIES
    names = [include] if isinstance(include, str) else list(include)
    wanted = set()
    for name in names:
        category = _DEEPSPEED_NAMES.get(name, name)
        if category not in CATEGORIES:
            raise ValueError(
                f"zp.offload_states: include must name {', '.join(CATEGORIES)} (or DeepSpeed's "
                f"{', '.join(_DEEPSPEED_NAMES)}); got {name!r}"
            )
        wanted.add(category)
    return tuple(c for c in CATEGORIES if c in wanted)


def _settle_stage3(engine) -> None:
    """Stage 3: no backward may be running, and units a forward kept for a backward that has not come are let go
    first, as before a step ([Note: pending forward] in stage3/hooks.py)."""
    if engine.open_blocks():
        raise RuntimeError("zp.offload_states: inside zp.gathered_parameters; offload after the block")
    if engine.in_backward():
        raise RuntimeError("zp.offload_states: a backward is running; offload after it finished")
    engine.forget_forward()  # stages 0-2 keep nothing
