"""``ZeroConfig``: the one frozen, validated configuration; ``ZeroConfig.from_env`` reads its ``ZERO_PLUGIN_*``
variables.  The engine reads no other environment variable except one test switch,
``ZERO_PLUGIN_BUFFERED_COLLECTIVES`` (``collectives.regions_in_place``: the NCCL layout on gloo), and
``LOCAL_WORLD_SIZE`` for ``shard_group_size="node"`` and the host-memory share of ``trim_each_unit_above``, read
here only, by :meth:`ZeroConfig.resolved_shard_group_size` and :meth:`ZeroConfig.local_processes` at setup.

Values are normalised on construction (dtype names -> ``torch.dtype``, lists -> tuples) so that equal
settings compare, hash and fingerprint equally on every rank, however they were written: the checks are in
``config_values.py``, the file and environment sources in ``config_sources.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from . import config_sources as sources
from . import config_values as values

__all__ = ["ZeroConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """Settings of one zero_plugin run; one config serves every stage.

    Stage-3-only knobs are accepted, and ignored, at stages 0-2 so that a
    script switches stage by changing ``stage`` alone.
    """

    stage: int = 2
    """ZeRO stage (Rajbhandari et al. 2020, section 5): 0 = DDP baseline, 1 = shard optimizer state (P_os),
    2 = + gradients (P_os+g), 3 = + parameters (P_os+g+p). Default 2."""
    offload_optimizer: str = "none"
    """Where optimizer state and step run: "none" (device) or "cpu"; None/False/True normalise. Default "none"."""
    offload_params: bool = False
    """Stage 3 only: keep parameter shards on CPU between uses. Default False."""
    param_dtype: torch.dtype | None = None
    """dtype of parameters in forward/backward; None keeps the model's dtype. Default None."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in; None = same as param_dtype. Default None."""
    master_dtype: torch.dtype = torch.float32
    """dtype of optimizer master weights when param_dtype is lower precision; fp32 or fp64. Default fp32."""
    bucket_size_mb: float = 25.0
    """Gradient bucket size for stages 0-2, in MiB; in (0, 4096]. Default 25.0."""
    prefetch_depth: int = 1
    """Stage 3: units all-gathered ahead of the one running; 0..8 units. Default 1."""
    persistence_threshold: int = 0
    """Stage 3: parameters with numel <= this (elements) join the root unit: still sharded, but gathered once per
    step with the root instead of with their block ([Note: persistent parameters] in stage3/policy.py); >= 0.
    Default 0."""
    linear_slice_numel: int = 1 << 22
    """Stage 3: a unit made of one frozen ``nn.Linear`` or ``nn.Embedding`` with at least twice this many weight
    elements (an untied LM head or input embedding under LoRA, a multi-billion-parameter model's MLP projections) is
    computed one row-slice of at most this many elements at a time in forward (and a linear's backward), never
    gathered whole ([Note: sliced linear units] in stage3/sliced.py); elements, >= 0, 0 = off. Default
    2**22 (16 MiB in fp32: at 3B also the attention's q and o projections, 36 MiB each)."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered params after forward; False keeps them until backward,
    trading memory for one less all-gather. Default True."""
    accumulate_full_grads: bool = False
    """Stage 3, gradient accumulation: False reduce-scatters every backward, also under ``zp.no_sync``, into the
    shard gradients (no extra memory, one reduce-scatter of Ψ per micro-batch); True keeps each unit's full
    gradients across the ``no_sync`` backwards and reduce-scatters once, in the synced backward (FSDP2's
    ``set_requires_gradient_sync(False)``): 1/A of the reduction traffic for A micro-batches, for the full
    gradients of every unit on every rank, Ψ × reduce-dtype bytes (4Ψ in fp32), until that backward
    ([Note: deferred reduction] in stage3/accumulate.py). Default False."""
    unit_classes: tuple = ()
    """Stage 3: module classes, or names matched against ``type(m).__name__`` or the qualified name, whose
    instances become units; empty = the model's ``_no_split_modules``, else one unit. Default ()."""
    unit_policy: Callable[[torch.nn.Module, str], bool] | None = None
    """Stage 3: callable (module, qualified_name) -> bool choosing units; excludes unit_classes. Default None."""
    clip_grad_norm: float | None = None
    """Max global gradient norm (2-norm over every rank's shard), clipped in ZeroOptimizer.step right before the
    update, as torch's clip_grad_norm_ there would; an explicit zp.clip_grad_norm_ earlier in the step applies
    first, then this one (the smaller bound wins); > 0, None = no clipping. Default None."""
    loss_scaling: bool | None = None
    """Scale the loss before backward and unscale the gradients before clipping and the step, skipping a step
    with inf/NaN on any rank on every rank (``optim/loss_scale.py``): None = on exactly when param_dtype is fp16;
    True = also with parameters in another dtype, for a forward under ``torch.autocast(dtype=torch.float16)``
    (torch AMP's recipe, fp32 parameters + GradScaler; Accelerate's ``mixed_precision="fp16"`` sets it);
    False = off, even with fp16 parameters (inf/NaN steps are still skipped, with a warning). Default None."""
    loss_scale: str | float = "dynamic"
    """Loss scale when loss scaling is on (see loss_scaling): "dynamic" (halved on inf/NaN, doubled after
    loss_scale_growth_interval clean steps, as torch's GradScaler) or a fixed factor > 0. Default "dynamic"."""
    loss_scale_init: float = 65536.0
    """Dynamic loss scaling: the first scale (torch GradScaler's ``init_scale``); > 0. Default 65536.0."""
    loss_scale_growth_interval: int = 2000
    """Dynamic loss scaling: consecutive steps without inf/NaN after which the scale doubles (GradScaler's
    ``growth_interval``); >= 1 steps. Default 2000."""
    trim_host_heap: bool = True
    """Stage 3 on CPU: hand freed heap pages back to the OS once per forward, at its end (lower peak RSS;
    the pages are faulted in again, which costs some step time: [Note: heap trimming] in
    ``engines/hostmem.py``), and before every unit's gather too when memory is tight (see
    trim_each_unit_above); no effect on CUDA. Default True."""
    trim_each_unit_above: float = 0.33
    """Stage 3 on CPU with trim_host_heap: also trim before every unit's gather (forward and backward) when, once
    the model is sharded, the rank's RSS exceeds this fraction of its share of the host's memory (total memory /
    ``LOCAL_WORLD_SIZE``, or the ranks where that is unset): a large model, whose peak then drops by the heap holes
    it would re-touch, at a page-fault cost that its step time hides ([Note: eager trimming when memory is tight] in
    ``engines/hostmem.py``); >= 0, 0 = always, >= 1 = never. Default 0.33."""
    cpu_ram_efficient_loading: bool = False
    """Stages 0-2 under ``zero_plugin.run``: only rank 0 reads a safetensors ``from_pretrained`` checkpoint, the
    other ranks build the model on meta and receive rank 0's values in ``zp.setup`` (as Accelerate's FSDP option
    of that name), so N processes neither read the disk at once nor hold N copies before setup.  Stage 3 loads
    lazily on every rank, one unit at a time, whatever this says (unless lazy_loading is False). Default False."""
    lazy_loading: bool = True
    """Under ``zero_plugin.run``: a safetensors ``from_pretrained`` builds the model on meta wherever ``zp.setup``
    reads the weights itself (every rank at stage 3; ranks other than 0 with cpu_ram_efficient_loading), so no
    process holds a full copy ([Note: lazy from_pretrained] in ``loading/lazy_pretrained.py``). False: every
    process loads the whole model eagerly, as without zero_plugin (for scripts that need the weights before
    ``prepare``, e.g. to run the model). Default True."""
    debug_collectives: bool = False
    """Record each rank's collective sequence for divergence reports. Default False."""
    timeout_s: float = 600.0
    """Seconds a collective may block before zero_plugin reports a hang; > 0. Default 600.0."""
    check_ranks: bool = True
    """Verify at setup that every rank has the same config and model. Default True."""
    state_dict_rank0_only: bool = False
    """Stage 3: ``model.state_dict()`` (and so ``save_pretrained``) still gathers on every rank, but only rank 0
    keeps the full CPU tensors; the other ranks get ``{}`` (host memory: one copy of the model instead of one
    per rank). Stages 0-2 keep torch's own state_dict. Default False."""

    shard_group_size: int | str | None = None
    """Stages 1-3: hierarchical sharding (FSDP2's HSDP, DeepSpeed's MiCS): model states sharded within groups
    of this many consecutive ranks and replicated across the world_size / k groups; gradients reduce-scattered
    in the group, then the shard all-reduced across the groups ([Note: hierarchical groups] in
    collectives.py). An int (ranks) that divides the world size; "node" = ``LOCAL_WORLD_SIZE`` of the
    environment, resolved at setup; None = the whole world (no replicas). Ignored at stage 0, which shards
    nothing, and in a one-rank world. Default None."""
    quantized_weights: bool = False
    """Stage 3, ZeRO++ qwZ: all-gather parameters as block-wise int8 (one float32 scale per
    ``quantization_block`` elements), about 1/4 of the fp32 gather bytes (1/2 of bf16); the shards and the
    optimizer's masters stay exact, only the gathered copy used in forward and backward is quantized
    ([Note: qwZ gather] in comm/quantized.py). DeepSpeed: ``zero_quantized_weights``. Default False."""
    quantized_gradients: bool = False
    """Stage 3, ZeRO++ qgZ: reduce-scatter gradients as block-wise int8 through one all-to-all, dequantized and
    summed in fp32 (fp64 for fp64 gradients) by the owner of each shard ([Note: qgZ reduction] in
    comm/quantized.py). DeepSpeed: ``zero_quantized_gradients``. Default False."""
    quantization_block: int = 2048
    """Elements per int8 block (one float32 scale each) for quantized_weights / quantized_gradients; 64..2**20.
    Default 2048."""
    secondary_shard_size: int | str | None = None
    """Stage 3, ZeRO++ hpZ: after each forward gather keep this rank's 1/k of the unit over k consecutive ranks
    (a node) and gather from it in backward, inside the node: Ψ/k more memory per rank between forward and
    backward, no inter-node bytes in backward gathers ([Note: secondary shards] in stage3/secondary.py). An int
    k dividing the world size; "node" = ``LOCAL_WORLD_SIZE``; None = off. Excludes shard_group_size (whose
    gathers stay in the group already). DeepSpeed: ``zero_hpz_partition_size``. Default None."""

    def __post_init__(self) -> None:
        self._normalise_fields()
        self._validate()

    def _normalise_fields(self) -> None:
        """Check each field alone and store its canonical form (the instance is frozen)."""

        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("stage", values.as_int("stage", self.stage, 0, 3, allowed="one of 0, 1, 2, 3"))
        put("offload_optimizer", values.as_offload(self.offload_optimizer))
        put("offload_params", values.as_bool("offload_params", self.offload_params))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            put(name, None if value is None else values.as_dtype(name, value))
        put("master_dtype", values.as_dtype("master_dtype", self.master_dtype, (torch.float32, torch.float64)))
        put("bucket_size_mb", values.as_positive_float("bucket_size_mb", self.bucket_size_mb, hi=4096.0))
        put("prefetch_depth", values.as_int("prefetch_depth", self.prefetch_depth, 0, 8))
        put("persistence_threshold", values.as_int("persistence_threshold", self.persistence_threshold, 0))
        put("linear_slice_numel", values.as_int("linear_slice_numel", self.linear_slice_numel, 0))
        put("trim_each_unit_above", values.as_nonnegative_float("trim_each_unit_above", self.trim_each_unit_above))
        put("reshard_after_forward", values.as_bool("reshard_after_forward", self.reshard_after_forward))
        put("accumulate_full_grads", values.as_bool("accumulate_full_grads", self.accumulate_full_grads))
        put("unit_classes", values.as_unit_classes(self.unit_classes))
        put("unit_policy", values.as_unit_policy(self.unit_policy))
        if self.clip_grad_norm is not None:
            put("clip_grad_norm", values.as_positive_float("clip_grad_norm", self.clip_grad_norm))
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, bool):
            raise values.error("loss_scaling", "True, False or None", self.loss_scaling)
        put("loss_scale", values.as_loss_scale(self.loss_scale))
        put("loss_scale_init", values.as_positive_float("loss_scale_init", self.loss_scale_init))
        put(
            "loss_scale_growth_interval",
            values.as_int("loss_scale_growth_interval", self.loss_scale_growth_interval, 1),
        )
        put("trim_host_heap", values.as_bool("trim_host_heap", self.trim_host_heap))
        put("cpu_ram_efficient_loading", values.as_bool("cpu_ram_efficient_loading", self.cpu_ram_efficient_loading))
        put("lazy_loading", values.as_bool("lazy_loading", self.lazy_loading))
        put("debug_collectives", values.as_bool("debug_collectives", self.debug_collectives))
        put("timeout_s", values.as_positive_float("timeout_s", self.timeout_s))
        put("check_ranks", values.as_bool("check_ranks", self.check_ranks))
        put("state_dict_rank0_only", values.as_bool("state_dict_rank0_only", self.state_dict_rank0_only))
        put("shard_group_size", values.as_group_size("shard_group_size", self.shard_group_size))
        put("quantized_weights", values.as_bool("quantized_weights", self.quantized_weights))
        put("quantized_gradients", values.as_bool("quantized_gradients", self.quantized_gradients))
        put("quantization_block", values.as_int("quantization_block", self.quantization_block, 64, 2**20))
        put("secondary_shard_size", values.as_group_size("secondary_shard_size", self.secondary_shard_size))

    def _validate(self) -> None:
        """All cross-field rules; fields are already normalised."""
        if self.offload_params and self.stage != 3:
            raise ValueError(
                "ZeroConfig.offload_params=True requires ZeroConfig.stage=3 (only stage 3 shards "
                f"parameters); got stage={self.stage}"
            )
        if self.offload_optimizer == "cpu" and self.stage == 0:
            raise ValueError(
                "ZeroConfig.offload_optimizer='cpu' requires ZeroConfig.stage 1, 2 or 3 (ZeRO-Offload moves the "
                "partitioned optimizer state to the host); got stage=0"
            )
        if self.unit_classes and self.unit_policy is not None:
            raise ValueError(
                "ZeroConfig.unit_classes and ZeroConfig.unit_policy are mutually exclusive, set at most one; "
                f"got unit_classes={self.unit_classes!r} and unit_policy={values.qualname(self.unit_policy)!r}"
            )
        zeropp = {
            "quantized_weights": self.quantized_weights,
            "quantized_gradients": self.quantized_gradients,
            "secondary_shard_size": self.secondary_shard_size is not None,
        }
        for name, on in zeropp.items():
            if on and self.stage != 3:
                raise ValueError(
                    f"ZeroConfig.{name}={getattr(self, name)!r} (ZeRO++) requires ZeroConfig.stage=3 (only stage 3 "
                    f"gathers parameters and reduce-scatters per unit); got stage={self.stage}; set stage=3 or "
                    f"leave {name} at its default"
                )
        if self.secondary_shard_size is not None and self.shard_group_size is not None:
            raise ValueError(
                f"ZeroConfig.secondary_shard_size={self.secondary_shard_size!r} (hpZ) and shard_group_size="
                f"{self.shard_group_size!r} exclude each other: with shard groups every gather already stays "
                "inside the group; set at most one"
            )
        if self.loss_scale != "dynamic" and not self.scales_loss:
            # Only fp16's narrow exponent range underflows gradients; without scaling a fixed scale goes unused.
            raise ValueError(
                f"ZeroConfig.loss_scale={self.loss_scale!r} (fixed) requires loss scaling: ZeroConfig.param_dtype="
                f"fp16, or loss_scaling=True for an fp16-autocast forward; got param_dtype={self.param_dtype!r}, "
                f"loss_scaling={self.loss_scaling!r}; use loss_scale='dynamic' otherwise"
            )

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

    @property
    def offload(self) -> bool:
        """True when optimizer state lives on CPU."""
        return self.offload_optimizer == "cpu"

    def resolved_shard_group_size(self, world_size: int, environ: Mapping[str, str] | None = None) -> int | None:
        """Ranks per shard group for a world of ``world_size`` ranks, or None when the whole world is one group
        (``shard_group_size`` None or equal to the world size, stage 0, or a one-rank world: a script run
        without a launcher).  "node" is ``LOCAL_WORLD_SIZE`` (torchrun's processes per node) from ``environ``
        (default ``os.environ``), read by ``_local_world_size`` only."""
        return self._resolve_group_size("shard_group_size", world_size, environ)

    def resolved_secondary_shard_size(self, world_size: int, environ: Mapping[str, str] | None = None) -> int | None:
        """hpZ's k for a world of ``world_size`` ranks, or None when off (None, k equal to the world size,
        which gathers over the same ranks anyway, or a one-rank world); "node" as for shard_group_size."""
        return self._resolve_group_size("secondary_shard_size", world_size, environ)

    @staticmethod
    def local_processes(environ: Mapping[str, str] | None = None, default: int = 1) -> int:
        """Processes on this host: ``LOCAL_WORLD_SIZE`` (torchrun's, Accelerate's), else ``default`` (the engine
        passes its ranks' count: Lightning's own launcher sets no ``LOCAL_WORLD_SIZE``, and counting every rank as
        local errs towards trimming more, not towards a higher peak)."""
        k, _ = _local_world_size(environ)
        return k if k is not None else max(1, default)

    def _resolve_group_size(self, field: str, world_size: int, environ: Mapping[str, str] | None) -> int | None:
        """The one place "node" resolves ``LOCAL_WORLD_SIZE``."""
        value = k = getattr(self, field)
        if k is None or self.stage == 0 or world_size == 1:
            return None
        if k == "node":
            k, text = _local_world_size(environ)
            if k is None:
                raise ValueError(
                    f'ZeroConfig.{field}="node" reads LOCAL_WORLD_SIZE (the processes per node, set by '
                    f"torchrun), which must be an int >= 1; got {text!r}"
                )
        if world_size % k:
            raise ValueError(
                f"ZeroConfig.{field} must divide the world size {world_size}; got {value!r}"
                + (f" (LOCAL_WORLD_SIZE={k})" if value == "node" else "")
            )
        return None if k == world_size else k

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied, validated again."""
        sources.check_known_keys(changes, "ZeroConfig.replace", _FIELD_NAMES)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-safe dict: dtypes as "bf16"-style names, classes and unit_policy as qualified names."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            out[name] = None if out[name] is None else values.DTYPE_SHORT[out[name]]
        out["unit_classes"] = [values.qualname(c) for c in self.unit_classes]
        out["unit_policy"] = None if self.unit_policy is None else values.qualname(self.unit_policy)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZeroConfig:
        """Build from a mapping; string values (YAML, env) are parsed per field, e.g. "3", "true", "bf16"."""
        if not isinstance(data, Mapping):
            raise ValueError(f"ZeroConfig.from_dict expects a mapping of field names; got {type(data).__name__}")
        sources.check_known_keys(data, "ZeroConfig.from_dict", _FIELD_NAMES)
        return cls(**{k: sources.parse_text(k, v) if isinstance(v, str) else v for k, v in data.items()})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ZeroConfig:
        """Load a .yaml/.yml/.json file holding the fields at top level or under ``zero_plugin:``."""
        data = sources.read_config_file(Path(path))
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from exc

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeroConfig:
        """ZERO_PLUGIN_CONFIG (a file) first, then ZERO_PLUGIN_<FIELD> / ZERO_PLUGIN_OFFLOAD override it."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        config_path = env.get(sources.ENV_CONFIG, "")
        if config_path:
            try:
                data.update(sources.read_config_file(Path(config_path)))
            except (ValueError, FileNotFoundError) as exc:
                raise type(exc)(f"{sources.ENV_CONFIG}={config_path!r}: {exc}") from exc
        overrides = sources.env_overrides(env, _FIELD_NAMES)
        data.update({field: env[var] for var, field in overrides.items()})
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            used = ([sources.ENV_CONFIG] if config_path else []) + list(overrides)
            origin = ", ".join(f"{var}={env[var]!r}" for var in used)
            raise ValueError(f"{exc} (from environment: {origin})") from exc

    def fingerprint(self) -> str:
        """sha256 hex digest of the sorted to_dict() JSON; equal on ranks whose configs agree."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ZeroConfig))


def _local_world_size(environ: Mapping[str, str] | None) -> tuple[int | None, str]:
    """``LOCAL_WORLD_SIZE`` (default ``os.environ``) as an int >= 1 (None when unset or not one) and its text: the
    one place it is read (:meth:`ZeroConfig.resolved_shard_group_size`, :meth:`ZeroConfig.local_processes`)."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    return (int(text) if text.strip().isdigit() and int(text) >= 1 else None), text
