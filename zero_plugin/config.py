"""``ZeroConfig``: the one frozen, validated configuration: ``stage`` and one record per group of settings
(``config_groups.py``: ``offload``, ``precision``, ``comm``, ``stage3``, ``loading``, ``debug``), written either way::

    ZeroConfig(stage=3, offload=OffloadConfig(optimizer="cpu"), precision=PrecisionConfig(param_dtype="bf16"))
    ZeroConfig(stage=3, offload_optimizer="cpu", param_dtype="bf16")          # the flat names: the same config
    ZeroConfig.from_dict({"stage": 3, "offload": {"optimizer": "cpu"}, "param_dtype": "bf16"})   # or mixed

A group may also be given as a mapping of its fields.  A setting given both in its group and by its flat name
must agree, else ``ValueError`` names both; a group record holds all its fields, its defaults included.  Every
flat name reads as an attribute (``cfg.offload_optimizer`` is ``cfg.offload.optimizer``).  ``to_dict`` writes the
flat form (``grouped=True``: the nested one; ``from_dict`` reads both), so saved configs, fingerprints and the
``ZERO_PLUGIN_<FLAT_NAME>`` variables are what they were before the groups.  To add a switch, see
``config_groups.py``: one declaration there.

``ZeroConfig.from_env`` reads its ``ZERO_PLUGIN_*`` variables.  The engine reads no other environment variable
except one test switch, ``ZERO_PLUGIN_BUFFERED_COLLECTIVES`` (``collectives.regions_in_place``: the NCCL layout on
gloo), and ``LOCAL_WORLD_SIZE`` for ``shard_group_size="node"`` and the host-memory share of
``trim_each_unit_above``, read here only, by :meth:`ZeroConfig.resolved_shard_group_size` and
:meth:`ZeroConfig.local_processes` at setup.

Values are normalised on construction (dtype names -> ``torch.dtype``, lists -> tuples) so that equal settings
compare, hash and fingerprint equally on every rank, however they were written: the kinds of value are in
``config_values.py``, the file and environment sources in ``config_sources.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from . import config_sources as sources
from . import config_values as values
from .config_groups import (
    FLAT_NAMES,
    GROUPS,
    CommConfig,
    DebugConfig,
    LoadingConfig,
    OffloadConfig,
    PrecisionConfig,
    Stage3Config,
    flat_name,
    kind_of,
    label,
)

__all__ = ["ZeroConfig"]

_STAGE = values.integer(0, 3, allowed="one of 0, 1, 2, 3")


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class ZeroConfig:
    """Settings of one zero_plugin run; one config serves every stage.

    Stage-3-only knobs are accepted, and ignored, at stages 0-2 so that a script
    switches stage by changing ``stage`` alone.  Keyword-only: ``stage``, the groups (records or mappings) and
    any field by its flat name.
    """

    stage: int = 2
    """ZeRO stage (Rajbhandari et al. 2020, section 5): 0 = DDP baseline, 1 = shard optimizer state (P_os),
    2 = + gradients (P_os+g), 3 = + parameters (P_os+g+p). Default 2."""
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    """Optimizer state and parameter shards on the host, and the optimizer's partition over the ranks:
    ``offload_optimizer``, ``offload_params``, ``optimizer_partition``, ``offload_activations``."""
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    """dtypes, loss scaling, clipping: ``param_dtype``, ``reduce_dtype``, ``master_dtype``, ``clip_grad_norm``,
    ``loss_scaling``, ``loss_scale``, ``loss_scale_init``, ``loss_scale_growth_interval``."""
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    """``bucket_size_mb``, ``timeout_s``, ``shard_group_size``, ZeRO++ (``quantized_weights``,
    ``quantized_gradients``, ``quantization_block``, ``secondary_shard_size``) and ``sequence_parallel_size``."""
    stage3: Stage3Config = dataclasses.field(default_factory=Stage3Config)
    """Units and their schedule: ``prefetch_depth``, ``persistence_threshold``, ``linear_slice_numel``,
    ``reshard_after_forward``, ``accumulate_full_grads``, ``unit_classes``, ``unit_policy``, ``trim_host_heap``,
    ``trim_each_unit_above``, ``state_dict_rank0_only``."""
    loading: LoadingConfig = dataclasses.field(default_factory=LoadingConfig)
    """``zero_plugin.run``'s model loading: ``cpu_ram_efficient_loading``, ``lazy_loading``."""
    debug: DebugConfig = dataclasses.field(default_factory=DebugConfig)
    """``debug_collectives``, ``check_ranks``."""

    if TYPE_CHECKING:
        # The flat names, declared for type checkers and IDEs: at run time each is a read-only property added below
        # (``_flat_property``) that reads its group's field.  tests/unit/test_config_groups.py keeps this list equal
        # to ``FLAT_NAMES``, with the same types.  Inside the package, read the groups (``cfg.offload.optimizer``).
        offload_optimizer: str  # offload.optimizer
        offload_params: bool  # offload.params
        optimizer_partition: str  # offload.optimizer_partition
        offload_activations: str  # offload.activations
        param_dtype: torch.dtype | None  # precision.param_dtype
        reduce_dtype: torch.dtype | None  # precision.reduce_dtype
        master_dtype: torch.dtype  # precision.master_dtype
        clip_grad_norm: float | None  # precision.clip_grad_norm
        loss_scaling: bool | None  # precision.loss_scaling
        loss_scale: str | float  # precision.loss_scale
        loss_scale_init: float  # precision.loss_scale_init
        loss_scale_growth_interval: int  # precision.loss_scale_growth_interval
        bucket_size_mb: float  # comm.bucket_size_mb
        timeout_s: float  # comm.timeout_s
        shard_group_size: int | str | None  # comm.shard_group_size
        quantized_weights: bool  # comm.quantized_weights
        quantized_gradients: bool  # comm.quantized_gradients
        quantization_block: int  # comm.quantization_block
        secondary_shard_size: int | str | None  # comm.secondary_shard_size
        sequence_parallel_size: int  # comm.sequence_parallel_size
        prefetch_depth: int  # stage3.prefetch_depth
        persistence_threshold: int  # stage3.persistence_threshold
        linear_slice_numel: int  # stage3.linear_slice_numel
        reshard_after_forward: bool  # stage3.reshard_after_forward
        accumulate_full_grads: bool  # stage3.accumulate_full_grads
        unit_classes: tuple  # stage3.unit_classes
        unit_policy: Callable[[torch.nn.Module, str], bool] | None  # stage3.unit_policy
        trim_host_heap: bool  # stage3.trim_host_heap
        trim_each_unit_above: float  # stage3.trim_each_unit_above
        state_dict_rank0_only: bool  # stage3.state_dict_rank0_only
        cpu_ram_efficient_loading: bool  # loading.cpu_ram_efficient
        lazy_loading: bool  # loading.lazy
        debug_collectives: bool  # debug.collectives
        check_ranks: bool  # debug.check_ranks

    def __init__(
        self,
        *,
        stage: int = 2,
        offload: OffloadConfig | Mapping[str, Any] | None = None,
        precision: PrecisionConfig | Mapping[str, Any] | None = None,
        comm: CommConfig | Mapping[str, Any] | None = None,
        stage3: Stage3Config | Mapping[str, Any] | None = None,
        loading: LoadingConfig | Mapping[str, Any] | None = None,
        debug: DebugConfig | Mapping[str, Any] | None = None,
        **flat: Any,
    ) -> None:
        given = dict(offload=offload, precision=precision, comm=comm, stage3=stage3, loading=loading, debug=debug)
        records = _group_records(None, given, flat)
        sources.check_known_keys(flat, "ZeroConfig()", _KEYS, error=TypeError)
        object.__setattr__(self, "stage", _STAGE.check("stage", stage))
        for key, record in records.items():
            object.__setattr__(self, key, record)
        self._validate()

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
        return self.precision.scales_loss

    @property
    def mixed_precision(self) -> bool:
        """True when param_dtype is set and has fewer bits than master_dtype."""
        return self.precision.mixed_precision

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        """dtype gradients are reduced in: reduce_dtype, else param_dtype, else None (the gradient's own)."""
        return self.precision.effective_reduce_dtype

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

    def resolved_sequence_parallel_size(self, world_size: int) -> int:
        """Ranks per sequence-parallel group in a world of ``world_size`` ranks (``sequence_parallel_size``, 1 =
        off); ``ValueError`` unless it divides the world size (checked at setup, where the world is known)."""
        k = self.sequence_parallel_size
        if world_size % k:
            raise ValueError(
                f"ZeroConfig.sequence_parallel_size={k} must divide the world size {world_size} (each group of "
                f"{k} consecutive ranks shares its sequences); launch a multiple of {k} processes or pick a "
                f"divisor of {world_size}"
            )
        return k

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
        """A copy with ``changes`` applied, validated again: ``stage``, flat names, or groups (a record replaces the
        group; a mapping updates only the fields it names)."""
        sources.check_known_keys(changes, "ZeroConfig.replace", _KEYS)
        stage = changes.pop("stage", self.stage)
        records = _group_records(self, {key: changes.pop(key, None) for key in GROUPS}, changes)
        return type(self)(stage=stage, **records)

    def to_dict(self, grouped: bool = False) -> dict[str, Any]:
        """JSON/YAML-safe dict: dtypes as "bf16"-style names, classes and unit_policy as qualified names.  The
        canonical form is flat (every field by its flat name, as saved configs and checkpoints hold it);
        ``grouped=True`` nests the fields under their groups.  ``from_dict`` reads either back."""
        out: dict[str, Any] = {"stage": self.stage}
        for key, cls in GROUPS.items():
            record = getattr(self, key)
            fields = {f: kind_of(f).plain(getattr(record, f.name)) for f in dataclasses.fields(cls)}
            if grouped:
                out[key] = {f.name: value for f, value in fields.items()}
            else:
                out.update((flat_name(f), value) for f, value in fields.items())
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZeroConfig:
        """Build from a mapping of flat names and/or groups (each a mapping of its fields); string values (YAML,
        env) are parsed per field, e.g. "3", "true", "bf16"."""
        if not isinstance(data, Mapping):
            raise ValueError(f"ZeroConfig.from_dict expects a mapping of field names; got {type(data).__name__}")
        sources.check_known_keys(data, "ZeroConfig.from_dict", _KEYS)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in GROUPS:
                kwargs[key] = _group_from_text(key, value) if isinstance(value, Mapping) else value
            elif isinstance(value, str):
                kwargs[key] = _STAGE.from_text(key, value) if key == "stage" else _from_text(FLAT_NAMES[key], value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ZeroConfig:
        """Load a .yaml/.yml/.json file holding the fields (flat or grouped) at top level or under
        ``zero_plugin:``."""
        data = sources.read_config_file(Path(path))
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from exc

    @classmethod
    def from_deepspeed(
        cls,
        path_or_dict: str | os.PathLike | Mapping[str, Any],
        *,
        world_size: int | None = None,
        **resolved_autos: Any,
    ) -> ZeroConfig:
        """A DeepSpeed configuration (``ds_config.json`` or its dict) read through the one table of DeepSpeed keys
        (``config_deepspeed.py``, listed in docs/deepspeed.md): mapped keys set fields, ignored ones are named in
        the report, refused ones raise ``ValueError`` naming the key and the fix, unknown ones warn once.
        ``resolved_autos``: values for ``"auto"`` entries, by top-level DeepSpeed key, nested as in the file
        (``gradient_clipping=1.0, bf16={"enabled": False}``); ``world_size`` checks ``train_batch_size``."""
        from .config_deepspeed import translate

        translation = translate(path_or_dict, resolved=resolved_autos, world_size=world_size)
        try:
            return cls.from_dict(translation.settings)
        except ValueError as exc:
            keys = ", ".join(f"{key} -> {field}" for field, key in translation.origins.items() if field in str(exc))
            raise ValueError(f"DeepSpeed config {translation.source}: {exc} (set by {keys})") from exc

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeroConfig:
        """ZERO_PLUGIN_CONFIG (a file) first, then ZERO_PLUGIN_<FLAT_NAME> / ZERO_PLUGIN_OFFLOAD override it
        (however the file writes that setting)."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        config_path = env.get(sources.ENV_CONFIG, "")
        if config_path:
            try:
                data.update(sources.read_config_file(Path(config_path)))
            except (ValueError, FileNotFoundError) as exc:
                raise type(exc)(f"{sources.ENV_CONFIG}={config_path!r}: {exc}") from exc
        overrides = sources.env_overrides(env, ("stage", *FLAT_NAMES))
        for var, name in overrides.items():
            data = _without(data, name)
            data[name] = env[var]
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            used = ([sources.ENV_CONFIG] if config_path else []) + list(overrides)
            origin = ", ".join(f"{var}={env[var]!r}" for var in used)
            raise ValueError(f"{exc} (from environment: {origin})") from exc

    def fingerprint(self) -> str:
        """sha256 hex digest of the sorted (flat) to_dict() JSON; equal on ranks whose configs agree, however
        they were written."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


assert tuple(f.name for f in dataclasses.fields(ZeroConfig)) == ("stage", *GROUPS), (
    "a group in GROUPS, not in ZeroConfig"
)
_KEYS = ("stage", *GROUPS, *FLAT_NAMES)
"""What ZeroConfig(), replace and from_dict accept at top level."""


def _flat_property(key: str, name: str) -> property:
    def read(self: ZeroConfig) -> Any:
        return getattr(getattr(self, key), name)

    return property(read, doc=f"``{key}.{name}``, by its flat name.")


for _name, (_key, _field) in FLAT_NAMES.items():
    assert not hasattr(ZeroConfig, _name), f"flat name {_name!r} hides a ZeroConfig attribute"
    setattr(ZeroConfig, _name, _flat_property(_key, _field.name))


def _group_records(base: ZeroConfig | None, given: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Each group's record from its ``given`` form (record, mapping or None) and the flat names of its fields,
    which are taken out of ``flat``; a group given neither way keeps ``base``'s record (None: the defaults)."""
    records = {}
    for key, cls in GROUPS.items():
        mine = {field.name: flat.pop(name) for name, (k, field) in FLAT_NAMES.items() if k == key and name in flat}
        records[key] = _group_record(key, cls, None if base is None else getattr(base, key), given.get(key), mine)
    return records


def _group_record(key: str, cls: type, base: Any, given: Any, flat: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if isinstance(given, cls):
        in_record = {name: getattr(given, name) for name in fields}
        _check_agree(key, fields, in_record, flat, f"{key}={cls.__name__}(...), which holds every field, defaults too")
        return given
    if given is None:
        given = {}
    elif isinstance(given, Mapping):
        sources.check_known_keys(given, f"ZeroConfig.{key}", tuple(fields))
        _check_agree(key, fields, given, flat, f"{key}={dict(given)!r}")
    else:
        raise ValueError(
            f"ZeroConfig.{key} must be {cls.__name__}(...), a mapping of its fields ({', '.join(fields)}) or None; "
            f"got {given!r}"
        )
    if base is not None and not given and not flat:
        return base
    start = {} if base is None else {name: getattr(base, name) for name in fields}
    return cls(**{**start, **flat, **given})


def _check_agree(
    key: str, fields: dict[str, dataclasses.Field], in_group: Mapping[str, Any], flat: dict[str, Any], given: str
) -> None:
    """A setting given in its group and by its flat name must be the same value, compared once normalised."""
    for name in (name for name in flat if name in in_group):
        field = fields[name]
        grouped = kind_of(field).check(label(key, field), in_group[name])
        if grouped != kind_of(field).check(label(key, field), flat[name]):
            raise ValueError(
                f"ZeroConfig: {key}.{name}={grouped!r} (from {given}) and {flat_name(field)}={flat[name]!r} "
                f"disagree; give the setting once, in the {key} group or by its flat name {flat_name(field)!r}"
            )


def _from_text(entry: tuple[str, dataclasses.Field], text: str) -> Any:
    key, field = entry
    return kind_of(field).from_text(label(key, field), text)


def _group_from_text(key: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A group's mapping with its string values parsed; unknown names are left for ``_group_record`` to refuse."""
    fields = {f.name: f for f in dataclasses.fields(GROUPS[key])}
    return {
        name: _from_text((key, fields[name]), value) if name in fields and isinstance(value, str) else value
        for name, value in data.items()
    }


def _without(data: dict[str, Any], name: str) -> dict[str, Any]:
    """``data`` without the setting ``name``, however written (flat, or nested in its group)."""
    out = {k: v for k, v in data.items() if k != name}
    if name in FLAT_NAMES:
        key, field = FLAT_NAMES[name]
        if isinstance(out.get(key), Mapping):
            out[key] = {k: v for k, v in out[key].items() if k != field.name}
    return out


def _local_world_size(environ: Mapping[str, str] | None) -> tuple[int | None, str]:
    """``LOCAL_WORLD_SIZE`` (default ``os.environ``) as an int >= 1 (None when unset or not one) and its text: the
    one place it is read (:meth:`ZeroConfig.resolved_shard_group_size`, :meth:`ZeroConfig.local_processes`)."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    return (int(text) if text.strip().isdigit() and int(text) >= 1 else None), text
