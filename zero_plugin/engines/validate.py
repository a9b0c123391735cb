"""Setup-time checks: the optimizer matches the model, and every rank agrees.

Each failure is a ``ValueError`` that names the problem and the fix, raised
on every rank (the rank check is collective) so nothing hangs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..comm.collectives import Comm
from ..config import ZeroConfig

__all__ = ["trainable_parameters", "check_ranks_agree"]


def trainable_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
) -> list[tuple[str, nn.Parameter]]:
    """(name, param) of every parameter the optimizer (or the optimizers, in their order: [Note: several
    optimizers] in engine.py) trains, in group order.

    Frozen parameters (``requires_grad=False``) are dropped from the optimizer's
    groups: they get neither gradients nor optimizer state.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"zp.setup: model must be a torch.nn.Module, got {type(model).__name__}")
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"zp.setup: optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if not optimizers:
        raise ValueError("zp.setup: got an empty list of optimizers; pass one optimizer, a list of them, or None")
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    out = []
    for oi, opt in enumerate(optimizers):
        where = f"optimizer {oi} " if len(optimizers) > 1 else "optimizer "
        for gi, group in enumerate(opt.param_groups):
            kept = []
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"zp.setup: {where}param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the model; build the optimizer from model.parameters()"
                    )
                if id(p) in seen:
                    raise ValueError(
                        f"zp.setup: parameter {names[id(p)]!r} appears in more than one param group"
                        + (" or optimizer; give each parameter to one optimizer" if len(optimizers) > 1 else "")
                    )
                seen.add(id(p))
                if p.requires_grad:
                    kept.append(p)
                    out.append((names[id(p)], p))
            group["params"] = kept
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"zp.setup: {len(missing)} parameter(s) require grad but are not in the optimizer, e.g. {missing[:3]}; "
            "add them to a param group or set requires_grad=False"
        )
    return out


def _model_signature(model: nn.Module) -> list[tuple[str, tuple, str, bool]]:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]


def check_ranks_agree(model: nn.Module, config: ZeroConfig, comm: Comm) -> None:
    """Collective: every rank must pass the same config and the same model."""
    if comm.world_size == 1 or not config.debug.check_ranks:
        return
    sig = _model_signature(model)
    mine = {
        "config": config.fingerprint(),
        "model": hashlib.sha256(repr(sig).encode()).hexdigest(),
        "world_size": comm.world_size,
    }
    everyone = comm.all_gather_object((mine, sig, config.to_dict()))
    ref, ref_sig, ref_cfg = everyone[0]
    for rank, (other, other_sig, other_cfg) in enumerate(everyone):
        if other["config"] != ref["config"]:
            diff = {k: (ref_cfg.get(k), other_cfg.get(k)) for k in ref_cfg if ref_cfg.get(k) != other_cfg.get(k)}
            raise ValueError(
                f"zp.setup: rank {rank} has a different ZeroConfig than rank 0: {diff} "
                f"(rank 0's value, rank {rank}'s value); pass the same config on every rank"
            )
        if other["model"] != ref["model"]:
            raise ValueError(
                f"zp.setup: rank {rank}'s model differs from rank 0's: {_first_difference(ref_sig, other_sig)}; "
                "build the same model on every rank"
            )
        if other["world_size"] != ref["world_size"]:
            raise ValueError(
                f"zp.setup: rank {rank} sees world size {other['world_size']}, rank 0 sees "
                f"{ref['world_size']}; use the same process group on every rank"
            )


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"rank 0 has {x}, the other rank has {y}"
    return f"rank 0 has {len(a)} parameters, the other rank has {len(b)}"


@torch.no_grad()
def broadcast_module_state(model: nn.Module, comm: Comm) -> None:
    """Make every rank start from rank 0's parameters and buffers (DDP semantics), one flat buffer per dtype."""
    if comm.world_size == 1:
        return
    tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
