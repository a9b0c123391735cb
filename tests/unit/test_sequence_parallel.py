"""Ulysses sequence parallelism's single-process parts (issue #50): the batch split, the loss's algebra against
ZeRO's average over all ranks, the setup refusals and the key/value head repeats; the configuration field.  The
multi-rank parity is tests/parity/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zero_plugin as zp
from tests.models import llama_config
from zero_plugin.sequence import attention, split_batch
from zero_plugin.sequence.loss import sequence_loss

# ------------------------------------------------------------------------------------------------ batch split


def test_split_keeps_contiguous_slices_of_positions_and_shifted_labels():
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, 3] = -100
    parts = [
        split_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8)}, r, 2) for r in (0, 1)
    ]
    assert set(parts[0]) == {"input_ids", "position_ids", "shift_labels"}  # the all-ones mask is dropped
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(8).expand(2, 8))
    expected = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    assert torch.equal(torch.cat([p["shift_labels"] for p in parts], 1), expected)
    assert parts[1]["position_ids"][0, 0] == 4


def test_split_pads_a_length_k_does_not_divide_at_the_end():
    ids = torch.arange(1, 8).view(1, 7)
    parts = [split_batch({"input_ids": ids, "labels": ids}, r, 3, pad_token_id=0) for r in range(3)]
    assert [p["input_ids"].shape[1] for p in parts] == [3, 3, 3]
    assert parts[2]["input_ids"].tolist() == [[7, 0, 0]]
    assert parts[2]["position_ids"].tolist() == [[6, 7, 8]]
    assert parts[2]["shift_labels"].tolist() == [[-100, -100, -100]]
    assert parts[1]["shift_labels"].tolist() == [[5, 6, 7]]


def test_split_takes_right_padding_with_ignored_labels_and_drops_the_mask():
    ids = torch.arange(1, 9).view(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    parts = [split_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, r, 2) for r in (0, 1)]
    assert set(parts[0]) == {"input_ids", "position_ids", "shift_labels"}
    assert torch.cat([p["shift_labels"] for p in parts], 1).tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]


def test_split_refuses_padding_masks_packed_rows_and_unknown_tensors():
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask has zeros"):  # no labels to show the pads are ignored
        split_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])}, 0, 2)
    with pytest.raises(ValueError, match="attention_mask has zeros"):  # left padding
        split_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]])}, 0, 2)
    with pytest.raises(ValueError, match="attention_mask has zeros"):  # a pad with a label
        split_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])}, 0, 2)
    with pytest.raises(ValueError, match="'pixel_values'"):
        split_batch({"input_ids": ids, "pixel_values": torch.ones(1, 3)}, 0, 2)
    with pytest.raises(ValueError, match="packed sequences"):
        split_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1]])}, 0, 2)
    assert split_batch({"input_ids": ids, "position_ids": torch.tensor([[5, 6, 7, 8]])}, 1, 2)[
        "position_ids"
    ].tolist() == [[7, 8]]
    with pytest.raises(ValueError, match="needs input_ids"):
        split_batch({"labels": ids}, 0, 2)


# ------------------------------------------------------------------------------------------------ the loss


class _GroupTotals:
    """A stand-in for a sequence-parallel group's Comm: its all-reduce returns the group's known totals."""

    def __init__(self, k: int, totals: torch.Tensor) -> None:
        self.world_size, self.totals = k, totals

    def all_reduce(self, tensor: torch.Tensor, tag: str = "") -> None:
        tensor.copy_(self.totals)


def test_loss_average_over_all_ranks_is_the_data_parallel_mean():
    """[Note: sequence-parallel loss]: D = 2 groups of K = 2 ranks; each rank's loss value is its group's
    whole-sequence loss, and the mean over the N = 4 ranks of their gradients (ZeRO's average) is the gradient of
    the mean over the groups of the whole-sequence losses.  Per-token logits (embedding x projection), so each
    rank's gradient is its own tokens'."""
    torch.manual_seed(0)
    k, groups, vocab, seq = 2, 2, 11, 8
    emb = torch.randn(vocab, 5, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(5, vocab, dtype=torch.float64, requires_grad=True)
    batches = []
    for g in range(groups):
        ids = torch.randint(0, vocab, (2, seq))
        labels = ids.clone()
        labels[torch.rand(2, seq) < 0.3 + 0.3 * g] = -100  # different counts per group
        batches.append({"input_ids": ids, "labels": labels})

    def logits(ids):
        return emb[ids] @ proj

    reference = torch.stack(
        [
            F.cross_entropy(
                logits(b["input_ids"]).flatten(0, 1), F.pad(b["labels"][:, 1:], (0, 1), value=-100).flatten()
            )
            for b in batches
        ]
    )
    want = torch.autograd.grad(reference.mean(), (emb, proj))

    grads, values = [torch.zeros_like(emb), torch.zeros_like(proj)], []
    for g, batch in enumerate(batches):
        parts = [split_batch(batch, r, k) for r in range(k)]
        sums = [
            F.cross_entropy(logits(p["input_ids"]).flatten(0, 1), p["shift_labels"].flatten(), reduction="sum").detach()
            for p in parts
        ]
        counts = [(p["shift_labels"] != -100).sum() for p in parts]
        totals = torch.stack([sum(sums), sum(counts).double()])
        for p in parts:
            loss = sequence_loss(logits(p["input_ids"]), p["shift_labels"], _GroupTotals(k, totals))
            values.append((g, loss.item()))
            for acc, grad in zip(grads, torch.autograd.grad(loss, (emb, proj))):
                acc += grad / (k * groups)  # ZeRO: the mean over all N ranks
    for g, value in values:
        assert value == pytest.approx(reference[g].item(), rel=1e-14)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)


# ------------------------------------------------------------------------------------------------ setup refusals


def _llama(heads: int, kv_heads: int, attn: str = "sdpa"):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(31, 8 * heads, heads=heads, kv_heads=kv_heads, attn_implementation=attn))


def test_check_model_refusals_name_the_numbers():
    with pytest.raises(ValueError, match="needs a transformers model"):
        attention.check_model(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads=6"):
        attention.check_model(_llama(6, 2), 4)
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' cannot run"):
        model = _llama(4, 2)
        model.config._attn_implementation = "flex_attention"
        attention.check_model(model, 2)
    pretrained, original = attention.check_model(_llama(4, 2, "eager"), 4)
    assert original == "eager"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "k", "repeats"), [(4, 2, 2, 1), (4, 2, 4, 2), (8, 1, 4, 4), (6, 2, 3, 3), (8, 4, 2, 1)]
)
def test_key_value_heads_repeated_to_whole_heads_per_rank(heads, kv_heads, k, repeats):
    """[Note: Ulysses attention]: H_kv R is a multiple of K and divides H, each rank's query heads use its own."""
    r = attention._kv_repeats(kv_heads, k)
    assert r == repeats
    assert (kv_heads * r) % k == 0 and heads % (kv_heads * r) == 0
    groups = heads // (kv_heads * r)
    for rank in range(k):
        q_heads = range(rank * heads // k, (rank + 1) * heads // k)
        kv_of_rank = range(rank * kv_heads * r // k, (rank + 1) * kv_heads * r // k)
        assert {h // groups for h in q_heads} <= set(kv_of_rank)


# ------------------------------------------------------------------------------------------------ config


def test_config_field():
    assert zp.ZeroConfig().sequence_parallel_size == 1
    config = zp.ZeroConfig(stage=3, sequence_parallel_size=2)
    assert config.comm.sequence_parallel_size == 2 and config.resolved_sequence_parallel_size(4) == 2
    assert zp.ZeroConfig.from_env({"ZERO_PLUGIN_SEQUENCE_PARALLEL_SIZE": "2"}) == zp.ZeroConfig(
        sequence_parallel_size=2
    )
    with pytest.raises(ValueError, match="sequence_parallel_size must be an int >= 1; got 0"):
        zp.ZeroConfig(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 must divide the world size 3"):
        config.resolved_sequence_parallel_size(3)


def test_helpers_refuse_a_model_not_set_up():
    with pytest.raises(ValueError, match="was not set up for sequence parallelism"):
        zp.sequence_parallel_batch({"input_ids": torch.ones(1, 4, dtype=torch.long)}, torch.nn.Linear(2, 2))


def test_the_split_refuses_a_batch_that_is_not_a_mapping_whatever_loader_brings_it():
    """The one loader (``zp.SequenceParallelLoader``, which the Accelerate and Lightning loaders are) looks its model
    up at the first batch when given a function, and the split names K for a tuple batch."""
    from types import SimpleNamespace

    from zero_plugin.sequence import parallel

    model = torch.nn.Linear(2, 2)
    parallel._OF_MODEL[model] = parallel.SequenceParallel(SimpleNamespace(world_size=2, rank=0), "sdpa", None)
    looked_up = []
    loader = zp.SequenceParallelLoader([(torch.ones(1, 4),)], lambda: looked_up.append(1) or model, check=False)
    assert not looked_up  # not before the first batch
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 splits batches that are mappings .* tuple"):
        next(iter(loader))
    assert looked_up == [1]
