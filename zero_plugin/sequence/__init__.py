"""Ulysses sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509) beside ZeRO: the sequence-parallel groups
(``parallel``), the all-to-all that moves attention between the sequence and head splits (``exchange``), the
attention function wrapped around a transformers model's own (``attention``), the batch split (``batch``) and the
loss over the whole sequences (``loss``).  docs/long-context.md says how to use it.
"""

from .batch import SequenceParallelLoader, sequence_parallel_batch, split_batch
from .loss import sequence_loss, sequence_parallel_loss
from .parallel import SequenceParallel, enable, sequence_parallel_of

__all__ = [
    "SequenceParallel",
    "SequenceParallelLoader",
    "enable",
    "sequence_loss",
    "sequence_parallel_batch",
    "sequence_parallel_loss",
    "sequence_parallel_of",
    "split_batch",
]
