"""The batch split: positions and shifted labels computed on the whole sequences, then this rank's contiguous 1/K
of every sequence tensor kept.

[Note: sequence-parallel batch]
A causal LM's loss at token t compares the logits at t with the label at t + 1, and rotary embeddings read t's
position; once a sequence is cut in K slices, rank r neither sees the label after its last token nor knows where
its slice starts.  So both are computed before the cut, on the whole sequence: ``position_ids`` 0..s-1 (or the
batch's own) and ``shift_labels`` = ``labels[:, 1:]`` followed by -100 (transformers' ``shift_labels``), and each
rank keeps columns [r s/K, (r+1) s/K) of ``input_ids``, ``position_ids`` and ``shift_labels``.  A length that K
does not divide is padded at the end to the next multiple: the pad tokens come after every real token, so under
causal attention they change no real token's output, and their labels are -100.  The ranks of a group must hold
the same batch (a sampler over the data-parallel ranks, ``SequenceParallel.dp_rank`` / ``dp_size``); a cheap
checksum of ``input_ids`` is compared across the group on every batch so that a sampler over all N ranks fails
loudly instead of training on mixed-up sequences.  The Ulysses attention masks causally over the whole row only
([Note: Ulysses attention] in ``attention.py``), so packed rows (positions that restart) are refused, and so is
a padding mask, except right padding (each row's ones, then its zeros, as the HF and TRL collators pad) whose
padded labels are all -100: the pad tokens come after every real token of their row, so causal attention keeps
them out of every real token's context, and no loss is taken at them or of them (the last real token's shifted
label is the first pad's -100).  Real tokens' outputs and the loss are then the masked model's; the mask is
dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from ..comm.collectives import Comm
from .parallel import sequence_parallel_of

__all__ = ["IGNORE_INDEX", "SequenceParallelLoader", "expect_batch", "sequence_parallel_batch", "split_batch"]

IGNORE_INDEX = -100
"""The label cross-entropy ignores (torch's and transformers' default)."""


def split_batch(batch: Mapping[str, Any], rank: int, k: int, pad_token_id: int = 0) -> dict[str, Any]:
    """[Note: sequence-parallel batch] for rank ``rank`` of ``k``, no communication: ``batch`` holds
    ``input_ids`` ``[b, s]`` and optionally ``labels``, ``position_ids`` and an all-ones (or None)
    ``attention_mask``; the result holds this rank's ``[b, ceil(s / k)]`` slices of ``input_ids``,
    ``position_ids`` and, with labels, ``shift_labels``.  Values that are not tensors pass through."""
    if "input_ids" not in batch:
        raise ValueError(f"sequence parallelism: the batch needs input_ids [batch, seq]; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"sequence parallelism: input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    _check_mask(batch.get("attention_mask"), batch.get("labels"))
    whole: dict[str, torch.Tensor] = {"input_ids": input_ids}
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    elif s > 1 and not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(
            "sequence parallelism: position_ids restart or jump inside a row (packed sequences), which the Ulysses "
            "attention cannot keep apart (it masks causally over the whole row); pass one sequence per row"
        )
    whole["position_ids"] = position_ids.expand(b, s)
    if batch.get("labels") is not None:
        labels = batch["labels"]
        whole["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    rest = {}
    for key, value in batch.items():
        if key in ("input_ids", "position_ids", "labels", "attention_mask"):
            continue
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"sequence parallelism: the batch's {key!r} (shape {tuple(value.shape)}) is a tensor the split does "
                "not know how to cut; pass input_ids, labels, position_ids and an all-ones attention_mask only"
            )
        rest[key] = value
    return {**rest, **{key: _slice(t, rank, k, _pad_value(key, pad_token_id)) for key, t in whole.items()}}


def _check_mask(mask: torch.Tensor | None, labels: torch.Tensor | None) -> None:
    """Only right padding with -100 labels under it ([Note: sequence-parallel batch])."""
    if mask is None or bool((mask == 1).all()):
        return
    right_padding = bool(((mask == 0) | (mask == 1)).all()) and bool((mask.diff(dim=-1) <= 0).all())
    if not right_padding or labels is None or bool((labels[mask == 0] != IGNORE_INDEX).any()):
        raise ValueError(
            "sequence parallelism: attention_mask has zeros that are not right padding with labels -100 under "
            "them, which the Ulysses attention cannot mask (it masks causally over the whole sequence only); pad "
            "at the end (padding_side='right') with labels -100, one sequence per row"
        )


def _pad_value(key: str, pad_token_id: int) -> int:
    return {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX}.get(key, -1)


def _slice(t: torch.Tensor, rank: int, k: int, pad: int) -> torch.Tensor:
    """Columns [rank s', (rank+1) s') of ``t`` padded at the end to k s' columns (s' = ceil(s / k)); positions
    continue past the end (their tokens are never a real token's context)."""
    s = t.shape[1]
    per_rank = -(-s // k)
    if per_rank * k != s:
        if pad == -1:  # positions: keep counting
            tail = t[:, -1:] + torch.arange(1, per_rank * k - s + 1, device=t.device)
        else:
            tail = t.new_full((t.shape[0], per_rank * k - s), pad)
        t = torch.cat([t, tail], dim=1)
    return t[:, rank * per_rank : (rank + 1) * per_rank].contiguous()


def _check_same_batch(input_ids: torch.Tensor, comm: Comm) -> None:
    """The group's ranks hold the same sequences ([Note: sequence-parallel batch]): shape and a position-weighted
    checksum compared through one small all-gather."""
    weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device, dtype=torch.float64)
    mine = torch.stack(
        [
            torch.tensor(float(input_ids.shape[0]), dtype=torch.float64, device=input_ids.device),
            torch.tensor(float(input_ids.shape[1]), dtype=torch.float64, device=input_ids.device),
            (input_ids.reshape(-1).to(torch.float64) * weights).sum(),
        ]
    )
    every = torch.empty(comm.world_size * 3, dtype=torch.float64, device=input_ids.device)
    comm.all_gather(every, mine, tag="sequence batch check")
    rows = every.view(comm.world_size, 3)
    if not bool((rows == rows[0]).all()):
        raise ValueError(
            "sequence parallelism: the ranks of a sequence-parallel group hold different batches (shape, checksum "
            f"per rank: {rows.tolist()}); give the group's ranks the same batch: a DistributedSampler with "
            "num_replicas=SequenceParallel.dp_size and rank=SequenceParallel.dp_rank "
            "(zp.sequence_parallel_of(model))"
        )


def sequence_parallel_batch(batch: Mapping[str, Any], model: nn.Module, check: bool = True) -> dict[str, Any]:
    """``split_batch`` for this rank of ``model``'s sequence-parallel group (``zp.setup`` with
    ``ZeroConfig(sequence_parallel_size=K)``); ``check``: compare the group's batches first (one small
    all-gather in the group)."""
    setting = sequence_parallel_of(model)
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"zero_plugin: sequence_parallel_size={setting.size} splits batches that are mappings with input_ids "
            f"[batch, seq] (and labels, position_ids); the loader gave a {type(batch).__name__}"
        )
    if check:
        _check_same_batch(batch["input_ids"], setting.comm)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    split = split_batch(batch, setting.rank, setting.size, pad_token_id=pad if isinstance(pad, int) else 0)
    setting.split["shape"] = tuple(split["input_ids"].shape)
    return split


def expect_batch(split: Mapping[str, Any], model: nn.Module) -> None:
    """Tell the attention that its next forward runs ``split`` (a result of :func:`sequence_parallel_batch`): for a
    loop that splits several batches before it runs them (the HF Trainer fetches a gradient-accumulation step's
    micro-batches first), since the attention checks its tokens against the last split's ([Note: unsplit
    batches] in ``attention.py``)."""
    sequence_parallel_of(model).split["shape"] = tuple(split["input_ids"].shape)


class SequenceParallelLoader:
    """A data loader's batches through :func:`sequence_parallel_batch`; its ``len`` and ``sampler`` pass through.

    ``model`` may also be a function that returns it, called at the first batch: the frameworks' loaders exist
    before the model is set up (the HF Trainer prepares its loader first, Fabric either way).  ``device``: the
    batch's tensors are moved there first (the split compares the group's batches with a collective)."""

    def __init__(
        self,
        loader: Iterable,
        model: nn.Module | Callable[[], nn.Module],
        check: bool = True,
        device: torch.device | None = None,
    ) -> None:
        if isinstance(model, nn.Module):
            sequence_parallel_of(model)  # refuse a model that was not set up for it now, not at the first batch
        self.loader, self.model, self.check, self.device = loader, model, check, device

    def __iter__(self) -> Iterator[dict[str, Any]]:
        model = self.model if isinstance(self.model, nn.Module) else None
        for batch in self.loader:
            if model is None:
                model = self.model()
            if self.device is not None and isinstance(batch, Mapping):
                batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            yield sequence_parallel_batch(batch, model, self.check)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
