"""The groups of ``ZeroConfig`` settings: small frozen records, one per concern, each field declared once with its
default, its kind of value and its documentation.  ``ZeroConfig`` (``config.py``) holds ``stage`` and one record
per group: ``offload``, ``precision``, ``comm``, ``stage3``, ``loading`` and ``debug``.

Every field also has a *flat name*, unique across the groups: its own name, or the ``flat=`` given where it is
declared when the group's name would repeat in it (``offload.optimizer`` is ``offload_optimizer``).  The flat name
is what existing code, ``ZERO_PLUGIN_<FLAT_NAME>`` variables, saved configs and ``ZeroConfig.to_dict()`` use;
``ZeroConfig`` accepts it as a keyword and reads it as an attribute (``cfg.offload_optimizer`` is
``cfg.offload.optimizer``).

Adding a switch is one declaration here, in the group it belongs to::

    my_switch: bool = setting(False, values.BOOL)
    \"\"\"What it does, for which stages; its unit and range. Default False.\"\"\"

which gives the grouped keyword (``Stage3Config(my_switch=True)``) and the flat one (``ZeroConfig(my_switch=True)``),
both attribute reads, nested and flat dicts / files, ``ZERO_PLUGIN_MY_SWITCH``, ``to_dict`` and the fingerprint
(which then changes for every config: ranks of one run share a version).  Its kind (``config_values.py``) checks
and normalises the value and reads its text form; a new kind of value is added there.  A rule tying it to another
field (of any group) goes in ``ZeroConfig._validate``, the one place of cross-field rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch

from . import config_values as values

__all__ = [
    "CommConfig",
    "DebugConfig",
    "LoadingConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "Stage3Config",
]


def setting(default: Any, kind: values.Kind, *, flat: str | None = None) -> Any:
    """Declare a group field: its default, the :class:`~config_values.Kind` of its values and, when it differs from
    the field's name, its flat name in ``ZeroConfig``."""
    return dataclasses.field(default=default, metadata={"kind": kind, "flat": flat})


def flat_name(field: dataclasses.Field) -> str:
    return field.metadata["flat"] or field.name


def kind_of(field: dataclasses.Field) -> values.Kind:
    return field.metadata["kind"]


def label(group: str, field: dataclasses.Field) -> str:
    """How errors name a field: its flat name, and its place in the group when that reads differently."""
    flat = flat_name(field)
    return flat if flat == field.name else f"{flat} ({group}.{field.name})"


class _Group:
    """What every group shares: each field checked and normalised alone on construction (so equal settings
    compare, hash and fingerprint equally however written); cross-field rules are ``ZeroConfig._validate``'s."""

    __slots__ = ()
    key: ClassVar[str]
    """The group's attribute on ``ZeroConfig``."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = kind_of(field).check(label(self.key, field), getattr(self, field.name))
            object.__setattr__(self, field.name, value)


_record = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)


@_record
class OffloadConfig(_Group):
    """Where the model states live between uses (ZeRO-Offload, Ren et al. 2021).

    Truthy when the optimizer state is offloaded: what ``ZeroConfig.offload`` meant when it was a bool, kept so
    that ``if config.offload:`` reads the same; new code reads ``optimizer`` / ``params``.
    """

    key: ClassVar[str] = "offload"

    optimizer: str = setting("none", values.OFFLOAD, flat="offload_optimizer")
    """Where optimizer state and step run: "none" (device) or "cpu"; None/False/True normalise. Stages 1-3.
    Default "none"."""
    params: bool = setting(False, values.BOOL, flat="offload_params")
    """Stage 3 only: keep parameter shards on CPU between uses. Default False."""
    optimizer_partition: str = setting("auto", values.PARTITION)
    """How stages 1-3 split the optimizer's work and state over the ranks ([Note: optimizer partitions] in
    optim/partition.py): "elements" steps each rank's flat region of every parameter (exact only for optimizers
    whose update is elementwise: SGD, Adam/AdamW, ...); "parameters" gives each parameter whole, in its real
    shape, to one owning rank, which steps it (shape-aware optimizers: Adafactor, Muon, LAMB, 8-bit
    bitsandbytes); "auto" picks "elements" for the optimizers known to be elementwise and "parameters" for every
    other. Forcing "elements" on an optimizer known to read a parameter's shape is refused. Ignored at stage 0
    (whole parameters on every rank). Default "auto"."""

    activations: str = setting("none", values.OFFLOAD, flat="offload_activations")
    """Where the inputs of activation-checkpointed layers wait between forward and the recompute in backward:
    "none" (the device) or "cpu" (host memory: pinned, copied on a side stream without blocking on CUDA, brought
    back for the recompute; on CPU the same code runs and moves nothing). Needs the model's activation
    checkpointing (transformers' ``activation_checkpointing_enable``), checked at setup; any stage, with or
    without sequence parallelism ([Note: activation offload] in sequence/offload.py, docs/long-context.md).
    None/False/True normalise. Default "none"."""

    def __bool__(self) -> bool:
        return self.optimizer == "cpu"


@_record
class PrecisionConfig(_Group):
    """The dtypes of parameters, gradient reduction and master weights, loss scaling, and gradient clipping (it
    runs in ``ZeroOptimizer.step`` on the unscaled gradients, right after loss scaling's check)."""

    key: ClassVar[str] = "precision"

    param_dtype: torch.dtype | None = setting(None, values.dtype(optional=True))
    """dtype of parameters in forward/backward; None keeps the model's dtype. Default None."""
    reduce_dtype: torch.dtype | None = setting(None, values.dtype(optional=True))
    """dtype gradients are reduced in; None = same as param_dtype. Default None."""
    master_dtype: torch.dtype = setting(torch.float32, values.dtype((torch.float32, torch.float64)))
    """dtype of optimizer master weights when param_dtype is lower precision; fp32 or fp64. Default fp32."""
    clip_grad_norm: float | None = setting(None, values.positive(optional=True))
    """Max global gradient norm (2-norm over every rank's shard), clipped in ZeroOptimizer.step right before the
    update, as torch's clip_grad_norm_ there would; an explicit zp.clip_grad_norm_ earlier in the step applies
    first, then this one (the smaller bound wins); > 0, None = no clipping. Default None."""
    loss_scaling: bool | None = setting(None, values.OPTIONAL_BOOL)
    """Scale the loss before backward and unscale the gradients before clipping and the step, skipping a step
    with inf/NaN on any rank on every rank (``optim/loss_scale.py``): None = on exactly when param_dtype is fp16;
    True = also with parameters in another dtype, for a forward under ``torch.autocast(dtype=torch.float16)``
    (torch AMP's recipe, fp32 parameters + GradScaler; Accelerate's ``mixed_precision="fp16"`` sets it);
    False = off, even with fp16 parameters (inf/NaN steps are still skipped, with a warning). Default None."""
    loss_scale: str | float = setting("dynamic", values.LOSS_SCALE)
    """Loss scale when loss scaling is on (see loss_scaling): "dynamic" (halved on inf/NaN, doubled after
    loss_scale_growth_interval clean steps, as torch's GradScaler) or a fixed factor > 0. Default "dynamic"."""
    loss_scale_init: float = setting(65536.0, values.positive())
    """Dynamic loss scaling: the first scale (torch GradScaler's ``init_scale``); > 0. Default 65536.0."""
    loss_scale_growth_interval: int = setting(2000, values.integer(1))
    """Dynamic loss scaling: consecutive steps without inf/NaN after which the scale doubles (GradScaler's
    ``growth_interval``); >= 1 steps. Default 2000."""

    @property
    def scales_loss(self) -> bool:
        """True when the loss is scaled (loss_scaling, or by default param_dtype fp16)."""
        return self.param_dtype == torch.float16 if self.loss_scaling is None else self.loss_scaling

    @property
    def mixed_precision(self) -> bool:
        """True when param_dtype is set and has fewer bits than master_dtype."""
        if self.param_dtype is None:
            return False
        return torch.finfo(self.param_dtype).bits < torch.finfo(self.master_dtype).bits

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        """dtype gradients are reduced in: reduce_dtype, else param_dtype, else None (the gradient's own)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


@_record
class CommConfig(_Group):
    """How the ranks communicate: gradient buckets, the hang timeout, hierarchical sharding, ZeRO++ (Wang et
    al. 2023: qwZ, qgZ, hpZ; stage 3 only) and the sequence-parallel groups."""

    key: ClassVar[str] = "comm"

    bucket_size_mb: float = setting(25.0, values.positive(hi=4096.0))
    """Gradient bucket size for stages 0-2, in MiB; in (0, 4096]. Default 25.0."""
    timeout_s: float = setting(600.0, values.positive())
    """Seconds a collective may block before zero_plugin reports a hang; > 0. Default 600.0."""
    shard_group_size: int | str | None = setting(None, values.GROUP_SIZE)
    """Stages 1-3: hierarchical sharding (FSDP2's HSDP, DeepSpeed's MiCS): model states sharded within groups
    of this many consecutive ranks and replicated across the world_size / k groups; gradients reduce-scattered
    in the group, then the shard all-reduced across the groups ([Note: hierarchical groups] in
    collectives.py). An int (ranks) that divides the world size; "node" = ``LOCAL_WORLD_SIZE`` of the
    environment, resolved at setup; None = the whole world (no replicas). Ignored at stage 0, which shards
    nothing, and in a one-rank world. Default None."""
    quantized_weights: bool = setting(False, values.BOOL)
    """Stage 3, ZeRO++ qwZ: all-gather parameters as block-wise int8 (one float32 scale per
    ``quantization_block`` elements), about 1/4 of the fp32 gather bytes (1/2 of bf16); the shards and the
    optimizer's masters stay exact, only the gathered copy used in forward and backward is quantized
    ([Note: qwZ gather] in comm/quantized.py). DeepSpeed: ``zero_quantized_weights``. Default False."""
    quantized_gradients: bool = setting(False, values.BOOL)
    """Stage 3, ZeRO++ qgZ: reduce-scatter gradients as block-wise int8 through one all-to-all, dequantized and
    summed in fp32 (fp64 for fp64 gradients) by the owner of each shard ([Note: qgZ reduction] in
    comm/quantized.py). DeepSpeed: ``zero_quantized_gradients``. Default False."""
    quantization_block: int = setting(2048, values.integer(64, 2**20))
    """Elements per int8 block (one float32 scale each) for quantized_weights / quantized_gradients; 64..2**20.
    Default 2048."""
    secondary_shard_size: int | str | None = setting(None, values.GROUP_SIZE)
    """Stage 3, ZeRO++ hpZ: after each forward gather keep this rank's 1/k of the unit over k consecutive ranks
    (a node) and gather from it in backward, inside the node: Ψ/k more memory per rank between forward and
    backward, no inter-node bytes in backward gathers ([Note: secondary shards] in stage3/secondary.py). An int
    k dividing the world size; "node" = ``LOCAL_WORLD_SIZE``; None = off. Excludes shard_group_size (whose
    gathers stay in the group already). DeepSpeed: ``zero_hpz_partition_size``. Default None."""
    sequence_parallel_size: int = setting(1, values.integer(1))
    """Ulysses sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509) for transformers decoder models: each
    group of this many consecutive ranks trains on the same sequences, each rank holding 1/K of every sequence's
    tokens; attention runs on the whole sequence through two all-to-alls in the group (heads scattered, sequence
    gathered, and back: ``zero_plugin/sequence/``). ZeRO still shards and averages over the whole world, so the
    world size / K groups are the data-parallel ones. ``zp.setup`` switches the model's attention; the batch
    (``zp.sequence_parallel_batch``) and the loss (``zp.sequence_parallel_loss``) are split and reduced by the
    caller (docs/long-context.md). An int >= 1 (ranks) that divides the world size (checked at setup); the
    model's ``num_attention_heads`` must be a multiple of it. 1 = off. Default 1."""


@_record
class Stage3Config(_Group):
    """Stage 3's units and their schedule: which modules are gathered together, how far ahead, what is kept,
    host-memory trimming on CPU and the full state dict.  Accepted, and ignored, at stages 0-2 so that a script
    switches stage by changing ``stage`` alone."""

    key: ClassVar[str] = "stage3"

    prefetch_depth: int = setting(1, values.integer(0, 8))
    """Units all-gathered ahead of the one running; 0..8 units. Default 1."""
    persistence_threshold: int = setting(0, values.integer(0))
    """Parameters with numel <= this (elements) join the root unit: still sharded, but gathered once per
    step with the root instead of with their block ([Note: persistent parameters] in stage3/policy.py); >= 0.
    Default 0."""
    linear_slice_numel: int = setting(1 << 22, values.integer(0))
    """A unit made of one frozen ``nn.Linear`` or ``nn.Embedding`` with at least twice this many weight
    elements (an untied LM head or input embedding under LoRA, a multi-billion-parameter model's MLP projections) is
    computed one row-slice of at most this many elements at a time in forward (and a linear's backward), never
    gathered whole ([Note: sliced linear units] in stage3/sliced.py); elements, >= 0, 0 = off. Default
    2**22 (16 MiB in fp32: at 3B also the attention's q and o projections, 36 MiB each)."""
    reshard_after_forward: bool = setting(True, values.BOOL)
    """Free a unit's gathered params after forward; False keeps them until backward, trading memory for one less
    all-gather. Default True."""
    accumulate_full_grads: bool = setting(False, values.BOOL)
    """Gradient accumulation: False reduce-scatters every backward, also under ``zp.no_sync``, into the
    shard gradients (no extra memory, one reduce-scatter of Ψ per micro-batch); True keeps each unit's full
    gradients across the ``no_sync`` backwards and reduce-scatters once, in the synced backward (FSDP2's
    ``set_requires_gradient_sync(False)``): 1/A of the reduction traffic for A micro-batches, for the full
    gradients of every unit on every rank, Ψ × reduce-dtype bytes (4Ψ in fp32), until that backward
    ([Note: deferred reduction] in stage3/accumulate.py). Default False."""
    unit_classes: tuple = setting((), values.UNIT_CLASSES)
    """Module classes, or names matched against ``type(m).__name__`` or the qualified name, whose instances
    become units; empty = the model's ``_no_split_modules``, else one unit. Default ()."""
    unit_policy: Callable[[torch.nn.Module, str], bool] | None = setting(None, values.UNIT_POLICY)
    """Callable (module, qualified_name) -> bool choosing units; excludes unit_classes. Default None."""
    trim_host_heap: bool = setting(True, values.BOOL)
    """On CPU: hand freed heap pages back to the OS once per forward, at its end (lower peak RSS; the pages are
    faulted in again, which costs some step time: [Note: heap trimming] in ``engines/hostmem.py``), and before
    every unit's gather too when memory is tight (see trim_each_unit_above); no effect on CUDA. Default True."""
    trim_each_unit_above: float = setting(0.33, values.NONNEGATIVE)
    """On CPU with trim_host_heap: also trim before every unit's gather (forward and backward) when, once
    the model is sharded, the rank's RSS exceeds this fraction of its share of the host's memory (total memory /
    ``LOCAL_WORLD_SIZE``, or the ranks where that is unset): a large model, whose peak then drops by the heap holes
    it would re-touch, at a page-fault cost that its step time hides ([Note: eager trimming when memory is tight] in
    ``engines/hostmem.py``); >= 0, 0 = always, >= 1 = never. Default 0.33."""
    state_dict_rank0_only: bool = setting(False, values.BOOL)
    """``model.state_dict()`` (and so ``save_pretrained``) still gathers on every rank, but only rank 0 keeps
    the full CPU tensors; the other ranks get ``{}`` (host memory: one copy of the model instead of one per rank).
    Stages 0-2 keep torch's own state_dict. Default False."""


@_record
class LoadingConfig(_Group):
    """How ``zero_plugin.run`` loads a ``from_pretrained`` model before ``zp.setup``."""

    key: ClassVar[str] = "loading"

    cpu_ram_efficient: bool = setting(False, values.BOOL, flat="cpu_ram_efficient_loading")
    """Stages 0-2 under ``zero_plugin.run``: only rank 0 reads a safetensors ``from_pretrained`` checkpoint, the
    other ranks build the model on meta and receive rank 0's values in ``zp.setup`` (as Accelerate's FSDP option
    of that name), so N processes neither read the disk at once nor hold N copies before setup.  Stage 3 loads
    lazily on every rank, one unit at a time, whatever this says (unless lazy is False). Default False."""
    lazy: bool = setting(True, values.BOOL, flat="lazy_loading")
    """Under ``zero_plugin.run``: a safetensors ``from_pretrained`` builds the model on meta wherever ``zp.setup``
    reads the weights itself (every rank at stage 3; ranks other than 0 with cpu_ram_efficient), so no
    process holds a full copy ([Note: lazy from_pretrained] in ``loading/lazy_pretrained.py``). False: every
    process loads the whole model eagerly, as without zero_plugin (for scripts that need the weights before
    ``prepare``, e.g. to run the model). Default True."""


@_record
class DebugConfig(_Group):
    """Checks and records for finding mistakes across ranks."""

    key: ClassVar[str] = "debug"

    collectives: bool = setting(False, values.BOOL, flat="debug_collectives")
    """Record each rank's collective sequence for divergence reports. Default False."""
    check_ranks: bool = setting(True, values.BOOL)
    """Verify at setup that every rank has the same config and model. Default True."""


GROUPS: dict[str, type] = {
    cls.key: cls for cls in (OffloadConfig, PrecisionConfig, CommConfig, Stage3Config, LoadingConfig, DebugConfig)
}
"""Group attribute on ``ZeroConfig`` -> its record class, in ``ZeroConfig``'s field order."""

FLAT_NAMES: dict[str, tuple[str, dataclasses.Field]] = {
    flat_name(field): (key, field) for key, cls in GROUPS.items() for field in dataclasses.fields(cls)
}
"""Every field's flat name -> (its group, its dataclass field), in declaration order."""

assert len(FLAT_NAMES) == sum(len(dataclasses.fields(cls)) for cls in GROUPS.values()), "flat names must be unique"
assert not FLAT_NAMES.keys() & GROUPS.keys(), "a flat name may not be a group's name"
