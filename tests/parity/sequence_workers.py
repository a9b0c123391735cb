"""Workers of tests/parity/test_sequence_parallel.py: a small random-init Llama (GQA: 4 heads over 2 key/value
heads) trained with Ulysses sequence parallelism at each ZeRO stage, and the same model trained in one process on
the whole sequences, one loss per data-parallel group averaged (what D = N / K data-parallel ranks compute).

``CASES`` are run in one pool call per world size (workers reused); each returns the per-step losses every rank saw
and, on rank 0, the full parameters after training.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_plugin as zp
from tests.models import add_lora, llama_config, ranks_threads
from zero_plugin.sequence.offload import offload_of

VOCAB, HIDDEN, STEPS, BATCH, LR = 61, 32, 3, 2, 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    stage: int
    k: int
    offload: bool = False
    seq: int = 16
    attention: str = "sdpa"
    checkpointing: bool = False
    dtype: torch.dtype = torch.float64
    lora: bool = False
    offload_activations: bool = False
    options: tuple = ()
    """Other ZeroConfig fields, as (name, value) pairs."""

    @property
    def name(self) -> str:
        extra = ("+offload" if self.offload else "") + ("+checkpointing" if self.checkpointing else "")
        extra += "+offload_activations" if self.offload_activations else ""
        extra += ("+lora" if self.lora else "") + "".join(f"+{k}={v}" for k, v in self.options)
        return f"stage{self.stage}{extra}-K{self.k}-s{self.seq}-{self.attention}-{str(self.dtype)[6:]}"


def make_model(attention: str, dtype: torch.dtype = torch.float64, lora: bool = False):
    """The Llama; with ``lora``, PEFT LoRA (r 4) on q_proj and v_proj, lora_B drawn non-zero."""
    from transformers import LlamaForCausalLM

    config = llama_config(VOCAB, HIDDEN, layers=2, heads=4, kv_heads=2, attn_implementation=attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dtype)
    return add_lora(model, seed=1, scale=0.05) if lora else model


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_batches(groups: int, seq: int, seed: int = 1) -> list[list[dict]]:
    """``STEPS`` x ``groups`` batches of ``BATCH`` sequences; about a fifth of the labels (and one sequence's
    whole first half) are -100."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        row = []
        for _ in range(groups):
            ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
            labels = ids.clone()
            labels[torch.rand(BATCH, seq, generator=gen) < 0.2] = -100
            labels[0, : seq // 2] = -100
            row.append({"input_ids": ids, "labels": labels})
        out.append(row)
    return out


def whole_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unsplit reference: labels shifted as transformers does, per-token mean over the labels that count."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), reduction="sum")
    return total / (shifted != -100).sum()


def reference(case: Case, groups: int) -> dict:
    """One process, whole sequences: per step the mean over the data-parallel groups of each group's loss."""
    batches = make_batches(groups, case.seq)
    model = make_model(case.attention, case.dtype, case.lora)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(trainable(model), lr=LR)
    losses = []
    with ranks_threads():
        for step in range(STEPS):
            per_group = [
                whole_sequence_loss(model(input_ids=b["input_ids"]).logits, b["labels"]) for b in batches[step]
            ]
            torch.stack(per_group).mean().backward()
            opt.step()
            opt.zero_grad()
            losses.append([loss.item() for loss in per_group])
    with torch.no_grad():
        whole = batches[0][0]
        after = whole_sequence_loss(model(input_ids=whole["input_ids"]).logits, whole["labels"]).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "theta0": theta0, "params": params, "loss_after": after}


def train_case(case: Case) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(world // case.k, case.seq)
    model = make_model(case.attention, case.dtype, case.lora)
    if case.checkpointing:  # the attention's exchanges run again in the recompute, inside backward
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    config = zp.ZeroConfig(
        stage=case.stage,
        offload_optimizer="cpu" if case.offload else "none",
        offload_params=case.offload and case.stage == 3,
        sequence_parallel_size=case.k,
        offload_activations="cpu" if case.offload_activations else "none",
        **dict(case.options),
    )
    model, opt = zp.setup(model, torch.optim.SGD(trainable(model), lr=LR), config)
    setting = zp.sequence_parallel_of(model)
    assert (setting.size, setting.rank, setting.dp_rank, setting.dp_size) == (
        case.k,
        rank % case.k,
        rank // case.k,
        world // case.k,
    )
    zp.reset_comm_stats()
    losses = []
    loader = zp.SequenceParallelLoader([batches[step][setting.dp_rank] for step in range(STEPS)], model)
    assert len(loader) == STEPS
    for batch in loader:
        shift_labels = batch.pop("shift_labels")
        logits = model(**batch).logits
        loss = zp.sequence_parallel_loss(logits, shift_labels, model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = zp.comm_stats()
    offload = offload_of(model)
    with setting.paused(), torch.no_grad():  # the original attention on whole sequences, e.g. an evaluation
        whole = batches[0][0]
        paused_loss = whole_sequence_loss(model(input_ids=whole["input_ids"]).logits, whole["labels"]).item()
    assert model.config._attn_implementation == "zero_plugin_ulysses"
    full = zp.full_state_dict(model)
    return {
        "losses": losses,
        "paused_loss": paused_loss,
        "all_to_all_calls": stats.get("all_to_all", {}).get("calls", 0),
        "sequence_group_calls": stats.get("sequence_group", {}).get("calls", 0),
        "offload": dataclasses.asdict(offload.stats) if offload is not None else None,
        "params": {n: t.to(torch.float64) for n, t in full.items() if n in dict(model.named_parameters())},
    }


def train_cases(cases: list[Case]) -> list[dict]:
    return [train_case(case) for case in cases]


def refused(k: int, heads: int, kv_heads: int) -> str:
    """The error ``zp.setup`` raises for a model whose heads ``k`` does not divide (every rank raises it)."""
    from transformers import LlamaForCausalLM

    config = llama_config(VOCAB, 24, heads=heads, kv_heads=kv_heads, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    try:
        zp.setup(model, torch.optim.SGD(model.parameters(), lr=LR), zp.ZeroConfig(stage=1, sequence_parallel_size=k))
    except ValueError as exc:
        return str(exc)
    return "not refused"


def offload_without_checkpointing() -> str:
    """``offload_activations="cpu"`` on a model that checkpoints nothing is refused at setup."""
    model = make_model("sdpa")
    config = zp.ZeroConfig(stage=2, sequence_parallel_size=2, offload_activations="cpu")
    try:
        zp.setup(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def mixed_batches() -> str:
    """A group whose ranks got different sequences is refused by the batch check."""
    model = make_model("sdpa")
    model, _ = zp.setup(
        model, torch.optim.SGD(model.parameters(), lr=LR), zp.ZeroConfig(stage=1, sequence_parallel_size=2)
    )
    ids = torch.full((1, 8), dist.get_rank())
    try:
        zp.sequence_parallel_batch({"input_ids": ids}, model)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def unsplit_forward() -> str:
    """A forward on a batch that did not go through the split (whole, different sequences per rank, as a Trainer
    loop would pass) is refused by the attention instead of training on mixed-up slices."""
    model = make_model("sdpa")
    config = zp.ZeroConfig(stage=2, sequence_parallel_size=2)
    model, _ = zp.setup(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    try:
        model(input_ids=torch.full((1, 8), dist.get_rank()))
    except ValueError as exc:
        return str(exc)
    return "not refused"
