"""Long context in the planner: one rank of a Ulysses group traced, activation bytes per token, and the longest
sequence that fits a given memory per device at a stage and K (``zero-plugin estimate --device-memory``).

[Note: long-context trace]
``Planner(sequence_parallel=K)`` traces what one rank of a group of K runs ([Note: Ulysses attention] in
``sequence/attention.py``): its ceil(seq / K) tokens through the model, with the real attention wrapper and
exchange switched in over a stand-in group whose collectives move nothing (fake tensors hold no data), so the
trace allocates what a rank allocates: q, k, v and the output re-split (stack, receive buffer, concatenation)
around the model's own attention over the whole sequence for 1/K of the heads; the loss is the rank's
cross-entropy sum over its logits (``zp.sequence_parallel_loss`` without its 2-element all-reduce).  With
``tiled_loss`` the model's forward is the backbone followed by ``zp.tiled_lm_loss``.  Activation offload is
traced by ``trace.py``'s ``_TracedOffload``.

Activations grow linearly with the tokens of a rank for sdpa and flash attention (eager adds s² scores), so the
bytes per token are the difference of two traces divided by their difference in tokens, and the longest sequence
that fits is searched on traces extrapolated along the line through two real ones (every activation figure of
the timeline affine in the tokens), then checked by a trace at the answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from .trace import Trace

__all__ = [
    "activation_bytes_per_token",
    "checkpointed_input_bytes",
    "long_context_step",
    "longest_sequence",
    "tokens_per_rank",
]


def tokens_per_rank(seq: int, sequence_parallel: int) -> int:
    """The tokens each rank of a group of K holds: the sequence padded to a multiple of K, over K."""
    return -(-seq // sequence_parallel)


def checkpointed_input_bytes(config: Any, *, batch: int, seq: int, sequence_parallel: int = 1, dtype) -> int:
    """Bytes ``offload_activations`` moves to the host per forward on one rank ([Note: activation offload] in
    ``sequence/offload.py``): every decoder layer's input, ``batch x tokens per rank x hidden`` in ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = tokens_per_rank(seq, sequence_parallel)
    return config.num_hidden_layers * batch * tokens * config.hidden_size * itemsize


class _TraceGroup:
    """The sequence-parallel group as the trace sees it: K ranks, collectives that move nothing."""

    rank = 0

    def __init__(self, k: int) -> None:
        self.world_size = k

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, tag: str | None = None) -> None:
        pass

    def all_reduce(self, tensor: torch.Tensor, tag: str | None = None) -> None:
        pass


@contextlib.contextmanager
def long_context_step(
    model: nn.Module, batch: int, seq: int, k: int, tile_tokens: int | None
) -> Iterator[tuple[Callable, Callable]]:
    """The inputs and loss of one rank's step ([Note: long-context trace]); the model as it was on exit."""
    from ..sequence.attention import check_model, switch_attention, switch_back
    from ..sequence.loss import token_loss_sum
    from ..sequence.parallel import SequenceParallel
    from ..sequence.tiled_loss import tiled_lm_loss

    tokens = tokens_per_rank(seq, k)
    vocab = model.config.vocab_size
    pretrained = original = None
    if k > 1:
        pretrained, original = check_model(model, k)
        setting = SequenceParallel(_TraceGroup(k), original, weakref.ref(pretrained))  # type: ignore[arg-type]
        setting.split["shape"] = (batch, tokens)
        switch_attention(pretrained, setting)

    def make() -> tuple[tuple, dict]:
        ids = torch.randint(0, vocab, (batch, tokens))
        kwargs = {"input_ids": ids, "position_ids": torch.arange(tokens).expand(batch, tokens), "use_cache": False}
        if tile_tokens is not None:
            kwargs["labels"] = ids
        return (), kwargs

    def loss(output: Any) -> torch.Tensor:
        if tile_tokens is not None:
            return output
        return token_loss_sum(output.logits, torch.randint(0, vocab, output.logits.shape[:2]))

    def tiled_forward(input_ids, labels, **kwargs):
        hidden = model.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        return tiled_lm_loss(hidden, model.get_output_embeddings(), labels, tile_tokens=tile_tokens)

    if tile_tokens is not None:
        model.forward = tiled_forward
    try:
        yield make, loss
    finally:
        if tile_tokens is not None:
            del model.forward
        if pretrained is not None:
            switch_back(pretrained, original)


def _planner(model: Any, seq: int, options: dict):
    from .plan import Planner

    return Planner(model, seq=seq, **options)


def _tokens_grid(seq: int, k: int) -> tuple[int, int]:
    """Two sequence lengths (multiples of K) around ``seq`` for a difference quotient."""
    lo = max(k, (seq // (2 * k)) * k)
    return lo, lo + max(k, (seq // (2 * k)) * k)


def activation_bytes_per_token(model: Any, *, seq: int = 4096, **options: Any) -> dict[str, float]:
    """Activation bytes per token of the whole sequence on one rank (``options``: ``Planner``'s, ``batch``
    included), from two traces at about ``seq`` / 2 and ``seq`` tokens ([Note: long-context trace]): ``peak``
    (forward + backward), ``saved`` (kept for backward at the end of forward, device), ``offloaded`` (host)."""
    from .trace import resolve_model

    model = resolve_model(model)
    k = options.get("sequence_parallel", 1)
    lo, hi = _tokens_grid(seq, k)
    a, b = _planner(model, lo, options).trace, _planner(model, hi, options).trace
    span = hi - lo
    return {
        "peak": (b.peak_bytes - a.peak_bytes) / span,
        "saved": (b.saved_bytes - a.saved_bytes) / span,
        "end_of_forward": (b.forward_bytes - a.forward_bytes) / span,
        "offloaded": (b.offloaded_bytes - a.offloaded_bytes) / span,
    }


def _extrapolate(a: Trace, b: Trace, sa: int, sb: int, seq: int) -> Trace | None:
    """The trace at ``seq`` tokens on the line through two traces of the same model at ``sa`` and ``sb`` tokens:
    every activation figure of the timeline taken as affine in the tokens ([Note: long-context trace]); None when
    the two timelines do not have the same events."""
    if len(a.events) != len(b.events) or any(x[0] != y[0] for x, y in zip(a.events, b.events)):
        return None
    f = (seq - sa) / (sb - sa)

    def at(x: float, y: float) -> float:
        return max(0.0, x + (y - x) * f)

    events = [("seg", at(x[1], y[1]), at(x[2], y[2])) if x[0] == "seg" else x for x, y in zip(a.events, b.events)]
    return dataclasses.replace(
        b,
        events=events,
        saved_bytes=at(a.saved_bytes, b.saved_bytes),
        forward_bytes=at(a.forward_bytes, b.forward_bytes),
        peak_bytes=at(a.peak_bytes, b.peak_bytes),
        offloaded_bytes=at(a.offloaded_bytes, b.offloaded_bytes),
    )


def longest_sequence(
    model: Any,
    memory: float,
    *,
    world_size: int,
    stage: int,
    offload: bool = False,
    offload_params: bool = False,
    multiple: int = 64,
    traces: dict | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The longest sequence (a multiple of ``multiple`` x K tokens) whose planned per-rank peak fits ``memory``
    bytes: the device peak on device "cuda", the whole peak on "cpu".  ``options``: ``Planner``'s (``batch``,
    ``checkpointing``, ``sequence_parallel``, ``offload_activations``, ``tiled_loss``, ``config``, ...);
    ``traces``: a dict of planners by sequence length, shared between calls with the same options (one trace
    serves every stage).  Two traces give a line; the answer is searched on the line's extrapolated traces and
    then traced itself, and the line redrawn through it while that does not fit (at most 4 times).  Returns
    ``seq`` (0 when ``multiple`` x K tokens do not fit), ``peak`` there and its ``row``."""
    from .trace import resolve_model

    model = resolve_model(model)
    step = multiple * options.get("sequence_parallel", 1)
    key = "total" if options.get("device", "cuda") == "cpu" else "device"
    traces = {} if traces is None else traces

    def planned(seq: int):
        if seq not in traces:
            traces[seq] = _planner(model, seq, options)
        return traces[seq]

    def peak(plan, seq: int) -> tuple[float, dict]:
        row = plan.estimate(world_size, stage, offload=offload, offload_params=offload_params)
        return row["peak"][key], row

    sa, sb = 16 * step, 32 * step
    for _ in range(4):
        guess = _search_line(planned(sa), planned(sb), sa, sb, step, memory, lambda p, s: peak(p, s)[0])
        if guess is None:  # the timelines differ: search on real traces
            guess = _bisect(step, lambda s: peak(planned(s), s)[0] <= memory)
        got, row = peak(planned(guess), guess)
        if got <= memory:
            return {"seq": guess, "peak": got, "row": row}
        if guess == step:
            return {"seq": 0, "peak": got, "row": row}
        sa, sb = (sb, guess) if guess != sb else (sa, guess)
    fitting = max((s for s in traces if peak(traces[s], s)[0] <= memory), default=step)
    got, row = peak(planned(fitting), fitting)
    return {"seq": fitting if got <= memory else 0, "peak": got, "row": row}


def _search_line(a, b, sa: int, sb: int, step: int, memory: float, peak_of) -> int | None:
    """The longest multiple of ``step`` whose extrapolated plan fits, or None when the traces do not line up."""
    if _extrapolate(a.trace, b.trace, sa, sb, sb) is None:
        return None

    def fits(seq: int) -> bool:
        return peak_of(b.with_trace(_extrapolate(a.trace, b.trace, sa, sb, seq), seq), seq) <= memory

    return _bisect(step, fits)


def _bisect(step: int, fits) -> int:
    """The largest multiple of ``step`` for which ``fits`` holds, doubling then halving; ``step`` when even that
    does not fit."""
    if not fits(step):
        return step
    lo, hi = step, 2 * step
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > 2**40:
            return lo
    while hi - lo > step:
        mid = (lo + hi) // (2 * step) * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
