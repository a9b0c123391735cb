"""Functions that run inside the ranks of ``tests/parity/test_parity_stages012.py``.

They are module-level so the worker pool can pickle them by reference; every
argument and result is plain Python or CPU tensors. The model and optimizer
builders are also used by the single-process reference in the parent, so both
sides start from the same weights and the same param groups.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models

LR = 1e-2
KINDS = ("mlp", "mlp_frozen", "llama", "lora")


def build_model(kind: str):
    """Same weights on every call (seeded): OddMLP (float64), tiny tied Llama (fp32) or its LoRA variant."""
    if kind == "mlp":
        return models.make_odd_mlp()
    if kind == "mlp_frozen":
        model = models.make_odd_mlp()
        model.blocks[0].requires_grad_(False)
        return model
    if kind == "llama":
        return models.make_tiny_llama(layers=2)
    if kind == "lora":
        return models.make_tiny_llama_lora(layers=2)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")


def batch_kind(kind: str) -> str:
    return "mlp" if kind.startswith("mlp") else "llama"


def build_optimizer(model) -> torch.optim.AdamW:
    """AdamW with two groups that differ in lr and weight decay.

    Matrices go to group 0 (lr, wd 0.1) and vectors to group 1 (lr / 2, wd 0);
    LoRA has only matrices, so its ``lora_B`` matrices form group 1 instead.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    first = [p for n, p in named if p.ndim >= 2 and "lora_B" not in n]
    second = [p for n, p in named if not (p.ndim >= 2 and "lora_B" not in n)]
    assert first and second, "both param groups must be non-empty"
    return torch.optim.AdamW(
        [{"params": first, "lr": LR, "weight_decay": 0.1}, {"params": second, "lr": LR / 2, "weight_decay": 0.0}], lr=LR
    )


def build_scheduler(optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.2)


def _train(model, opt, batches, steps: int, accum: int, max_norm: float, scheduler=None) -> dict:
    """The user's loop: accumulation (all but the last micro-batch under no_sync), clip, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, norms, lrs = [], [], []
    for step in range(steps):
        step_loss = 0.0
        micro_batches = batches[step * accum : (step + 1) * accum]
        for i, micro in enumerate(micro_batches):
            local = models.shard_batch(micro, rank, world)
            sync = contextlib.nullcontext() if i == accum - 1 else zp.no_sync(model)
            with sync:
                value = models.loss_fn(model, local)
                (value / accum).backward()
            step_loss += value.item() / accum
        losses.append(step_loss)
        norms.append(float(zp.clip_grad_norm_(model, max_norm)))
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {"losses": losses, "clip_norms": norms, "lrs": lrs}


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parity_worker(
    kind: str,
    stage: int,
    batches: list,
    steps: int,
    accum: int,
    max_norm: float,
    use_scheduler: bool = False,
    buffered: bool = False,
) -> dict:
    """Train through zero_plugin; rank 0 also returns the full model and optimizer state dicts.
    ``buffered``: the rank-major collective layout NCCL uses, forced on gloo (collectives.py)."""
    from tests.unit.memory_comm_workers import collectives_layout

    with collectives_layout(buffered):
        model, opt = _setup(kind, stage)
    scheduler = build_scheduler(opt) if use_scheduler else None
    out = _train(model, opt, batches, steps, accum, max_norm, scheduler)
    out["params"] = _params(model)  # stages 0-2: every rank holds the full, re-gathered parameters
    out["full_state_dict"] = zp.full_state_dict(model)
    out["optim_full"] = opt.consolidate_state_dict()
    return out


def frozen_worker(stage: int, batches: list, steps: int, accum: int, max_norm: float) -> dict:
    """OddMLP with ``blocks.0`` frozen: what the frozen parameters hold after backward and after step."""
    kind = "mlp_frozen"
    model = build_model(kind)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in frozen.items()}
    model, opt = zp.setup(model, build_optimizer(model), zp.ZeroConfig(stage=stage))
    out = _train(model, opt, batches, steps, accum, max_norm)
    out["params"] = _params(model)
    # One more backward + step, looking at the frozen parameters between the two.
    loss = models.loss_fn(model, models.shard_batch(batches[0], dist.get_rank(), dist.get_world_size()))
    loss.backward()
    out["frozen_grad_after_backward"] = {n: p.grad is not None for n, p in frozen.items()}
    opt.step()
    out["frozen_grad_after_step"] = {n: p.grad is not None for n, p in frozen.items()}
    frozen_ids = {id(p) for p in frozen.values()}
    out["frozen_in_optimizer"] = any(id(p) in frozen_ids for g in opt.param_groups for p in g["params"])
    out["frozen_with_state"] = any(id(p) in frozen_ids for p in opt.state)
    out["n_state_entries"] = len(opt.state)
    out["n_optimizer_params"] = sum(len(g["params"]) for g in opt.param_groups)
    out["frozen_unchanged"] = all(torch.equal(before[n], p) for n, p in frozen.items())
    opt.zero_grad()
    optim_full = opt.consolidate_state_dict(to_rank=None)
    out["optim_param_names"] = [n for g in optim_full["param_groups"] for n in g["param_names"]]
    out["frozen_names"] = sorted(frozen)
    return out


def _shard_tensors(sd: dict) -> dict:
    return {(i, k): v for i, entry in sd["state"].items() for k, v in entry.items() if isinstance(v, torch.Tensor)}


def _max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(
        ((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()) if x.numel()), default=0.0
    )


def _setup(kind: str, stage: int, perturb_seed: int | None = None):
    """``zp.setup`` of a fresh model; ``perturb_seed`` moves its weights away from the seeded init."""
    model = build_model(kind)
    if perturb_seed is not None:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return zp.setup(model, build_optimizer(model), zp.ZeroConfig(stage=stage))


def _groups_without_params(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def roundtrip_worker(kind: str, stage: int, batches: list, steps: int, accum: int, max_norm: float) -> dict:
    """Train, then rebuild a fresh (differently initialised) setup from the full model and optimizer
    state dicts; its shards must equal the originals and both must take the same next step.
    """
    model, opt = _setup(kind, stage)
    _train(model, opt, batches, steps, accum, max_norm)
    model_full = zp.full_state_dict(model)  # rank 0 only
    optim_full = opt.consolidate_state_dict(to_rank=None)  # every rank
    shard = opt.state_dict()

    fresh, fresh_opt = _setup(kind, stage, perturb_seed=1234)
    zp.load_full_state_dict(fresh, model_full if dist.get_rank() == 0 else None, src_rank=0)
    fresh_opt.load_state_dict(optim_full)
    out = {
        "params_after_load": _max_diff(_params(model), _params(fresh)),
        "shard_after_full_load": _max_diff(_shard_tensors(shard), _shard_tensors(fresh_opt.state_dict())),
        "groups_after_full_load": _groups_without_params(fresh_opt) == _groups_without_params(opt),
        "full_after_full_load": _max_diff(
            _shard_tensors(optim_full), _shard_tensors(fresh_opt.consolidate_state_dict(to_rank=None))
        ),
    }
    # A shard (this rank's state_dict) loads back into the same layout too.
    _, third_opt = _setup(kind, stage)
    third_opt.load_state_dict(shard)
    out["shard_after_shard_load"] = _max_diff(_shard_tensors(shard), _shard_tensors(third_opt.state_dict()))

    # The next step from the loaded state equals the next step of the original.
    before_next = _params(model)
    _train(model, opt, batches[:accum], 1, accum, max_norm)
    _train(fresh, fresh_opt, batches[:accum], 1, accum, max_norm)
    out["params_after_next_step"] = _max_diff(_params(model), _params(fresh))
    out["moved_by_next_step"] = _max_diff(_params(model), before_next)
    return out


def resume_worker(
    kind: str, stage: int, params: dict, optim_state: dict, batches: list, steps: int, accum: int, max_norm: float
) -> dict:
    """Start from an unsharded run's parameters and ``torch.optim.AdamW.state_dict()``, then keep training."""
    model, opt = _setup(kind, stage)
    zp.load_full_state_dict(model, params if dist.get_rank() == 0 else None, src_rank=0)
    opt.load_state_dict(optim_state)
    out = _train(model, opt, batches, steps, accum, max_norm)
    out["params"] = _params(model)
    return out


class TwoHeadMLP(torch.nn.Module):
    """A body and two heads; each step uses one head, so the other is unused on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(models.MLP_IN, 15)
        self.head_a = torch.nn.Linear(15, 3)
        self.head_b = torch.nn.Linear(15, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return (self.head_b if use_b else self.head_a)(torch.tanh(self.body(x)))


def train_two_head(stage: int | None, x: torch.Tensor, y: torch.Tensor, use_b: list[bool]) -> dict:
    """AdamW steps on :class:`TwoHeadMLP` (float64); ``stage=None`` is plain single-process torch."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TwoHeadMLP().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if stage is not None:
        model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage))
        x, y = (models.shard_batch(t, dist.get_rank(), dist.get_world_size()) for t in (x, y))
    for flag in use_b:
        torch.nn.functional.mse_loss(model(x, flag), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def mixed_precision_roundtrip_worker(stage: int) -> dict:
    """bf16 params with fp32 masters: save through full_state_dict + consolidate_state_dict, load into a
    fresh setup; are the fp32 masters the optimizer steps the same as before?
    """
    config = zp.ZeroConfig(stage=stage, param_dtype="bf16")

    def fresh_setup():
        model = models.make_odd_mlp(dtype=torch.float32)
        return zp.setup(model, build_optimizer(model), config)

    model, opt = fresh_setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    for micro in models.make_batches("mlp", 3, world, 2, dtype=torch.bfloat16):
        models.loss_fn(model, models.shard_batch(micro, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    model_sd = zp.full_state_dict(model)
    optim_sd = opt.consolidate_state_dict(to_rank=None)
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]

    loaded, loaded_opt = fresh_setup()
    zp.load_full_state_dict(loaded, model_sd if rank == 0 else None, src_rank=0)
    loaded_opt.load_state_dict(optim_sd)
    loaded_masters = [p.detach().clone() for g in loaded_opt.param_groups for p in g["params"]]
    return {
        "master_dtypes": sorted({str(m.dtype) for m in masters}),
        "state_dict_dtypes": sorted({str(v.dtype) for v in model_sd.values()}),
        "master_max_diff": _max_diff(dict(enumerate(masters)), dict(enumerate(loaded_masters))),
    }
