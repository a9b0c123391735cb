"""What the memory planner traces, and the trace: one forward + backward on fake tensors as a timeline.

Models come from ``resolve_model``: an ``nn.Module``, a transformers config, a built-in name
(``BUILTIN_MODELS``), a config file/folder or Hub id (built on the meta device), or a bare parameter
count (``synthetic_trace``: equal blocks, no activations).

The timeline is a list of events: ``("seg", peak, end)`` summarises the activation bytes between two
structural events (their maximum and final value); the others mark where the engine acts:
``("fwd_pre"|"fwd_post"|"bwd_pre"|"bwd_post", unit, in_backward)``, ``("grad", param_index)``,
``("backward",)`` and ``("end",)``.  The trace does not depend on the stage or world size, so one trace
serves every row of a plan.

[Note: fake trace]
The model runs once under ``FakeTensorMode`` (shapes and dtypes, no data, no memory), with a
``TorchDispatchMode`` above it that sees every op's outputs.  Each output's storage is counted once
while any tensor referencing it lives: tensors are fake (a Python subclass), so their Python objects
live exactly as long as their ``TensorImpl`` (autograd's saved variables included) and a
``weakref.finalize`` on each marks the release.  Storages of parameters, buffers and inputs are never
counted.  When a parameter's gradient is accumulated its bytes leave the activation count: what
happens to them (kept, bucketed, reduce-scattered) depends on the stage, which the planner replays.

[Note: eager masks]
transformers takes fake tensors for compiler tracing and then skips its data-dependent shortcuts: it
builds an explicit causal mask, and with a mask SDPA repeats grouped key/value heads, none of which an
eager training step does.  During the trace fake tensors count as eager, and their boolean data checks
(``mask.all()``) answer True: no padding, no packed sequences, as in the random-token batch being
planned (``_eager_masks`` and ``_LiveBytes.__torch_dispatch__``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BUILTIN_MODELS",
    "SYNTHETIC_BLOCKS",
    "ParamInfo",
    "Trace",
    "checkpointing",
    "default_loss",
    "hf_inputs",
    "resolve_model",
    "synthetic_trace",
    "trace_model",
]

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=688,
        vocab_size=8000,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "llama-7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=11008,
        vocab_size=32000,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    ),
    "llama-13b": dict(
        hidden_size=5120,
        num_hidden_layers=40,
        intermediate_size=13824,
        vocab_size=32000,
        num_attention_heads=40,
        num_key_value_heads=40,
        tie_word_embeddings=False,
    ),
}
SYNTHETIC_BLOCKS = 32  # a bare parameter count: stage 3 assumes this many equal blocks, no root


@dataclass(frozen=True, slots=True)
class ParamInfo:
    name: str
    numel: int
    requires_grad: bool
    unit: int  # stage-3 unit index (0 = root)


@dataclass(slots=True)
class Trace:
    params: list[ParamInfo]
    unit_names: list[str]
    events: list[tuple] = field(default_factory=list)
    saved_bytes: int = 0  # distinct storages saved for backward (saved_tensors_hooks), end of forward
    forward_bytes: int = 0  # activation bytes alive at the end of forward (what backward starts from)
    peak_bytes: int = 0  # peak activation bytes over forward + backward
    offloaded_bytes: int = 0  # checkpointed layer inputs parked in host memory at once (activation offload)

    @property
    def forward_order(self) -> list[int]:
        """Units (not the root) in the order their first forward ran."""
        order: list[int] = []
        for ev in self.events:
            if ev[0] == "fwd_pre" and ev[1] != 0 and not ev[2] and ev[1] not in order:
                order.append(ev[1])
        return order


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Entry:
    __slots__ = ("nbytes", "refs")

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.refs = nbytes, 0


class _LiveBytes(TorchDispatchMode):
    """Activation bytes alive, segmented at structural events (see [Note: fake trace])."""

    def __init__(self, external: set[int]) -> None:
        super().__init__()
        self.external = external
        self.live: dict[int, _Entry] = {}
        self.cur = self.seg_max = self.peak = 0
        self.events: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            return True  # see [Note: eager masks]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        key = _key(t)
        if key in self.external:
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = _Entry(t.untyped_storage().nbytes())
            self._add(entry.nbytes)
        entry.refs += 1
        weakref.finalize(t, self._release, key, entry)

    def _release(self, key: int, entry: _Entry) -> None:
        entry.refs -= 1
        if entry.refs == 0 and self.live.get(key) is entry:
            del self.live[key]
            self._add(-entry.nbytes)

    def _add(self, nbytes: int) -> None:
        self.cur += nbytes
        self.seg_max = max(self.seg_max, self.cur)
        self.peak = max(self.peak, self.cur)

    def take(self, t: torch.Tensor, nbytes: int) -> None:
        """``nbytes`` of ``t``'s storage now belong to the engine (a parameter's gradient)."""
        entry = self.live.get(_key(t))
        if entry is not None:
            moved = min(nbytes, entry.nbytes)
            entry.nbytes -= moved
            self.cur -= moved

    def mark(self, *event: Any) -> None:
        self.events.append(("seg", self.seg_max, self.cur))
        self.events.append(event)
        self.seg_max = self.cur


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Hooks:
    """The engine's hook points (stage3/hooks.py), recording events instead of gathering."""

    def __init__(self, live: _LiveBytes, units: list[nn.Module], fake_params: list[torch.Tensor]) -> None:
        self.live = live
        self.handles: list = []
        for index, module in enumerate(units):
            self.handles.append(
                module.register_forward_pre_hook(functools.partial(self.pre_forward, index), with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(functools.partial(self.post_forward, index)))
        for i, p in enumerate(fake_params):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self.on_grad, i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def pre_forward(self, unit: int, module, args, kwargs):
        self.live.mark("fwd_pre", unit, _in_backward())
        if unit and torch.is_grad_enabled():
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._grad_event, "bwd_post", unit))
        return None

    def post_forward(self, unit: int, module, args, output):
        self.live.mark("fwd_post", unit, _in_backward())
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._grad_event, "bwd_pre", unit))
        return None

    def _grad_event(self, kind: str, unit: int, grad: torch.Tensor) -> None:
        self.live.mark(kind, unit, True)

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        self.live.take(grad, grad.numel() * grad.element_size())
        self.live.mark("grad", index)


class _SavedBytes:
    """Distinct non-parameter storages autograd saves for backward (saved_tensors_hooks)."""

    def __init__(self, external: set[int]) -> None:
        self.external, self.seen, self.total = external, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self.external and key not in self.seen:
            self.seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t


def _fake_parameters(model: nn.Module, mode, param_dtype: torch.dtype | None) -> tuple[dict, dict]:
    """Fake stand-ins for the model's parameters (cast to ``param_dtype``) and buffers."""

    def fake_like(t: torch.Tensor, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
        with mode:
            out = torch.empty(t.shape, dtype=dtype, device="cpu")
        return out.requires_grad_(requires_grad)

    params = {
        n: fake_like(p, param_dtype if (param_dtype and p.is_floating_point()) else p.dtype, p.requires_grad)
        for n, p in model.named_parameters()
    }
    buffers = {n: fake_like(b, b.dtype, False) for n, b in model.named_buffers()}
    return params, buffers


@contextlib.contextmanager
def _eager_masks():
    """Fake tensors count as eager and their boolean data checks answer True ([Note: eager masks])."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing"):
        yield
        return
    original = masking.is_tracing
    masking.is_tracing = lambda tensor=None: torch.compiler.is_compiling()
    try:
        yield
    finally:
        masking.is_tracing = original


def trace_model(
    model: nn.Module,
    units: list[nn.Module],
    owner: dict[int, int],
    unit_names: list[str],
    make_inputs: Callable[[], tuple[tuple, dict]],
    *,
    param_dtype: torch.dtype | None,
    loss_fn: Callable[[Any], torch.Tensor],
    offload_activations: bool = False,
) -> Trace:
    """Run one forward + backward of ``model`` on fake tensors and return its timeline.

    ``units[0]`` is the model (the root unit); ``owner`` maps id(param) -> unit index.  ``offload_activations``:
    the checkpointed layers' inputs leave the device as ``ZeroConfig.offload_activations="cpu"`` moves them on
    CUDA (``_TracedOffload``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    named = list(model.named_parameters())
    infos = [ParamInfo(n, p.numel(), p.requires_grad, owner.get(id(p), 0)) for n, p in named]
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fparams, fbuffers = _fake_parameters(model, mode, param_dtype)
    with mode:
        args, kwargs = make_inputs()
    external = {_key(t) for t in [*fparams.values(), *fbuffers.values()]}
    external |= {_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    live = _LiveBytes(external)
    saved = _SavedBytes(external)
    hooks = _Hooks(live, units, list(fparams.values()))
    offload = _TracedOffload(live) if offload_activations else None
    try:
        # The fake tensors stand in for the parameters until backward is done: activation
        # checkpointing re-runs the forward inside backward.
        with (
            mode,
            live,
            _eager_masks(),
            _reparametrize_module(model, {**fparams, **fbuffers}, tie_weights=True),
            _offloaded_checkpoints(model, offload),
        ):
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = loss_fn(model(*args, **kwargs))
            forward_bytes = live.cur
            live.mark("backward")
            loss.backward()
            del loss
            live.mark("end")
    finally:
        hooks.remove()
    return Trace(
        params=infos,
        unit_names=unit_names,
        events=live.events,
        saved_bytes=saved.total,
        forward_bytes=forward_bytes,
        peak_bytes=live.peak,
        offloaded_bytes=offload.peak if offload is not None else 0,
    )


class _TracedOffload:
    """[Note: activation offload] in ``sequence/offload.py`` as the trace counts it on CUDA: a packed layer input
    leaves the device count when the next layer's pack lets it go (the compute stream waited for its copy), the
    last one stays on the device; unpacking a tensor that left allocates it again for the recompute."""

    def __init__(self, live: _LiveBytes) -> None:
        self.live, self.pending, self.host, self.peak = live, None, 0, 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter):
            return t
        self._let_go()
        parked = self.pending = [t, True]
        self.host += t.numel() * t.element_size()
        self.peak = max(self.peak, self.host)
        return parked

    def _let_go(self) -> None:
        if self.pending is not None:
            t = self.pending[0]
            self.live.take(t, t.numel() * t.element_size())
            self.pending[1], self.pending = False, None

    def unpack(self, parked: Any) -> torch.Tensor:
        if not isinstance(parked, list):
            return parked
        t, on_device = parked
        return t if on_device else t.clone()


@contextlib.contextmanager
def _offloaded_checkpoints(model: nn.Module, offload: _TracedOffload | None):
    """The model's checkpoint functions run inside ``offload``'s hooks for the trace (none: unchanged)."""
    from ..sequence.offload import OffloadedCheckpoint, checkpointing_modules

    wrapped = []
    if offload is not None:
        for m in checkpointing_modules(model):
            wrapped.append((m, m._gradient_checkpointing_func))
            m._gradient_checkpointing_func = OffloadedCheckpoint(m._gradient_checkpointing_func, offload)
    try:
        yield
    finally:
        for m, inner in wrapped:
            m._gradient_checkpointing_func = inner


# -- model ------------------------------------------------------------------------------------------
def resolve_model(spec: Any) -> nn.Module | int:
    """An ``nn.Module`` (parameters on meta unless ``spec`` is one) or a parameter count."""
    if isinstance(spec, nn.Module):
        return spec
    if isinstance(spec, bool) or (isinstance(spec, (int, float)) and spec <= 0):
        raise ValueError(f"planner: a parameter count must be a positive number; got {spec!r}")
    if isinstance(spec, (int, float)):
        return int(spec)
    return _meta_model(_load_config(spec) if isinstance(spec, (str, os.PathLike)) else spec)


def _load_config(name: str | os.PathLike):
    from transformers import AutoConfig, LlamaConfig

    text = str(name)
    if text in BUILTIN_MODELS:
        return LlamaConfig(**BUILTIN_MODELS[text], max_position_embeddings=4096, use_cache=False)
    if os.path.exists(text):
        return AutoConfig.from_pretrained(text)
    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)
    except (OSError, ValueError) as exc:
        local_error = exc
    if "/" in text and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", ""):
        try:
            return AutoConfig.from_pretrained(text)
        except (OSError, ValueError) as exc:
            local_error = exc
    raise ValueError(
        f"planner: unknown model {text!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), not a "
        f"local config file or folder, and not a Hugging Face model ('org/name') that could be "
        f"loaded ({type(local_error).__name__}: {str(local_error).splitlines()[0]})"
    )


def _meta_model(config) -> nn.Module:
    """The model of a transformers config on the meta device, in fp32 whatever ``config.dtype`` says:
    the plan's precision is ``param_dtype`` over fp32 masters, not the dtype a checkpoint was saved in."""
    from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

    from ..loading.materialize import empty_model

    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"planner: expected an nn.Module, a transformers config, a model name or path, or a "
            f"parameter count; got {type(config).__name__}"
        )
    try:
        model = empty_model(lambda: AutoModelForCausalLM.from_config(config))
    except ValueError:  # not a causal LM architecture
        model = empty_model(lambda: AutoModel.from_config(config))
    return model.float()


def hf_inputs(model: nn.Module, batch: int, seq: int) -> Callable[[], tuple[tuple, dict]]:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ValueError(
            "planner: batch/seq activations need a transformers model (config.vocab_size) or "
            "inputs=: a callable returning (args, kwargs) for one forward"
        )

    def make() -> tuple[tuple, dict]:
        ids = torch.randint(0, vocab, (batch, seq))
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}

    return make


def default_loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return leaves[0].float().sum()


class checkpointing:
    """Activation checkpointing of a transformers model's blocks for the duration of the trace."""

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.model, self.enabled = model, enabled
        prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
        self.enable = getattr(model, f"{prefix}_checkpointing_enable", None)
        self.disable = getattr(model, f"{prefix}_checkpointing_disable", None)

    def __enter__(self) -> None:
        if not self.enabled:
            return
        if self.enable is None:
            raise ValueError(
                "planner: checkpointing=True needs a transformers model "
                "(activation_checkpointing_enable); checkpoint other models' blocks yourself"
            )
        self.enable({"use_reentrant": False})

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.disable()


def synthetic_trace(numel: int) -> Trace:
    """A parameter count as ``SYNTHETIC_BLOCKS`` equal blocks run in order (no root, no activations)."""
    sizes = [numel // SYNTHETIC_BLOCKS + (u < numel % SYNTHETIC_BLOCKS) for u in range(SYNTHETIC_BLOCKS)]
    params = [ParamInfo(f"block{u}", n, True, u + 1) for u, n in enumerate(sizes)]
    events: list[tuple] = [("fwd_pre", 0, False)]
    for u in range(1, SYNTHETIC_BLOCKS + 1):
        events += [("fwd_pre", u, False), ("fwd_post", u, False)]
    events += [("fwd_post", 0, False), ("backward",), ("bwd_pre", 0, True)]
    for u in range(SYNTHETIC_BLOCKS, 0, -1):
        events += [("bwd_pre", u, True), ("grad", u - 1), ("bwd_post", u, True)]
    events.append(("end",))
    names = ["<root>"] + [f"block{u}" for u in range(SYNTHETIC_BLOCKS)]
    return Trace(params=params, unit_names=names, events=events)
