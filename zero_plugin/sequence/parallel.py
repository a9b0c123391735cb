"""A model's sequence-parallel setting: its group of K consecutive ranks, made at ``zp.setup``, and the switch of
its attention to the Ulysses wrapper; found again by the batch split and the loss.

[Note: sequence-parallel groups]
``ZeroConfig.sequence_parallel_size=K`` cuts the world of N ranks into N / K groups of K consecutive ranks
(ranks 0..K-1, K..2K-1, ...): the ranks of one group hold the same sequences, each its contiguous 1/K of every
sequence's tokens, and exchange q, k, v and the attention output among themselves ([Note: Ulysses exchange] in
``exchange.py``).  The groups are made by ``Comm.node_group(K, label="sequence")`` (cached, counted under
``sequence_group`` in ``comm_stats``), by every rank, for every group, in the same order, as torch's
``new_group`` requires.  ZeRO itself is unchanged: parameters, gradients and optimizer state are sharded, and
gradients averaged, over all N ranks, so the data-parallel degree is N / K (rank r's data-parallel rank is r // K)
and the loss carries the factor that makes that average the data-parallel mean ([Note: sequence-parallel loss] in
``loss.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Iterator

from torch import nn

from ..comm.collectives import Comm

__all__ = ["SequenceParallel", "enable", "find_sequence_parallel", "sequence_parallel_of"]


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """One model's sequence parallelism on this rank ([Note: sequence-parallel groups])."""

    comm: Comm
    """The group of ``size`` consecutive ranks that share this rank's sequences."""
    original_attention: str
    """The model's ``attn_implementation`` before the switch, which the wrapper runs on the whole sequence."""
    pretrained: Any = dataclasses.field(repr=False, compare=False)
    """A weak reference to the transformers model whose attention was switched."""
    split: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """``{"shape": (batch, tokens per rank)}`` of the last ``zp.sequence_parallel_batch``, which the attention
    checks its queries against ([Note: unsplit batches] in ``attention.py``)."""

    @property
    def size(self) -> int:
        """K, the ranks per sequence-parallel group."""
        return self.comm.world_size

    @property
    def rank(self) -> int:
        """This rank's place in its group: it holds the ``rank``-th 1/K of every sequence."""
        return self.comm.rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (its group's index): what a ``DistributedSampler``'s ``rank`` is."""
        return self.comm.global_rank(0) // self.size

    @property
    def dp_size(self) -> int:
        """The number of groups, the data-parallel degree: a ``DistributedSampler``'s ``num_replicas``."""
        return self.comm.world.world_size // self.size

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block the model runs its original attention on whatever each rank passes (whole sequences:
        ``generate``, an evaluation without the batch split); the Ulysses wrapper is back on exit.  Not
        collective, but at stage 3 every rank must still run the same forwards (the units' gathers)."""
        from .attention import ATTENTION_NAME

        model = self.pretrained()
        model.set_attn_implementation(self.original_attention)
        try:
            yield
        finally:
            model.set_attn_implementation(ATTENTION_NAME)


_OF_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_sequence_parallel(model: nn.Module) -> SequenceParallel | None:
    """The setting ``zp.setup`` recorded for ``model`` (or for the module a framework's wrapper holds as
    ``.module``: Fabric's ``_FabricModule``, DDP), or None."""
    found = _OF_MODEL.get(model)
    inner = getattr(model, "module", None)
    if found is None and isinstance(inner, nn.Module):
        found = _OF_MODEL.get(inner)
    return found


def sequence_parallel_of(model: nn.Module) -> SequenceParallel:
    """:func:`find_sequence_parallel`, ``ValueError`` if ``model`` has no setting."""
    found = find_sequence_parallel(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} was not set up for sequence parallelism: pass it to zp.setup with "
            "ZeroConfig(sequence_parallel_size=K), K > 1, first (docs/long-context.md)"
        )
    return found


def sequence_group(world: Comm, k: int) -> Comm:
    """This rank's group of ``k`` consecutive ranks of ``world`` (the default group); collective over it: every
    rank makes every group, in the same order ([Note: sequence-parallel groups])."""
    comm = world.node_group(k, label="sequence")
    comm.world = world
    return comm


def enable(model: nn.Module, world: Comm, k: int) -> SequenceParallel | None:
    """Switch ``model``'s attention to the Ulysses wrapper over this rank's group of ``k`` consecutive ranks of
    ``world`` and record the setting (None when ``k`` is 1).  Collective over ``world`` (the groups are made);
    every check that can refuse runs before any group is made."""
    from .attention import check_model, switch_attention

    if k == 1:
        return None
    done = _OF_MODEL.get(model)
    if done is not None and done.size == k:  # set up for evaluation first, then for training
        return done
    if world.group is not None:
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={k} with zp.setup(group=...) is not supported: the sequence-parallel "
            "groups are cut from the default process group; call zp.setup without group="
        )
    assert world.world_size % k == 0, "ZeroConfig.resolved_sequence_parallel_size checked k | N"
    pretrained, original = check_model(model, k)
    setting = SequenceParallel(
        comm=sequence_group(world, k), original_attention=original, pretrained=weakref.ref(pretrained)
    )
    switch_attention(pretrained, setting)
    _OF_MODEL[model] = setting
    if pretrained is not model:
        _OF_MODEL[pretrained] = setting
    return setting
