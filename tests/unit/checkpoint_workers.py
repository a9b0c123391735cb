"""Functions that run inside the ranks of ``tests/unit/test_checkpoint.py``.

Module-level so the worker pool pickles them by reference; arguments and
results are plain Python or CPU tensors.  Optimizer state is compared through
:func:`full_optimizer_state`, a gather written here from the engine's slots so
that the checkpoint code is checked against something it does not share.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import zero_plugin as zp
from tests import models
from zero_plugin.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_peft_adapter
from zero_plugin.ckpt import format as ckpt_format
from zero_plugin.engines.engine import engine_of

LR = 1e-2
GLOBAL_ROWS = 4  # divisible by every world size used (1, 2, 4)


# -- building and training ----------------------------------------------------------
def build(stage: int, dtype: torch.dtype = torch.float64, seed: int = 0, model: nn.Module | None = None, **config):
    model = models.make_odd_mlp(dtype=dtype, seed=seed) if model is None else model
    opt = models.two_group_adamw(model, lr=LR)
    return zp.setup(model, opt, zp.ZeroConfig(stage=stage, **config))


def batches(dtype: torch.dtype, steps: int = 6) -> list:
    return models.make_batches("mlp", steps, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=3, dtype=dtype)


def train(model, opt, data: list, first: int, last: int, scheduler=None) -> None:
    rank, world = _rank_world()
    for step in range(first, last):
        models.loss_fn(model, models.shard_batch(data[step], rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# -- observing state --------------------------------------------------------------------
def full_params(model) -> dict[str, torch.Tensor]:
    return zp.full_state_dict(model, rank0_only=False)


def full_optimizer_state(model, opt) -> dict:
    """``{"state": {name: {key: full flat tensor or scalar}}, "groups": [...]}`` on every rank."""
    engine = engine_of(model, "test")
    local, scalars = {}, {}
    for slot in engine.slots:
        for key, value in opt.inner.state.get(slot.master, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == slot.master.numel():
                lo, hi = slot.layout.bounds() if slot.layout.world_size > 1 else (0, slot.layout.numel)
                local[(slot.name, key)] = (lo, hi, value.detach().reshape(-1).clone())
            else:
                scalars[(slot.name, key)] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    pieces = [local]
    if dist.is_initialized():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, local)
    state: dict[str, dict] = {}
    for (name, key), value in scalars.items():
        state.setdefault(name, {})[key] = value
    numel = {s.name: s.layout.numel for s in engine.slots}
    for name, key in pieces[0]:
        full = None
        for piece in pieces:
            lo, hi, values = piece[(name, key)]
            full = torch.empty(numel[name], dtype=values.dtype) if full is None else full
            full[lo:hi] = values
        state.setdefault(name, {})[key] = full
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, [engine.name_of_master(p) for p in g["params"]])
        for g in opt.inner.param_groups
    ]
    return {"state": state, "groups": groups}


def _rng_sample() -> tuple:
    return torch.rand(3), random.random(), float(np.random.rand())


# -- exact resume ---------------------------------------------------------------------------
def resume_first_half(stage: int, path: str, config: dict | None = None) -> dict:
    """Six steps straight, then (fresh objects) three steps and a save; fp32."""
    config = config or {}
    data = batches(torch.float32)
    model, opt = build(stage, torch.float32, **config)
    train(model, opt, data, 0, 6, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    out = {"straight_params": full_params(model), "straight_opt": full_optimizer_state(model, opt)}

    rank, _ = _rank_world()
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    model, opt = build(stage, torch.float32, **config)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, data, 0, 3, scheduler)
    save_checkpoint(
        path, model, opt, extra={"step": 3, "scheduler": scheduler.state_dict(), "data_position": 3 * GLOBAL_ROWS}
    )
    out["rng_after_save"] = _rng_sample()
    train(model, opt, data, 3, 6, scheduler)
    out["split_lrs"] = [g["lr"] for g in opt.param_groups]
    return out


def resume_second_half(stage: int, path: str, config: dict | None = None) -> dict:
    """A fresh model and optimizer (other seed): load, restore the scheduler, three more steps."""
    data = batches(torch.float32)
    model, opt = build(stage, torch.float32, seed=7, **(config or {}))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    extra = load_checkpoint(path, model, opt)
    rng = _rng_sample()
    scheduler.load_state_dict(extra["scheduler"])
    train(model, opt, data, extra["step"], 6, scheduler)
    return {
        "params": full_params(model),
        "opt": full_optimizer_state(model, opt),
        "rng_after_load": rng,
        "extra": extra,
        "lrs": [g["lr"] for g in opt.param_groups],
    }


# -- resharding ---------------------------------------------------------------------------------
def reshard_save(stages: list[int], root: str) -> dict:
    """Per stage: two steps, save to ``root/s{stage}-n{N}``, record, then one reference step more."""
    data = batches(torch.float64)
    _, world = _rank_world()
    out = {}
    for stage in stages:
        model, opt = build(stage)
        train(model, opt, data, 0, 2)
        path = os.path.join(root, f"s{stage}-n{world}")
        save_checkpoint(path, model, opt, extra={"step": 2})
        saved = {"params": full_params(model), "opt": full_optimizer_state(model, opt)}
        train(model, opt, data, 2, 3)
        out[path] = {**saved, "after": full_params(model)}
    return out


def reshard_load(paths: list[str], stages: list[int]) -> dict:
    """Load each checkpoint into each stage at this world size; record, then one step."""
    data = batches(torch.float64)
    out = {}
    for path in paths:
        for stage in stages:
            model, opt = build(stage, seed=11)
            extra = load_checkpoint(path, model, opt)
            loaded = {"params": full_params(model), "opt": full_optimizer_state(model, opt)}
            train(model, opt, data, extra["step"], extra["step"] + 1)
            out[(path, stage)] = {**loaded, "after": full_params(model)}
    return out


# -- mixed precision and offload -------------------------------------------------------------------
def mixed_save(stage: int, path: str, config: dict) -> dict:
    """fp32 OddMLP trained in bf16 (fp32 masters): the checkpoint must hold the masters, not bf16 copies."""
    data = batches(torch.float32)
    model, opt = build(stage, torch.float32, **config)
    train(model, opt, data, 0, 2)
    save_checkpoint(path, model, opt, extra={"step": 2})
    return {"params": full_params(model), "opt": full_optimizer_state(model, opt)}


def mixed_load(path: str, runs: list[tuple[int, dict]]) -> list[dict]:
    data = batches(torch.float32)
    out = []
    for stage, config in runs:
        model, opt = build(stage, torch.float32, seed=9, **config)
        extra = load_checkpoint(path, model, opt)
        loaded = {"params": full_params(model), "opt": full_optimizer_state(model, opt)}
        train(model, opt, data, extra["step"], extra["step"] + 1)
        out.append(loaded)
    return out


# -- bad input ---------------------------------------------------------------------------------------
class Evil:
    """Unpickling this runs ``open(sentinel, "w")``: proof that a loader executed a pickle."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def _rank0_file_op(fn, *args) -> None:
    if _rank_world()[0] == 0:
        fn(*args)
    _barrier()


def _copy(src: str, dst: str) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _replace_and_reseal(directory: str, name: str, data: bytes, listed_as: str | None = None) -> None:
    """Write ``data`` as ``name`` and rewrite the manifest so that sizes and hashes match (a tampered dir)."""
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    manifest = ckpt_format.read_json(os.path.join(directory, ckpt_format.COMPLETE), "manifest")
    for listed in {name, listed_as} - {None}:
        manifest["files"][listed] = {
            "size": len(data),
            "sha256": ckpt_format.sha256_file(os.path.join(directory, name)),
        }
    ckpt_format.write_json(os.path.join(directory, ckpt_format.COMPLETE), manifest)


def _torch_save_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _corruptions(good: str, root: str, sentinel: str) -> dict[str, str]:
    """Rank 0 makes one corrupted copy of ``good`` per case; returns {case: dir}."""
    rank_file = ckpt_format.shard_file_name
    cases = {}

    def make(case, fn, *args):
        target = os.path.join(root, case)
        _rank0_file_op(lambda: (_copy(good, target), fn(target, *args)))
        cases[case] = target

    make("truncated", lambda d: _truncate(os.path.join(d, rank_file(1, 2))))
    make("flipped", lambda d: _flip(os.path.join(d, rank_file(0, 2))))
    make("missing", lambda d: os.remove(os.path.join(d, rank_file(1, 2))))
    make("no_complete", lambda d: os.remove(os.path.join(d, ckpt_format.COMPLETE)))
    evil = pickle.dumps(Evil(sentinel))
    make("planted_pickle", lambda d: _replace_and_reseal(d, "evil.pkl", evil))
    make("pickle_as_shard", lambda d: _replace_and_reseal(d, rank_file(0, 2), evil))
    make(
        "torch_save_as_shard",
        lambda d: _replace_and_reseal(d, rank_file(1, 2), _torch_save_bytes({"w": Evil(sentinel)})),
    )
    make("pickle_as_index", lambda d: _replace_and_reseal(d, ckpt_format.INDEX, evil))
    make("wrong_shape", lambda d: _reshape_last_state(os.path.join(d, rank_file(1, 2)), d))
    return cases


def _reshape_last_state(path: str, directory: str) -> None:
    """Rewrite a rank file as valid safetensors whose last optimizer-state tensor has one element too many,
    and reseal the manifest: only the header check of the load's plan phase can catch it, after every
    parameter has been planned."""
    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(k for k in tensors if k.startswith("o/") and tensors[k].dim() == 1)[-1]
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    _replace_and_reseal(directory, os.path.basename(path), save(tensors, metadata=metadata))


class _WiderHead(models.OddMLP):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(models.MLP_HIDDEN, models.MLP_OUT + 2)


class _ExtraParam(models.OddMLP):
    def __init__(self):
        super().__init__()
        self.extra_bias = nn.Parameter(torch.zeros(5))

    def forward(self, x):
        return super().forward(x) + self.extra_bias.sum()


def _try_load(path: str, model, opt) -> str | None:
    try:
        load_checkpoint(path, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def bad_input(stage: int, root: str, sentinel: str) -> dict:
    """Save a good checkpoint, corrupt copies of it, and try each on a trained model: errors, nothing changed."""
    data = batches(torch.float64)
    model, opt = build(stage)
    train(model, opt, data, 0, 2)
    good = os.path.join(root, "good")
    save_checkpoint(good, model, opt, extra={"step": 2})
    train(model, opt, data, 2, 3)  # the live state now differs from the checkpoint
    before = {"params": full_params(model), "opt": full_optimizer_state(model, opt)}
    errors = {case: _try_load(path, model, opt) for case, path in _corruptions(good, root, sentinel).items()}
    for case, cls in (("wider_head", _WiderHead), ("extra_param", _ExtraParam)):
        with torch.random.fork_rng(devices=[]):
            other, other_opt = build(stage, model=cls().double())
        other_before = full_params(other)
        errors[case] = _try_load(good, other, other_opt)
        errors[case + "_unchanged"] = all(torch.equal(v, full_params(other)[k]) for k, v in other_before.items())
    after = {"params": full_params(model), "opt": full_optimizer_state(model, opt)}
    in_place = _loads_in_place(good, model, opt)
    return {
        "errors": errors,
        "before": before,
        "after": after,
        "sentinel_exists": os.path.exists(sentinel),
        "in_place": in_place,
    }


def _storage(model, opt) -> dict:
    engine = engine_of(model, "test")
    out = {f"param {n}": p.data_ptr() for n, p in model.named_parameters()}
    for _p, sp in (getattr(engine, "sharded", None) or {}).items():
        out[f"shard {sp.name}"] = sp.local.data_ptr()
    for slot in engine.slots:
        out[f"master {slot.name}"] = slot.master.data_ptr()
        for key, value in opt.inner.state.get(slot.master, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"state {slot.name}/{key}"] = value.data_ptr()
    return out


def _loads_in_place(good: str, model, opt) -> dict:
    """A good load into a trained model writes into the tensors already there ([Note: loading in place])."""
    storage = _storage(model, opt)
    load_checkpoint(good, model, opt)
    after = _storage(model, opt)
    return {"moved": sorted(k for k in storage if after.get(k) != storage[k]), "checked": len(storage)}


# -- crash safety (a plain subprocess, one rank, no process group) ------------------------------------------
def crash_save(path: str, marker: str) -> None:
    """Overwrite ``path`` with a new save that stalls after its first file (the parent kills us then)."""
    model, opt = build(2)
    train(model, opt, batches(torch.float64), 0, 4)
    original = ckpt_format.write_safetensors

    def stalling(*args, **kwargs):
        record = original(*args, **kwargs)
        with open(marker, "w") as f:
            f.write(args[0])
        time.sleep(600)
        return record

    ckpt_format.write_safetensors = stalling
    save_checkpoint(path, model, opt, extra={"step": 4})


def save_small(path: str, steps: int) -> dict:
    model, opt = build(2)
    train(model, opt, batches(torch.float64), 0, steps)
    save_checkpoint(path, model, opt, extra={"step": steps})
    return full_params(model)


def load_small(path: str) -> tuple[dict | None, str | None]:
    model, opt = build(2, seed=5)
    try:
        extra = load_checkpoint(path, model, opt)
    except CheckpointError as exc:
        return None, str(exc)
    return {"extra": extra, "params": full_params(model)}, None


def _train_llama(model, config: zp.ZeroConfig):
    """Set up the tiny Llama (LoRA or not) with AdamW on its trainable parameters; 2 steps. -> model, opt, data"""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, opt = zp.setup(model, opt, config)
    rank, world = _rank_world()
    data = models.make_batches("llama", 2, world_size=world, per_rank_batch=2, seed=0)
    for batch in data:
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, data


# -- PEFT adapter under stage 3 ------------------------------------------------------------------------------
def peft_adapter(directory: str) -> dict:
    from peft import PeftModel

    # A short timeout: recording the export metadata on rank 0 alone must not be a collective state_dict() call.
    model, opt, data = _train_llama(models.make_tiny_llama_lora(layers=2), zp.ZeroConfig(stage=3, timeout_s=20))
    rank, _ = _rank_world()
    save_peft_adapter(model, directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(directory + "-ckpt", model, opt)
    save_warnings = [str(x.message) for x in caught if "zp.save_checkpoint" in str(x.message)]
    ids = data[0]["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank != 0:
        return {"save_warnings": save_warnings}
    from safetensors.torch import load_file

    saved = load_file(os.path.join(directory, "adapter_model.safetensors"))
    base = models.make_tiny_llama(layers=2)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        ref = PeftModel.from_pretrained(base, directory)(input_ids=ids).logits
    return {
        "keys": sorted(saved),
        "max_diff": float((ref - logits).abs().max()),
        "equal": torch.equal(ref, logits),
        "adapter_effect": float((ref - base_logits).abs().max()),
        "save_warnings": save_warnings,
    }


# -- offline export (zero-plugin consolidate) -----------------------------------------------------------------
def hf_export_source(path: str, stage: int, config: dict) -> dict:
    """Train the tiny Llama 2 steps at ``stage``, save a checkpoint; rank 0 returns the full fp32 state and
    the logits of the first batch (the reference the consolidated folder must reproduce)."""
    model, opt, data = _train_llama(models.make_tiny_llama(layers=2), zp.ZeroConfig(stage=stage, **config))
    rank, _ = _rank_world()
    save_checkpoint(path, model, opt)
    state = zp.full_state_dict(model, rank0_only=False)
    with torch.no_grad():
        logits = model(input_ids=data[0]["input_ids"]).logits
    return {"state": state, "logits": logits, "ids": data[0]["input_ids"]} if rank == 0 else {}
