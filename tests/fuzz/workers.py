"""What every rank runs for one fuzz spec (module level, so the worker pool pickles it by reference)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests.fuzz.model import FORWARD_BATCHES, batch, build_model, build_optimizer, loss_fn, trainable_names, written
from tests.unit.memory_comm_workers import collectives_layout

TIMEOUT_S = 15.0  # a collective mismatch fails in seconds instead of the default ten minutes


def precision(spec: dict) -> tuple[torch.dtype, dict]:
    """(model dtype, ZeroConfig precision fields): fp64 cases train in float64 for tight tolerances."""
    if spec["precision"] == "fp64":
        return torch.float64, {}
    fields = {"param_dtype": torch.bfloat16}
    if spec["precision"] == "bf16_reduce_fp32":
        fields["reduce_dtype"] = torch.float32
    return torch.float32, fields


def make_config(spec: dict) -> zp.ZeroConfig:
    s3 = spec["stage3"]
    _, fields = precision(spec)
    return zp.ZeroConfig(
        stage=spec["stage"],
        offload_optimizer="cpu" if spec["offload"] else "none",
        bucket_size_mb=spec["bucket_size_mb"],
        prefetch_depth=s3["prefetch_depth"],
        reshard_after_forward=s3["reshard_after_forward"],
        persistence_threshold=s3["persistence_threshold"],
        secondary_shard_size=s3.get("secondary_shard_size"),
        unit_classes=("FuzzBlock",),
        timeout_s=TIMEOUT_S,
        debug_collectives=True,
        **fields,
    )


def fuzz_worker(spec: dict) -> dict:
    """Set up, run the schedule, return this rank's losses, clip norms and the full state dict."""
    with collectives_layout(spec["buffered"]):
        return _run(spec)


def _run(spec: dict) -> dict:
    rank = dist.get_rank()
    dtype, _ = precision(spec)
    model = build_model(spec, dtype)
    model, opt = zp.setup(model, build_optimizer(spec, model), make_config(spec))
    losses, norms, forwards, micro = [], [], [], 0
    for op in spec["schedule"]:
        if op[0] == "forward":  # autograd on, no backward (issue 38)
            x, y = batch(spec, FORWARD_BATCHES + len(forwards), rank, dtype)
            forwards.append(loss_fn(model(x, op[1]["usage"][rank]), y).item())
        elif op[0] == "write":
            _write(model, op[1], rank)
        elif op[0] == "micro":
            x, y = batch(spec, micro, rank, dtype)
            ctx = contextlib.nullcontext() if op[1]["sync"] else zp.no_sync(model)
            with ctx:
                loss = loss_fn(model(x, op[1]["usage"][rank]), y)
                (loss * op[1]["scale"]).backward()
            losses.append(loss.item())
            micro += 1
        elif op[0] == "clip":
            norms.append(float(zp.clip_grad_norm_(model, op[1])))
        elif op[0] == "step":
            opt.step()
        elif op[0] == "zero_grad":
            (opt if op[1] == "optimizer" else model).zero_grad()
        else:
            raise ValueError(f"unknown schedule op {op!r}")
    full = zp.full_state_dict(model, rank0_only=False)
    return {"losses": losses, "norms": norms, "forwards": forwards, "full": full}


def _write(model, how: dict, rank: int) -> None:
    """New trainable weights (``model.written``): through the module's ``load_state_dict`` with full tensors
    read by ``zp.full_state_dict``, or edited on rank 0 inside ``zp.gathered_parameters(modifier_rank=0)``."""
    names = trainable_names(model)
    if how["how"] == "load":
        full = zp.full_state_dict(model, rank0_only=False)
        model.load_state_dict({n: written(i, full[n], how["seed"]) for i, n in enumerate(names)}, strict=False)
        return
    params = dict(model.named_parameters())
    with zp.gathered_parameters(model, modifier_rank=0), torch.no_grad():
        if rank == 0:
            for i, n in enumerate(names):
                params[n].copy_(written(i, params[n], how["seed"]))
