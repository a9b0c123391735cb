"""Functions that run inside the ranks of ``tests/unit/test_stage3_behaviour.py``.

Module-level so the worker pool pickles them by reference.  Each worker builds
its own single-process reference (an unsharded copy of the same seeded model,
trained on the concatenation of every rank's batch) and returns plain numbers,
lists or CPU tensors; the assertions and their messages live in the test file.
Instrumentation is attached to this call's engine objects only (instance
attributes), never to classes: the worker processes are reused across tests.
The models and shared helpers here also serve ``stage3_generate_workers.py``
(generation, evaluation) and ``stage3_accounting_workers.py`` (prefetch bound,
memory and communication).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_plugin as zp
from tests import models
from tests.models import OddBlock
from zero_plugin.engines.engine import engine_of

# ---------------------------------------------------------------------------------------------------------------
# models


class TwiceMLP(nn.Module):
    """Three ``OddBlock`` units; the middle one runs twice per forward (weight sharing across calls)."""

    _no_split_modules = ["OddBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                OddBlock(models.MLP_IN, models.MLP_HIDDEN),
                OddBlock(models.MLP_HIDDEN, models.MLP_HIDDEN),
                OddBlock(models.MLP_HIDDEN, models.MLP_HIDDEN),
            ]
        )
        self.head = nn.Linear(models.MLP_HIDDEN, models.MLP_OUT)

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[1](x)
        x = self.blocks[2](x)
        return self.head(x)


class ShiftedOddBlock(OddBlock):
    """An ``OddBlock`` with one more parameter, so its all-gather is larger than its neighbours'."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out)
        self.shift = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return super().forward(x) + self.shift


class DeepMLP(nn.Module):
    """``depth`` ``OddBlock`` units in a chain plus a small head; ``skip`` (a block index or None) is left out.

    ``skip`` lets one rank take a different path through the model (a data-dependent branch).  Block
    ``shifted`` (if given) is a ``ShiftedOddBlock``.
    """

    _no_split_modules = ["OddBlock", "ShiftedOddBlock"]

    def __init__(self, depth: int = 6, shifted: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(
            [OddBlock(models.MLP_IN, models.MLP_HIDDEN)]
            + [
                (ShiftedOddBlock if i == shifted else OddBlock)(models.MLP_HIDDEN, models.MLP_HIDDEN)
                for i in range(1, depth)
            ]
        )
        self.head = nn.Linear(models.MLP_HIDDEN, models.MLP_OUT)
        self.skip: int | None = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.head(x)


TIED_VOCAB, TIED_DIM, TIED_SEQ = 11, 7, 5


class TiedLM(nn.Module):
    """Embedding and output head share one weight; with ``unit_classes=(nn.Embedding, nn.Linear)`` the
    embedding, each block's ``fc`` and the head are separate units."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(TIED_VOCAB, TIED_DIM)
        self.blocks = nn.ModuleList([OddBlock(TIED_DIM, TIED_DIM) for _ in range(2)])
        self.head = nn.Linear(TIED_DIM, TIED_VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _seeded(cls, *args, dtype=torch.float64, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(*args).to(dtype)


def tied_batches(steps: int, rows: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, TIED_VOCAB, (rows, TIED_SEQ), generator=gen)
        out.append((ids, (ids + 1) % TIED_VOCAB))
    return out


def tied_loss(model, batch):
    ids, target = batch
    return F.cross_entropy(model(ids).reshape(-1, TIED_VOCAB), target.reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# shared helpers


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _setup(model, config: zp.ZeroConfig | None = None, lr: float = 1e-2):
    config = config or zp.ZeroConfig(stage=3, prefetch_depth=1, reshard_after_forward=True)
    return zp.setup(model, models.two_group_adamw(model, lr=lr), config)


def train_steps(
    model, opt, batches: list, accum: int = 1, clip: float | None = None, loss=models.loss_fn, shard: bool = True
) -> dict:
    """``len(batches) // accum`` steps; with ``shard`` each rank takes its slice and uses zp verbs."""
    rank, world = _rank_world() if shard else (0, 1)
    losses, norms = [], []
    for step in range(len(batches) // accum):
        step_loss = 0.0
        for i, micro in enumerate(batches[step * accum : (step + 1) * accum]):
            sync = zp.no_sync(model) if shard and i < accum - 1 else contextlib.nullcontext()
            with sync:
                value = loss(model, models.shard_batch(micro, rank, world))
                (value / accum).backward()
            step_loss += value.item() / accum
        losses.append(step_loss)
        if clip is not None:
            if shard:
                norms.append(float(zp.clip_grad_norm_(model, clip)))
            else:
                norms.append(float(nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "clip_norms": norms}


def reference(model_fn, batches, accum: int = 1, clip: float | None = None, loss=models.loss_fn, lr=1e-2):
    model = model_fn()
    opt = models.two_group_adamw(model, lr=lr)
    out = train_steps(model, opt, batches, accum, clip, loss, shard=False)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["init"] = {n: p.detach().clone() for n, p in model_fn().named_parameters()}
    return out, model, opt


def _full_params(model) -> dict:
    """Every rank: the full parameters (unique names), gathered with zp.full_state_dict(rank0_only=False)."""
    full = zp.full_state_dict(model, rank0_only=False)
    return {n: full[n] for n, _ in model.named_parameters()}


def _rel(a: list, b: list) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item() if a.numel() else 0.0


def _parity(model, got: dict, ref: dict) -> dict:
    """Numbers the test holds against tolerances: parameter error, loss and clip-norm relative errors."""
    full = _full_params(model)
    global_losses = torch.tensor(got["losses"], dtype=torch.float64)
    dist.all_reduce(global_losses)
    global_losses /= dist.get_world_size()
    return {
        "max_abs_diff": models.max_abs_diff(full, ref["params"]),
        "update_norm_error": models.update_norm_error(full, ref["params"], ref["init"]),
        "loss_rel": _rel(global_losses.tolist(), ref["losses"]),
        "clip_rel": _rel(got["clip_norms"], ref["clip_norms"]),
        "moved": models.max_abs_diff(ref["params"], ref["init"]),
    }


def _unsharded(model) -> list[str]:
    return [u.name for u in engine_of(model, "test").unsharded_units()]


def _all_sharded(model) -> bool:
    return all(p.dim() == 1 for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# parity of unusual structures (float64)

MLP_STEPS, MLP_ACCUM, MLP_ROWS = 4, 2, 8


def twice_worker() -> dict:
    """A unit called twice per forward trains like the reference."""
    batches = models.make_batches("mlp", MLP_STEPS * MLP_ACCUM, 1, MLP_ROWS, seed=5)
    model, opt = _setup(_seeded(TwiceMLP))
    got = train_steps(model, opt, batches, MLP_ACCUM, clip=0.5)
    ref, _, _ = reference(lambda: _seeded(TwiceMLP), batches, MLP_ACCUM, clip=0.5)
    return {
        **_parity(model, got, ref),
        "unsharded_after": _unsharded(model),
        "n_units": len(engine_of(model, "test").units),
    }


def flat_shards_worker(param_dtype: str | None) -> dict:
    """[Note: flat shards] in stage3/unit.py, NCCL's layout on gloo: where the shards are stored in the compute
    dtype each unit's shards are views of one tensor, the all-gather's input as it is (no copy-in at a
    gather), and training matches the reference; with a wider master dtype (``param_dtype``) the shards are
    cast in at each gather as before (trained only to count them)."""
    from tests.unit.memory_comm_workers import collectives_layout
    from zero_plugin.stage3.param import ShardedParam

    dtype = torch.float64 if param_dtype is None else torch.float32
    batches = models.make_batches(
        "mlp", MLP_STEPS * MLP_ACCUM, 1, MLP_ROWS, seed=7, dtype=dtype if param_dtype is None else torch.bfloat16
    )
    config = zp.ZeroConfig(stage=3, prefetch_depth=1, param_dtype=param_dtype, reduce_dtype=param_dtype)
    with collectives_layout(True):
        model, opt = _setup(_seeded(TwiceMLP, dtype=dtype), config)
    engine = engine_of(model, "test")
    storages = {
        u.name: len({sp.local.untyped_storage().data_ptr() for sp in u.params if sp.layout.numel}) for u in engine.units
    }
    calls = []
    original = ShardedParam.copy_locals_into
    ShardedParam.copy_locals_into = staticmethod(lambda *a: calls.append(1) or original(*a))
    try:
        got = train_steps(model, opt, batches, MLP_ACCUM, clip=0.5)
    finally:
        ShardedParam.copy_locals_into = staticmethod(original)
    if param_dtype is not None:  # mixed precision's parity is test_parity_stage3's; here only the copy-in
        return {"storages": storages, "copy_ins": len(calls), "losses": got["losses"]}
    ref, _, _ = reference(lambda: _seeded(TwiceMLP, dtype=dtype), batches, MLP_ACCUM, clip=0.5)
    return {**_parity(model, got, ref), "storages": storages, "copy_ins": len(calls)}


def tied_worker() -> dict:
    """Embedding and head share a weight but sit in different units."""
    batches = tied_batches(MLP_STEPS * MLP_ACCUM, MLP_ROWS, seed=6)
    config = zp.ZeroConfig(stage=3, prefetch_depth=1, unit_classes=(nn.Embedding, nn.Linear))
    model, opt = _setup(_seeded(TiedLM), config)
    engine = engine_of(model, "test")
    got = train_steps(model, opt, batches, MLP_ACCUM, clip=0.5, loss=tied_loss)
    ref, _, _ = reference(lambda: _seeded(TiedLM), batches, MLP_ACCUM, clip=0.5, loss=tied_loss)
    out = _parity(model, got, ref)
    out["units"] = [u.name for u in engine.units]
    out["tied_weight_unit"] = engine.unit_of[id(model.embed.weight)].name
    out["still_tied"] = model.head.weight is model.embed.weight
    return out


# ---------------------------------------------------------------------------------------------------------------
# gathered_parameters


def gathered_worker() -> dict:
    rank, world = _rank_world()
    batches = models.make_batches("mlp", 3, 1, MLP_ROWS, seed=7)
    model, opt = _setup(models.make_odd_mlp())
    train_steps(model, opt, batches[:2])
    ref, ref_model, ref_opt = reference(models.make_odd_mlp, batches[:2])
    out = {}
    with zp.gathered_parameters(model):
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["unsharded_inside"] = _unsharded(model)
    out["shapes_inside"] = {n: tuple(v.shape) for n, v in inside.items()}
    out["ref_shapes"] = {n: tuple(v.shape) for n, v in ref["params"].items()}
    out["diff_inside"] = models.max_abs_diff(inside, ref["params"])
    out["sharded_after_plain"] = _all_sharded(model) and not _unsharded(model)

    # A subset: only the units owning these parameters are gathered.
    with zp.gathered_parameters([model.blocks[1].fc.weight], model=model):
        out["subset_unsharded"] = _unsharded(model)
        out["subset_shape"] = tuple(model.blocks[1].fc.weight.shape)

    # modifier_rank=0: rank 0's edit wins, other ranks' edits are discarded.
    with zp.gathered_parameters(model, modifier_rank=0):
        with torch.no_grad():
            for p in model.parameters():
                if rank == 0:
                    p.add_(1.0)
                else:
                    p.mul_(0.0)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(1.0)
    edited = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    out["sharded_after_modify"] = _all_sharded(model) and not _unsharded(model)
    full = zp.full_state_dict(model)
    out["diff_full_state_dict_after_edit"] = (
        models.max_abs_diff({n: full[n] for n in edited}, edited) if rank == 0 else None
    )
    with zp.gathered_parameters(model):
        out["diff_gathered_after_edit"] = models.max_abs_diff(
            {n: p.detach().clone() for n, p in model.named_parameters()}, edited
        )

    # Training continues from the edited weights (and the existing Adam state).
    train_steps(model, opt, batches[2:])
    train_steps(ref_model, ref_opt, batches[2:], shard=False)
    want = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    out["diff_after_next_step"] = models.max_abs_diff(_full_params(model), want)
    out["moved_by_next_step"] = models.max_abs_diff(want, edited)
    out["world_size"] = world
    return out


# ---------------------------------------------------------------------------------------------------------------
# a branch taken on one rank only


def branch_worker(
    skipped_is_larger: bool, skip_block: int = 2, skip_rank: int = 1, steps: int = 2, debug: bool = False
) -> dict:
    """Rank ``skip_rank`` leaves out block ``skip_block``; the reference is DDP semantics (that rank's
    gradient for the skipped block is zero), simulated in one process by replaying each rank's path.

    With ``skipped_is_larger`` the skipped block has one parameter more than the next one, so the
    all-gathers that end up paired across ranks differ in size; otherwise they have the same size.
    """
    rank, world = _rank_world()
    batches = models.make_batches("mlp", steps, world, per_rank_batch=2, seed=11)
    shifted = skip_block if skipped_is_larger else None

    def build():
        return _seeded(DeepMLP, 4, shifted)

    ref_model = build()
    ref_opt = models.two_group_adamw(ref_model)
    for batch in batches:
        for r in range(world):
            ref_model.skip = skip_block if r == skip_rank else None
            x, target = models.shard_batch(batch, r, world)
            (F.mse_loss(ref_model(x), target) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_model.skip = None

    model, opt = _setup(build(), zp.ZeroConfig(stage=3, debug_collectives=debug) if debug else None)
    model.skip = skip_block if rank == skip_rank else None
    for batch in batches:
        x, target = models.shard_batch(batch, rank, world)
        F.mse_loss(model(x), target).backward()
        opt.step()
        opt.zero_grad()
    model.skip = None
    want = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    return {"max_abs_diff": models.max_abs_diff(_full_params(model), want)}


# ---------------------------------------------------------------------------------------------------------------
# LoRA + activation checkpointing through transformers


def lora_checkpointing_worker(steps: int = 2) -> dict:
    rank, world = _rank_world()
    batches = models.make_batches("llama", steps, world, per_rank_batch=2, seed=12)

    def build():
        model = models.make_tiny_llama_lora(layers=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
        return model

    model, opt = _setup(build())
    before = _full_params(model)
    got = train_steps(model, opt, batches)
    after = _full_params(model)
    ref, _, _ = reference(build, batches)
    lora = [n for n in after if "lora_" in n]
    base = [n for n in after if "lora_" not in n]
    return {
        "losses": got["losses"],
        "finite": all(math.isfinite(v) for v in got["losses"]),
        "lora_moved": min((after[n] - before[n]).abs().max().item() for n in lora),
        "base_moved": max((after[n] - before[n]).abs().max().item() for n in base),
        "update_norm_error": models.update_norm_error(after, ref["params"], ref["init"]),
        "n_lora": len(lora),
        "unsharded_after": _unsharded(model),
    }
