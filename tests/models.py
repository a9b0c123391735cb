"""Test models, deterministic data and the single-process reference for parity tests.

Parity recipe: ``batches = make_batches(kind, steps * accum, N, per_rank_batch, seed)``
is a list of GLOBAL micro-batches; rank ``r`` trains on ``shard_batch(micro, r, N)``
while ``reference_train`` trains one process on each whole ``micro``. Per-rank
batch sizes are equal, so the mean of the ranks' mean losses is the global mean.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn

MLP_IN, MLP_HIDDEN, MLP_OUT = 7, 15, 13
LLAMA_VOCAB, LLAMA_SEQ = 97, 12


class OddBlock(nn.Module):
    """Linear -> LayerNorm -> tanh; shapes like (7, 15) force padding for 2-4 ranks."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x)))


class OddMLP(nn.Module):
    """Three ``OddBlock`` units (stage-3 wrap targets) plus a head outside them.

    ``offset`` (3,) starts at zero and ``scale`` (1,) has fewer elements than
    ranks, so some ranks own an empty or all-padding shard of it.
    """

    _no_split_modules = ["OddBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [OddBlock(MLP_IN, MLP_HIDDEN), OddBlock(MLP_HIDDEN, MLP_HIDDEN), OddBlock(MLP_HIDDEN, MLP_HIDDEN)]
        )
        self.head = nn.Linear(MLP_HIDDEN, MLP_OUT)
        self.offset = nn.Parameter(torch.zeros(3))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale + F.pad(self.offset, (0, MLP_OUT - 3))


def make_odd_mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> OddMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return OddMLP().to(dtype)


def llama_config(
    vocab: int,
    hidden: int,
    *,
    intermediate: int | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 64,
    tie: bool = False,
    **fields,
):
    """A small random-init Llama's ``LlamaConfig``, the one place the tests spell one out.

    ``vocab`` x ``hidden`` the embedding; ``intermediate`` the MLP width (default ``2 * hidden``); ``layers``
    decoder layers of ``heads`` attention heads over ``kv_heads`` key/value heads (GQA; ``hidden / heads`` must be
    even for rotary); ``max_positions`` the rotary table's length; ``tie`` ties ``lm_head`` to the embedding.
    ``fields``: any other ``LlamaConfig`` field as is (``use_cache``, ``attn_implementation``, token ids, e.g.
    ``**token_ids_of(tokenizer)``).  The defaults are values of the callers that leave them out, some of which compare
    numbers (parity, launched scripts against DDP): change one only after passing it explicitly everywhere."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        **fields,
    )


def token_ids_of(tokenizer) -> dict:
    """A tokenizer's end and padding ids for ``llama_config(**...)``; no beginning-of-sequence token (the examples'
    tokenizers have none)."""
    return {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def save_random_llama(folder, config, seed: int = 0, tokenizer=None):
    """``torch.manual_seed(seed)`` (the global generator, as a from-scratch script seeds it), a random-init
    ``LlamaForCausalLM`` on ``config`` written to ``folder`` with ``save_pretrained`` (``tokenizer`` beside it);
    returns the model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model


def _llama_config(tie: bool, layers: int):
    # head_dim = 40 / 4 = 10 (rotary needs it even); 97, 54 and 40*97 are odd sizes.
    return llama_config(LLAMA_VOCAB, 40, intermediate=54, layers=layers, tie=tie, attn_implementation="eager")


def planner_llama_config(tied: bool = False):
    """The planner tests' Llama config (hidden 64, 2 layers, vocab 320): sizes that round to readable
    numbers; planned on the meta device or saved as a config folder, never trained."""
    return llama_config(320, 64, intermediate=160, max_positions=128, tie=tied, use_cache=False)


REAL_VOCAB, REAL_HIDDEN = 4096, 256  # an LM head of 2^20 elements: a stage-3 unit of its own when untied


def real_llama_config(tie: bool = False, layers: int = 2, vocab: int = REAL_VOCAB):
    """A Llama config of real proportions at small depth: vocabulary 4096 x hidden 256, so an untied
    ``lm_head`` (and ``embed_tokens``) holds 2^20 elements and is a stage-3 leaf unit ([Note: leaf units] in
    zero_plugin/stage3/policy.py), as a 32k x 4096 head is; GQA (8 heads, 2 key/value heads), head_dim 32.
    ``vocab``: a tokenizer's real size, padded to a multiple of 64 by the caller if it wants."""
    return llama_config(
        vocab,
        REAL_HIDDEN,
        layers=layers,
        heads=8,
        max_positions=128,
        tie=tie,
        use_cache=False,
        attn_implementation="eager",
    )


def make_real_llama(seed: int = 0, tie: bool = False, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A randomly initialised ``LlamaForCausalLM`` on ``real_llama_config`` (no download)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(real_llama_config(tie, layers)).to(dtype)
    if (model.lm_head.weight is model.model.embed_tokens.weight) != tie:
        raise AssertionError(f"tie_word_embeddings={tie} but lm_head tied={not tie}")
    return model


def make_tiny_llama(seed: int = 0, tie: bool = True, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A randomly initialised ``LlamaForCausalLM`` (no download)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(_llama_config(tie, layers)).to(dtype)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied != tie:
        raise AssertionError(f"tie_word_embeddings={tie} but lm_head tied={tied}")
    return model


def add_lora(model: nn.Module, seed: int, scale: float) -> nn.Module:
    """``model`` with PEFT LoRA (r 4, alpha 8) on q_proj and v_proj, its lora_B drawn ``scale`` x N(0, 1) from
    ``seed`` (not zero, so that the first step already changes the output); the global RNG is left as it was."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(scale * torch.randn_like(param))
    return model


def make_tiny_llama_lora(seed: int = 0, tie: bool = True, dtype: torch.dtype = torch.float32, layers: int = 2):
    """Tiny llama with LoRA (r=4) on q_proj/v_proj.

    lora_B is re-drawn non-zero (seeded) so the first step already changes the output.
    """
    from peft import LoraConfig, get_peft_model

    model = make_tiny_llama(seed=seed, tie=tie, dtype=dtype, layers=layers)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(seed)
        model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Mean loss: causal-LM loss for dict batches, MSE for ``(x, target)`` tuples."""
    if isinstance(batch, dict):
        return model(**batch).loss
    x, target = batch
    return F.mse_loss(model(x), target)


def make_batches(
    kind: str, steps: int, world_size: int, per_rank_batch: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> list:
    """``steps`` GLOBAL batches of ``world_size * per_rank_batch`` rows, learnable targets.

    "mlp": ``(x (B, 7), target (B, 13))`` in ``dtype``; "llama": ``{"input_ids", "labels"}``
    of shape (B, 12), arithmetic sequences mod 97 so the loss can fall.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = world_size * per_rank_batch
    if kind == "mlp":
        w_true = torch.randn(MLP_IN, MLP_OUT, generator=gen, dtype=torch.float64) / MLP_IN**0.5
        out = []
        for _ in range(steps):
            x = torch.randn(rows, MLP_IN, generator=gen, dtype=torch.float64)
            out.append((x.to(dtype), torch.tanh(x @ w_true).to(dtype)))
        return out
    if kind == "llama":
        out = []
        for _ in range(steps):
            start = torch.randint(0, LLAMA_VOCAB, (rows, 1), generator=gen)
            stride = torch.randint(1, 4, (rows, 1), generator=gen)
            ids = (start + stride * torch.arange(LLAMA_SEQ)) % LLAMA_VOCAB
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out
    raise ValueError(f"kind must be 'mlp' or 'llama', got {kind!r}")


def shard_batch(global_batch, rank: int, world_size: int):
    """Rank ``rank``'s contiguous slice (dim 0) of a tensor, tuple/list or dict batch."""
    if isinstance(global_batch, dict):
        return {k: shard_batch(v, rank, world_size) for k, v in global_batch.items()}
    if isinstance(global_batch, (tuple, list)):
        return type(global_batch)(shard_batch(v, rank, world_size) for v in global_batch)
    rows = global_batch.shape[0]
    if rows % world_size:
        raise ValueError(f"batch of {rows} rows does not split over {world_size} ranks")
    per_rank = rows // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]


def two_group_adamw(model: nn.Module, lr: float = 1e-2, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW: matrices (wd 0.1, lr) and vectors (biases/norms/scalars: wd 0, lr / 2); ``fused=True`` is torch's
    fused kernel (the one the offload optimizer's CPU step runs)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1, "lr": lr},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": lr / 2},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=fused)


def _clone_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def ranks_threads():
    """Run a single-process reference on one intra-op thread, as every rank does (tests/harness.py): float64
    matmuls block differently on two threads, and the tiny Llama's float32 casts (norms, softmax, loss) turn the
    last-bit differences into ~1e-8 in the weights after a few Adam steps on some CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_train(
    model_fn, opt_fn, batches: list, steps: int, accum: int = 1, clip: float | None = None, loss=loss_fn
) -> dict:
    """Single-process training on GLOBAL micro-batches ``batches[step * accum + i]``.

    Returns ``losses`` (per step, mean over its micro-batches), ``micro_losses``,
    ``clip_norms`` (pre-clip total norm per step, empty without ``clip``),
    ``init_params`` and ``params`` (``{name: tensor}`` before and after), ``state`` (the state dict after: tied
    aliases and buffers too).
    """
    if len(batches) < steps * accum:
        raise ValueError(f"need {steps * accum} micro-batches, got {len(batches)}")
    with ranks_threads():
        return _reference_train(model_fn, opt_fn, batches, steps, accum, clip, loss)


def _reference_train(model_fn, opt_fn, batches: list, steps: int, accum: int, clip: float | None, loss) -> dict:
    model = model_fn()
    opt = opt_fn(model)
    out = {"losses": [], "micro_losses": [], "clip_norms": [], "init_params": _clone_params(model)}
    for step in range(steps):
        step_loss = 0.0
        for micro in batches[step * accum : (step + 1) * accum]:
            value = loss(model, micro)
            (value / accum).backward()
            out["micro_losses"].append(value.item())
            step_loss += value.item() / accum
        out["losses"].append(step_loss)
        if clip is not None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            out["clip_norms"].append(torch.nn.utils.clip_grad_norm_(trainable, clip).item())
        opt.step()
        opt.zero_grad()
    out["params"] = _clone_params(model)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _flat(params: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([params[n].detach().reshape(-1).to(torch.float64) for n in names])


def update_norm_error(theta: dict, theta_ref: dict, theta0: dict) -> float:
    """‖θ − θ_ref‖ / ‖θ_ref − θ0‖ over all parameters of ``theta_ref``, concatenated."""
    names = sorted(theta_ref)
    ref = _flat(theta_ref, names)
    num = torch.linalg.vector_norm(_flat(theta, names) - ref).item()
    den = torch.linalg.vector_norm(ref - _flat(theta0, names)).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest elementwise |a − b| over two dicts of tensors with the same keys."""
    if a.keys() != b.keys():
        raise KeyError(
            f"key mismatch: only in a {sorted(a.keys() - b.keys())}, only in b {sorted(b.keys() - a.keys())}"
        )
    diffs = [(a[k].detach().double() - b[k].detach().double()).abs() for k in a]
    return max((float(d.max()) for d in diffs if d.numel()), default=0.0)
