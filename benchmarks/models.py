"""The benchmark model and data: a randomly initialised Llama-style decoder, no downloads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SIZES", "ModelSize", "build_model", "make_batch", "decoder_layers"]


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int


SIZES = {
    "smoke": ModelSize(hidden=256, layers=2, intermediate=688, vocab=8000, heads=4),  # ~5.7M
    # transformer blocks ~75% of the parameters, as in real LLMs (vocabulary 8k)
    "blocks34m": ModelSize(hidden=512, layers=8, intermediate=1376, vocab=8192, heads=8),  # ~34M
    "35m": ModelSize(hidden=384, layers=6, intermediate=1024, vocab=32000, heads=6),  # ~35M
    "small": ModelSize(hidden=512, layers=8, intermediate=1376, vocab=32000, heads=8),  # ~58M
    "blocks117m": ModelSize(hidden=768, layers=13, intermediate=2048, vocab=16384, heads=12),  # ~117M, blocks ~79%
    "370m": ModelSize(hidden=1024, layers=24, intermediate=2816, vocab=32000, heads=16),  # ~374M, blocks ~82%
    "medium": ModelSize(hidden=768, layers=10, intermediate=2048, vocab=32000, heads=12),  # ~120M
}


def build_model(size: str, seed: int) -> nn.Module:
    """A fresh ``LlamaForCausalLM`` in fp32 with weights fixed by ``seed`` (identical on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    config = LlamaConfig(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.train()
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def make_batch(vocab: int, batch: int, seq: int, seed: int, rank: int, step: int) -> torch.Tensor:
    """Random token ids; a function of (seed, rank, step) only, so every variant sees the same data."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return torch.randint(0, vocab, (batch, seq), generator=gen)
