"""Frozen ``nn.Linear`` and ``nn.Embedding`` units computed one row-slice of their weight at a time (stage 3).

[Note: sliced linear units]
An LM head over a 32k vocabulary is the largest unit of a Llama (32000 x 3072 fp32 = 375 MiB at 3B,
as much as a decoder layer) and it is gathered at the worst moment: at the end of the forward and
the start of the backward, while every saved activation of the step is alive
(``benchmarks/results/large_model_trace.md``).  A frozen Linear needs its weight only to compute
``y = x @ W^T + b`` in forward and ``grad_x = g @ W`` in backward, and both are sums over
independent row-blocks of ``W``.  So a unit made of exactly one ``nn.Linear`` whose parameters are
all frozen at setup, with at least ``2 x ZeroConfig.linear_slice_numel`` weight elements, is never
gathered whole by the runtime: its forward gathers rows ``[a, b)`` of ``W`` (and ``b[a:b]``) into one
slice buffer of at most ``linear_slice_numel`` elements, writes ``y[..., a:b]``, and moves to the
next slice; its backward does the same for ``grad_x += g[..., a:b] @ W[a:b]``.  Peak memory for the
weight is one slice instead of the whole matrix; the price is a second gather of the weight in
backward (the runtime keeps a whole last unit from forward to backward instead, [Note: last unit
kept] in ``hooks.py``), i.e. one more all-gather of the layer per step.

Each slice is an all-gather of every rank's part of the slice's flat range ``[a*H, b*H)``
(``Layout.gather_spans`` of the unit's group): on gloo the parts are broadcast straight into the slice
buffer (``Comm.gather_regions``, as a unit's in-place gather), elsewhere each rank's part is padded to the
longest part and all-gathered.  Every rank runs
the same slices in the same order at the same point of the step (the unit's own forward or
backward), so they pair like any gather.

Only frozen, untied layers: a trainable weight would need its gradient reduce-scattered slice by
slice, and a tied one (input embedding) is used whole by another module; both stay ordinary units
(the tied one is in the root unit, [Note: leaf units] in ``policy.py``).  Under the default unit choice a
frozen Linear of that size inside a block (a LoRA base layer's ``base_layer``) becomes such a unit of its
own too ([Note: frozen linear units] in ``policy.py``), so the block's unit gathers only what is left.  Explicit gathers
(``zp.gathered_parameters``, state dicts, ``release_full``) still gather it whole with
:meth:`Unit.unshard`; while it is gathered the forward is a plain ``F.linear``.  The module's
``forward`` is replaced by an instance attribute (not the class's), removed with the engine.

A frozen, untied ``nn.Embedding`` leaf unit of that size (a 32k-vocabulary ``embed_tokens`` under LoRA:
375 MiB at 3B, gathered at the start of every forward) is sliced the same way: its forward gathers each
row-slice and copies out the rows the batch's ids fall in.  It has no backward (the weight is frozen
and ids carry no gradient).  Every rank gathers every slice, whatever its ids, so the ranks stay paired.
Only ``max_norm=None`` (``max_norm`` renormalises the weight in place); ``padding_idx``,
``scale_grad_by_freq`` and ``sparse`` only shape a weight gradient there is none of.

Whether a layer is sliced is decided on the full weight's size, by the unit policy before sharding and
by the engine after (where ``module.weight`` holds this rank's shard only).  The slice buffers come
from the engine's ``BufferPool`` and go back after each slice's compute ([Note: buffer reuse] in
``pool.py``): the same block serves every slice of every sliced unit, so the allocator never sees
them, instead of a fresh ~32 MiB block per slice that glibc, its mmap threshold raised, carves from a
heap that then grows around the activations (measured on a 6-layer, 0.8B Llama under LoRA: +450 MiB
of heap through one backward).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .param import ShardedParam, ShardedState
from .unit import GatherMode, Unit, UnitServices, UnitSpec

__all__ = ["SlicedEmbeddingUnit", "SlicedLinearUnit", "SlicedUnit", "sliceable", "sliced_unit_type"]


def sliced_unit_type(module: nn.Module) -> type[SlicedUnit] | None:
    """The sliced unit class for ``module``'s kind of layer, or None ([Note: sliced linear units])."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return SlicedLinearUnit
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward and module.max_norm is None:
        return SlicedEmbeddingUnit
    return None


def sliceable(module: nn.Module, params: list[nn.Parameter], slice_numel: int, weight_numel: int) -> bool:
    """Whether a unit of ``module`` owning ``params`` is computed in slices ([Note: sliced linear units]).
    ``weight_numel``: the full weight's element count, which the unit policy (before sharding) and the
    engine (after, when ``module.weight`` holds only this rank's shard) must both pass."""
    if not slice_numel or sliced_unit_type(module) is None:
        return False
    own = {id(p) for p in module.parameters(recurse=False)}
    if {id(p) for p in params} != own or any(p.requires_grad for p in params):
        return False
    return weight_numel >= 2 * slice_numel


class SlicedUnit(Unit):
    """A frozen layer's unit whose forward (and backward) gather one row-slice of the weight at a time."""

    def __init__(self, spec: UnitSpec, services: UnitServices) -> None:
        super().__init__(spec, services)
        self.by_param = {id(sp.param): sp for sp in self.params}
        self.weight = self.by_param[id(self.module.weight)]
        rows_total, width = self.weight.shape
        rows = max(1, spec.slice_numel // width)
        self.slices = [(a, min(a + rows, rows_total)) for a in range(0, rows_total, rows)]
        self.module.forward = self.forward  # an instance attribute: removed by :meth:`remove`

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)

    # The runtime never gathers this unit whole: its forward and backward gather slices.
    def pre_forward(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    gathers_on_read = True

    def pre_direct_read(self) -> None:
        """A loss reads the weight itself ([Note: direct reads of the output embedding] in
        ``direct_reads.py``): gathered whole, released like any unit."""
        self.unshard()

    def ensure_unsharded(self, mode: GatherMode = GatherMode.ON_DEMAND) -> None:
        if self._gather:  # an explicit unshard(GatherMode.PREFETCH) in flight
            self.wait_unshard()

    # -- slices -------------------------------------------------------------------
    def row_slices(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(a, b, rows a..b of the weight)`` for each slice, gathered in a pooled block that goes back to the
        pool when the loop moves on: the caller must not keep the rows past its loop body."""
        width = self.weight.shape[1]
        for a, b in self.slices:
            w = self._gather_flat(self.weight, a * width, b * width, pooled=True).view(b - a, width)
            yield a, b, w
            self.pool.give(w)

    def _gather_flat(self, sp: ShardedParam, lo: int, hi: int, pooled: bool = False) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``sp``'s flattened full tensor, in its compute dtype, on every rank."""
        world, rank = self.comm.world_size, sp.layout.rank
        parts = []
        for r in range(world):
            r_lo, r_hi = sp.layout.bounds(r)
            p_lo = min(max(lo, r_lo), hi)
            parts.append((p_lo, max(p_lo, min(hi, r_hi))))
        dtype, device = sp.unsharded.dtype, sp.unsharded.device
        buf = self.pool.take(hi - lo, dtype, device) if pooled else torch.empty(hi - lo, dtype=dtype, device=device)
        own_lo, own_hi = parts[rank]
        start = sp.layout.bounds()[0]
        buf[own_lo - lo : own_hi - lo].copy_(sp.local[own_lo - start : own_hi - start])
        spans = [(p_lo - lo, p_hi - lo) for p_lo, p_hi in parts]
        self.layout.gather_spans(self.comm, buf, spans, tag=f"{self.name}[{lo}:{hi}]")
        return buf


class SlicedLinearUnit(SlicedUnit):
    """A frozen ``nn.Linear`` unit: ``y[..., a:b] = x @ W[a:b]^T (+ b[a:b])`` and ``grad_x = sum g[..., a:b] @ W[a:b]``."""

    def __init__(self, spec: UnitSpec, services: UnitServices) -> None:
        super().__init__(spec, services)
        self.bias = self.by_param.get(id(self.module.bias)) if self.module.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is ShardedState.UNSHARDED:  # gathered explicitly (zp.gathered_parameters)
            return F.linear(x, self.module.weight, self.module.bias)
        return _SlicedLinear.apply(self, x)

    @torch.no_grad()
    def forward_slices(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], self.weight.shape[0])
        for a, b, w in self.row_slices():
            bias = self._gather_flat(self.bias, a, b) if self.bias is not None else None
            out[..., a:b] = F.linear(x, w, bias)
        return out

    @torch.no_grad()
    def input_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        grad_in = None
        for a, b, w in self.row_slices():
            part = grad_out[..., a:b].matmul(w)
            grad_in = part if grad_in is None else grad_in.add_(part)
        return grad_in


class SlicedEmbeddingUnit(SlicedUnit):
    """A frozen ``nn.Embedding`` unit: each row-slice of the table fills the outputs whose ids fall in it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        module = self.module
        if self.state is ShardedState.UNSHARDED:  # gathered explicitly (zp.gathered_parameters)
            return F.embedding(ids, module.weight, module.padding_idx, None, 2.0, module.scale_grad_by_freq)
        return self.lookup(ids)

    @torch.no_grad()
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows, width = self.weight.shape
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise IndexError(
                f"zero_plugin: {self.name}: token ids must lie in [0, {rows}) (the embedding's rows), got "
                f"min {int(flat.min())}, max {int(flat.max())}"
            )
        out = torch.empty(flat.numel(), width, dtype=self.weight.unsharded.dtype, device=self.weight.unsharded.device)
        for a, b, w in self.row_slices():
            hit = ((flat >= a) & (flat < b)).nonzero().squeeze(1)
            if hit.numel():
                out.index_copy_(0, hit, w.index_select(0, flat.index_select(0, hit) - a))
        return out.view(*ids.shape, width)


class _SlicedLinear(torch.autograd.Function):
    """``y = x @ W^T + b`` with a frozen ``W`` gathered slice by slice in forward and again in backward."""

    @staticmethod
    def forward(ctx, unit: SlicedLinearUnit, x: torch.Tensor) -> torch.Tensor:
        ctx.unit = unit
        return unit.forward_slices(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None
        return None, ctx.unit.input_grad(grad_out)
