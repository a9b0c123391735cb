"""Functions that run inside the ranks of ``tests/unit/test_stage3_behaviour.py``.

Module-level so the worker pool pickles them by reference.  Each worker builds
its own single-process reference (an unsharded copy of the same seeded model,
trained on the concatenation of every rank's batch) and returns plain numbers,
lists or CPU tensors; the assertions and their messages live in the test file.
Instrumentation is attached to this call's engine objects only (instance
attributes), never to classes: the worker processes are reused across tests.
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
from zero_plugin.engine import engine_of
from zero_plugin.stage3.param import ShardedState

# ---------------------------------------------------------------------------------------------------------------
# models


class TwiceMLP(nn.Module):
    """Three ``OddBlock`` units; the middle one runs twice per forward (weight sharing across calls)."""

    _no_split_modules = ["OddBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([OddBlock(models.MLP_IN, models.MLP_HIDDEN),
                                     OddBlock(models.MLP_HIDDEN, models.MLP_HIDDEN),
                                     OddBlock(models.MLP_HIDDEN, models.MLP_HIDDEN)])
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
            + [(ShiftedOddBlock if i == shifted else OddBlock)(models.MLP_HIDDEN, models.MLP_HIDDEN)
               for i in range(1, depth)])
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


def train_steps(model, opt, batches: list, accum: int = 1, clip: float | None = None, loss=models.loss_fn,
                shard: bool = True) -> dict:
    """``len(batches) // accum`` steps; with ``shard`` each rank takes its slice and uses zp verbs."""
    rank, world = _rank_world() if shard else (0, 1)
    losses, norms = [], []
    for step in range(len(batches) // accum):
        step_loss = 0.0
        for i, micro in enumerate(batches[step * accum:(step + 1) * accum]):
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
                norms.append(float(nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                            clip)))
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
    return {"max_abs_diff": models.max_abs_diff(full, ref["params"]),
            "update_norm_error": models.update_norm_error(full, ref["params"], ref["init"]),
            "loss_rel": _rel(global_losses.tolist(), ref["losses"]),
            "clip_rel": _rel(got["clip_norms"], ref["clip_norms"]),
            "moved": models.max_abs_diff(ref["params"], ref["init"])}


def _unsharded(model) -> list[str]:
    return [u.name for u in engine_of(model, "test").unsharded_units()]


def _all_sharded(model) -> bool:
    return all(p.dim() == 1 for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# generate

def generate_worker(prompt_lens: list[int], max_new: list[int], synced_gpus: bool | None) -> dict:
    """Greedy ``generate`` at stage 3 vs the unsharded model on this rank's own prompt."""
    rank, _ = _rank_world()
    ref = models.make_tiny_llama(layers=2).eval()
    model, _opt = _setup(models.make_tiny_llama(layers=2))
    model.eval()
    gen = torch.Generator().manual_seed(123 + (rank if len(set(prompt_lens)) > 1 else 0))
    prompt = torch.randint(3, models.LLAMA_VOCAB, (1, prompt_lens[rank]), generator=gen)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=max_new[rank], do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(prompt, **kwargs)
    if synced_gpus is not None:
        kwargs["synced_gpus"] = synced_gpus
    got = model.generate(prompt, **kwargs)
    return {"got": got.tolist(), "want": want.tolist(), "unsharded_after": _unsharded(model),
            "sharded_after": _all_sharded(model)}


# ---------------------------------------------------------------------------------------------------------------
# eval without autograd

def eval_worker(mode: str) -> dict:
    """Logits under no_grad / inference_mode equal the unsharded model's; units released; training goes on."""
    rank, world = _rank_world()
    batches = models.make_batches("llama", 3, world, per_rank_batch=2, seed=3)
    ref_model = models.make_tiny_llama(layers=2).eval()
    model, opt = _setup(models.make_tiny_llama(layers=2))
    model.eval()
    local = models.shard_batch(batches[0], rank, world)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        logits = [model(**local).logits.clone() for _ in range(2)]   # twice: the second call re-gathers
        want = ref_model(**local).logits
    out = {"logit_diffs": [(x - want).abs().max().item() for x in logits],
           "unsharded_after_eval": _unsharded(model), "sharded_after_eval": _all_sharded(model)}
    model.train()
    got = train_steps(model, opt, batches[1:], accum=1, clip=1.0)
    ref, _, _ = reference(lambda: models.make_tiny_llama(layers=2), batches[1:], accum=1, clip=1.0)
    out.update(_parity(model, got, ref))
    out["unsharded_after_train"] = _unsharded(model)
    return out


# ---------------------------------------------------------------------------------------------------------------
# parity of unusual structures (float64)

MLP_STEPS, MLP_ACCUM, MLP_ROWS = 4, 2, 8


def twice_worker() -> dict:
    """A unit called twice per forward trains like the reference."""
    batches = models.make_batches("mlp", MLP_STEPS * MLP_ACCUM, 1, MLP_ROWS, seed=5)
    model, opt = _setup(_seeded(TwiceMLP))
    got = train_steps(model, opt, batches, MLP_ACCUM, clip=0.5)
    ref, _, _ = reference(lambda: _seeded(TwiceMLP), batches, MLP_ACCUM, clip=0.5)
    return {**_parity(model, got, ref), "unsharded_after": _unsharded(model),
            "n_units": len(engine_of(model, "test").units)}


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
    out["diff_full_state_dict_after_edit"] = models.max_abs_diff(
        {n: full[n] for n in edited}, edited) if rank == 0 else None
    with zp.gathered_parameters(model):
        out["diff_gathered_after_edit"] = models.max_abs_diff(
            {n: p.detach().clone() for n, p in model.named_parameters()}, edited)

    # Training continues from the edited weights (and the existing Adam state).
    train_steps(model, opt, batches[2:])
    train_steps(ref_model, ref_opt, batches[2:], shard=False)
    want = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    out["diff_after_next_step"] = models.max_abs_diff(_full_params(model), want)
    out["moved_by_next_step"] = models.max_abs_diff(want, edited)
    out["world_size"] = world
    return out


# ---------------------------------------------------------------------------------------------------------------
# prefetch bound

def _instrument_peak(engine, record: dict, phase: dict) -> None:
    """Wrap each non-root unit's unshard/wait_unshard (instance attributes) to record, per phase, the most
    non-root units that hold gathered memory at once: unsharded, or with an all-gather in flight."""
    blocks = engine.units[1:]

    def count() -> int:
        return sum(u.state is ShardedState.UNSHARDED or u.gathering for u in blocks)

    def wrap(unit, name):
        original = getattr(unit, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            key = phase["now"]
            record[key] = max(record.get(key, 0), count())
            if name == "unshard" and kwargs.get("async_op"):
                record["async_gathers"] = record.get("async_gathers", 0) + 1
            return result

        setattr(unit, name, wrapped)

    for unit in blocks:
        wrap(unit, "unshard")
        wrap(unit, "wait_unshard")


def prefetch_worker(prefetch_depth: int, depth: int = 6) -> dict:
    batches = models.make_batches("mlp", 3, 1, MLP_ROWS, seed=8)
    rank, world = _rank_world()
    model, opt = _setup(_seeded(DeepMLP, depth),
                        zp.ZeroConfig(stage=3, prefetch_depth=prefetch_depth, reshard_after_forward=True))
    engine = engine_of(model, "test")
    record, phase = {}, {"now": "other"}
    _instrument_peak(engine, record, phase)
    losses = []
    for batch in batches:
        x, target = models.shard_batch(batch, rank, world)
        phase["now"] = "forward"
        loss = F.mse_loss(model(x), target)
        phase["now"] = "backward"
        loss.backward()
        phase["now"] = "other"
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    ref, _, _ = reference(lambda: _seeded(DeepMLP, depth), batches)
    return {"peak": record, "n_blocks": len(engine.units) - 1,
            "max_abs_diff": models.max_abs_diff(_full_params(model), ref["params"])}


# ---------------------------------------------------------------------------------------------------------------
# memory

def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def memory_worker(kind: str) -> dict:
    """After a warm step, between backward and step: memory_report vs theory vs our own storage count.

    ``kind``: "llama" (tiny Llama, fp32; its sizes divide by 2 and 4, so no padding) or "mlp32"
    (``DeepMLP`` in fp32, whose odd sizes such as 7 x 15 leave a padded tail).
    """
    rank, world = _rank_world()
    if kind == "llama":
        batches = models.make_batches("llama", 2, world, per_rank_batch=2, seed=9)
        model = models.make_tiny_llama(layers=2)
    else:
        batches = models.make_batches("mlp", 2, world, per_rank_batch=2, seed=9, dtype=torch.float32)
        model = _seeded(DeepMLP, 6, dtype=torch.float32)
    model, opt = _setup(model)
    engine = engine_of(model, "test")
    train_steps(model, opt, batches[:1])                                  # Adam state exists now
    models.loss_fn(model, models.shard_batch(batches[1], rank, world)).backward()
    report = zp.memory_report(model, opt)

    sps = list(engine.sharded.values())
    seen: set = set()
    own = {"params": _storage_bytes([p.data for p in model.parameters()] + [sp.unsharded for sp in sps], seen),
           "grads": _storage_bytes([sp.sharded_grad for sp in sps] + [p.grad for p in model.parameters()], seen),
           "optimizer": _storage_bytes([v for s in opt.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor)], seen)}
    own["total"] = sum(own.values())
    trainable = [sp for sp in sps if sp.param.requires_grad]
    step_bytes = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values()
                     if isinstance(s.get("step"), torch.Tensor))
    exact = {"params": 4 * sum(sp.layout.local_numel for sp in sps),
             "grads": 4 * sum(sp.layout.local_numel for sp in trainable),
             "optimizer": 8 * sum(sp.layout.local_numel for sp in trainable) + step_bytes}
    exact["total"] = sum(exact.values())
    psi = sum(sp.layout.numel for sp in sps)
    return {"measured": report["measured"], "theory": report["theory"], "own": own, "exact": exact,
            "psi": psi, "padded": sum(sp.layout.padded_numel for sp in sps),
            "sixteen_psi_over_n": 16 * psi / world, "n_params": len(sps), "step_bytes": step_bytes,
            "unsharded_bytes": sum(sp.unsharded.untyped_storage().nbytes() for sp in sps),
            "param_grads": sum(p.grad is not None for p in model.parameters()),
            "unsharded_units": _unsharded(model)}


# ---------------------------------------------------------------------------------------------------------------
# communication volume

def _unit_bytes(unit, trainable_only: bool, padded: bool = True) -> int:
    sps = unit.trainable if trainable_only else unit.params
    return sum((sp.layout.padded_numel if padded else sp.layout.numel) * sp.unsharded.element_size() for sp in sps)


def comm_worker(kind: str, steps: int = 2, buffered: bool = False) -> dict:
    """Logical bytes per step (forward + backward + step) against the unit structure.

    ``buffered``: the rank-major layout NCCL uses (forced on gloo); otherwise gloo's in-place layout,
    where a gather is a tag exchange plus in-place broadcasts of exact regions and a reduction sums
    the gradients in place, its has-gradient flags in a float32 all-reduce of their own."""
    from tests.unit.memory_comm_workers import collectives_layout

    with collectives_layout(buffered):
        return _comm_worker(kind, steps, buffered)


def _comm_worker(kind: str, steps: int, buffered: bool) -> dict:
    _, world = _rank_world()
    if kind == "llama":
        batches = models.make_batches("llama", steps + 1, world, per_rank_batch=2, seed=10)
        model = models.make_tiny_llama(layers=2)
    else:
        batches = models.make_batches("mlp", steps + 1, world, per_rank_batch=2, seed=10)
        model = _seeded(DeepMLP, 6)
    model, opt = _setup(model)
    engine = engine_of(model, "test")
    train_steps(model, opt, batches[:1])          # warm-up: records the forward order, creates Adam state
    zp.reset_comm_stats()
    train_steps(model, opt, batches[1:])
    stats = zp.comm_stats()
    root, blocks = engine.units[0], engine.units[1:]
    gathered = [u for u in engine.units if any(sp.layout.numel for sp in u.params)]   # one collective each
    reduced = [u for u in engine.units if any(sp.layout.numel for sp in u.trainable)]
    elem = next(iter(engine.sharded.values())).unsharded.element_size()
    # root and the last unit of the forward order: once per step (kept from forward into backward,
    # [Note: last unit kept] in hooks.py); every other block: forward + backward
    kept = {id(root), id(engine.runtime.forward_order[-1])}
    times = {id(u): 1 if id(u) in kept else 2 for u in engine.units}
    gathers = sum(times[id(u)] for u in gathered)
    payload = {
        "all_gather": {"calls": gathers * (1 if buffered else 2),   # in place: the tag exchange goes first
                       "bytes": sum(times[id(u)] * _unit_bytes(u, False, buffered) for u in engine.units)},
        "reduce_scatter": {"calls": len(reduced), "bytes": sum(_unit_bytes(u, True, buffered) for u in engine.units)},
        # the step's one "some rank has inf/NaN" flag (optim/loss_scale.py, 4 bytes counted twice); in place
        # also one float32 has-gradient flag per trainable parameter of every reduced unit
        "all_reduce": {"calls": 1 + (0 if buffered else len(reduced)),
                       "bytes": 8 + (0 if buffered else sum(2 * 4 * len(u.trainable) for u in reduced))},
    }
    # Collectives may carry a few metadata elements per rank besides the payload (a unit tag, one
    # has-gradient flag per parameter); at most (parameters in the unit + 4) elements per rank.
    metadata_bound = {
        "all_gather": sum(times[id(u)] * world * (len(u.params) + 4) * max(elem, 4) for u in gathered),
        "reduce_scatter": sum(world * (len(u.trainable) + 4) * elem for u in reduced),
    }
    per_step = {k: {"calls": v["calls"] / steps, "bytes": v["bytes"] / steps} for k, v in stats.items()}
    return {"per_step": per_step, "payload": payload, "metadata_bound": metadata_bound, "elem": elem,
            "psi": sum(sp.layout.numel for sp in engine.sharded.values()),
            "padded": sum(sp.layout.padded_numel for sp in engine.sharded.values()),
            "padding_bound": (world - 1) * len(engine.sharded) * elem,   # bytes, per pass over every parameter
            "root_padded_bytes": sum(_unit_bytes(u, False, buffered) for u in engine.units if id(u) in kept)}


# ---------------------------------------------------------------------------------------------------------------
# a branch taken on one rank only

def branch_worker(skipped_is_larger: bool, skip_block: int = 2, skip_rank: int = 1, steps: int = 2,
                  debug: bool = False) -> dict:
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
    return {"losses": got["losses"], "finite": all(math.isfinite(v) for v in got["losses"]),
            "lora_moved": min((after[n] - before[n]).abs().max().item() for n in lora),
            "base_moved": max((after[n] - before[n]).abs().max().item() for n in base),
            "update_norm_error": models.update_norm_error(after, ref["params"], ref["init"]),
            "n_lora": len(lora), "unsharded_after": _unsharded(model)}
