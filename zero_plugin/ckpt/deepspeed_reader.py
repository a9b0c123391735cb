"""DeepSpeed ZeRO checkpoints (stages 1-3, data parallel), read without DeepSpeed and without running pickled code.

    zp.load_checkpoint("ds_ckpt", model, optimizer)        # the folder with `latest`, or its global_stepN/
    zero-plugin consolidate ds_ckpt out/ --format safetensors

:func:`find_tag_dir` says whether a path is such a checkpoint (``load.py`` and ``consolidate.py`` dispatch on
it); :func:`open_checkpoint` reads it into a :class:`DeepSpeedSource`, which describes it as a zero_plugin
index and serves its pieces through the interface of ``load.Reader``, so loading and export then run
the same match / plan / read-in code as for our own checkpoints.

[Note: DeepSpeed checkpoint layout]
``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag, e.g. ``global_step2``) and ``dir/<tag>/``:

* stages 1-2: ``mp_rank_00_model_states.pt`` (the full module state dict in the compute dtype, buffer
  names, ``param_shapes``: per param group the trainable parameters in order, ``shared_params``: tied
  names) and per rank ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: its contiguous partition of each
  group's flat fp32 master (``single_partition_of_fp32_groups``; the group is the parameters
  concatenated, each followed by its ``param_alignment_paddings`` entry, padded at the end to divide by
  the ranks) and the torch optimizer's state dict over those partitions (``base_optimizer_state``:
  state ``g`` is group ``g``'s ``exp_avg`` / ``exp_avg_sq`` partition and ``step``).
* stage 3: per rank ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (``param_shapes`` per sub-group,
  frozen parameters' partitions) and ``..._optim_states.pt``: ``fp32_flat_groups``, per sub-group this
  rank's part of every parameter -- each parameter is cut into ``ceil(numel / N)`` elements per rank
  (the last rank's part padded) -- and the torch optimizer state over them (state ``i`` is sub-group ``i``).

Frozen parameters are in ``frozen_param_fragments`` (stage 2: whole; stage 3: each rank's part) or, where
DeepSpeed records none (stage 1), only in the module state dict.  This is what DeepSpeed's own
``zero_to_fp32.py`` reads; its output is what ``zero-plugin consolidate`` reproduces bit for bit.

[Note: reading DeepSpeed pickles]
DeepSpeed's ``*_states.pt`` are pickles, and a pickle can run any code when loaded.  They are read only with
``torch.load(weights_only=True)`` (tensors, containers, torch.Size and the like), plus a fixed allowlist of
stand-ins for the few DeepSpeed records these files hold (``_STAND_INS``: the loss scaler, the ZeRO stage
enum, a fragment address), which only take attributes -- nothing of DeepSpeed is imported or called.  Any
other global in any file is refused with an error naming the file before anything is built from it.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ..optim.loss_scale import scaler_state_problem
from .format import CheckpointError, dtype_name
from .tree import encode

__all__ = ["DeepSpeedSource", "find_tag_dir", "open_checkpoint", "client_state_keys", "safe_load"]

_LATEST = "latest"
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")
_MODEL_12 = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_MODEL_3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_EXPERT = re.compile(r"^((layer_\d+_)?expert_\d+_mp_rank_\d+_model_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")
_NVME = "offloaded_tensors"
_LATEST_UNIVERSAL, _UNIVERSAL_PARAMS = "latest_universal", "zero"  # what ds_to_universal.py writes
_EXPORT_WEIGHTS = (
    "export the weights with DeepSpeed's own zero_to_fp32.py, load them into the model before zp.setup and "
    "start the optimizer fresh"
)
_REPARTITION = (
    "convert it with DeepSpeed's ds_to_universal.py, load the result under DeepSpeed with data parallelism only "
    '("checkpoint": {"load_universal": true}) and save it again: that checkpoint zero_plugin reads'
)
# Keys of DeepSpeed's model-states file; anything else in it is the client_state passed to save_checkpoint.
_DS_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params frozen_param_fragments "
    "lr_scheduler data_sampler random_ltd sparse_tensor_module_names skipped_steps global_steps global_samples "
    "dp_world_size mp_world_size ds_config ds_version checkpoint_parallel_dimensions universal_checkpoint_info "
    "ds_autotp_universal_checkpoint_meta ds_autoep_layers autoep_layers ds_autoep_uc_meta folding".split()
)


# -- [Note: reading DeepSpeed pickles] ----------------------------------------------------------------------
class _Record:
    """Stands in for a DeepSpeed class whose pickled instances are attribute records: the unpickler makes one
    with ``__new__`` and fills its ``__dict__``; no code of the class runs (there is none)."""


class _LossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


class _ZeroStage(int):
    """Stands in for ``ZeroStageEnum``, an int enum pickled as a call with its value."""


_STAND_INS = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def safe_load(path: str) -> Any:
    """One DeepSpeed file, unpickled as weights only ([Note: reading DeepSpeed pickles]); memory-mapped when it
    is a zip archive (what torch.save writes), so tensors are read only where sliced."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        # torch's reason without its advice to allowlist the global, which is not ours to follow here
        reason = str(exc).split("WeightsUnpickler error: ", 1)[-1].split("\n", 1)[0].split(" was not an allowed")[0]
        raise CheckpointError(
            f"refusing to read {path}: it is a pickle that needs something a DeepSpeed checkpoint does not hold "
            f"({reason}); only tensors, containers and DeepSpeed's loss-scaler and stage records are unpickled, "
            "so nothing in it was run. If DeepSpeed really wrote it, please report the type in an issue"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for damaged files
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {type(exc).__name__}: {exc}") from exc


# -- which files ---------------------------------------------------------------------------------------------
def find_tag_dir(path: str) -> str | None:
    """The folder holding a DeepSpeed checkpoint's ``*_states.pt`` when ``path`` is one (the folder with
    ``latest``, e.g. an HF Trainer ``checkpoint-N/``, or the tag folder itself), else None.  Reads no pickle."""
    if not os.path.isdir(path):
        return None
    latest = os.path.join(path, _LATEST)
    if not os.path.isfile(latest) and os.path.isfile(os.path.join(path, _LATEST_UNIVERSAL)):
        raise _universal(path)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
        tag_dir = os.path.join(path, tag)
        if not (_TAG.match(tag) and tag not in (".", "..") and os.path.isdir(tag_dir)):
            raise CheckpointError(
                f"DeepSpeed checkpoint {path}: {latest} names {tag[:80]!r}, which is not a folder inside {path}; "
                "pass the tag folder (e.g. global_step100/) itself"
            )
        return tag_dir
    if any(n.endswith(("_model_states.pt", "_optim_states.pt")) for n in os.listdir(path)):
        return path
    return None


@dataclass(frozen=True, slots=True)
class _Files:
    model: list[str]  # stages 1-2: the one model-states file; stage 3: one per rank
    optim: list[str]  # one per rank, in rank order


def _universal(path: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is a DeepSpeed universal checkpoint (ds_to_universal.py's layout: {_LATEST_UNIVERSAL}, "
        f"{_UNIVERSAL_PARAMS}/<parameter>/fp32.pt, exp_avg.pt ...), which zero_plugin does not read. Pass the ZeRO "
        "checkpoint it was converted from (the global_stepN/ folder with zero_pp_rank_*_optim_states.pt files, or "
        "the folder whose 'latest' names it): zero_plugin reshards that to any stage and world size itself. Without "
        'it, load the universal checkpoint under DeepSpeed ("checkpoint": {"load_universal": true}) with data '
        "parallelism only and save it again"
    )


def _layout(tag_dir: str) -> _Files:
    """The checkpoint's files by role; layouts this reader does not handle are refused by name, before any read."""
    names = sorted(os.listdir(tag_dir))
    if os.path.isdir(os.path.join(tag_dir, _UNIVERSAL_PARAMS)) and not any(_OPTIM.match(n) for n in names):
        raise _universal(tag_dir)
    _refuse_unsupported(tag_dir, names)
    model12 = [n for n in names if _MODEL_12.match(n)]
    model3 = _by_rank(tag_dir, [n for n in names if _MODEL_3.match(n)], _MODEL_3, 1)
    optim = _by_rank(tag_dir, [n for n in names if _OPTIM.match(n)], _OPTIM, 2)
    if not optim or not (model12 or model3):
        raise CheckpointError(
            f"{tag_dir} is not a DeepSpeed ZeRO checkpoint: it needs *_model_states.pt and "
            "zero_pp_rank_<r>_mp_rank_00_optim_states.pt files (a checkpoint saved without ZeRO has no "
            f"partitioned optimizer state; {_EXPORT_WEIGHTS})"
        )
    if model3 and len(model3) != len(optim):
        raise CheckpointError(f"{tag_dir}: {len(model3)} model-states files for {len(optim)} optimizer files")
    return _Files([os.path.join(tag_dir, n) for n in (model3 or model12)], [os.path.join(tag_dir, n) for n in optim])


def _refuse_unsupported(tag_dir: str, names: list[str]) -> None:
    def refuse(name: str, layout: str, fix: str = _EXPORT_WEIGHTS) -> CheckpointError:
        return CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} holds {name}: it was written with {layout}, and zero_plugin reads "
            f"data-parallel ZeRO checkpoints only (stages 1-3, one model-parallel rank). To continue here, {fix}"
        )

    for name in names:
        if name == _NVME and os.path.isdir(os.path.join(tag_dir, name)):
            raise refuse(
                name,
                "NVMe optimizer offload (the fp32 weights and Adam state are in DeepSpeed's swap files)",
                "resume it once under DeepSpeed with offload_optimizer device 'cpu' or 'none' and save again (then "
                "zero_plugin reads it), or load it under DeepSpeed and export the weights with zero_to_fp32",
            )
        if _PIPELINE.match(name):
            raise refuse(name, "pipeline parallelism", _REPARTITION)
        if _EXPERT.match(name):
            raise refuse(
                name,
                "MoE expert files",
                "export the full weights under DeepSpeed (engine.save_16bit_model), load them into the model "
                "before zp.setup and start the optimizer fresh",
            )
        match = _MODEL_12.match(name) or _MODEL_3.match(name) or _OPTIM.match(name)
        if match and int(match.groups()[-1]) != 0:
            raise refuse(name, "tensor parallelism (model-parallel rank > 0)", _REPARTITION)


def _by_rank(tag_dir: str, names: list[str], pattern: re.Pattern, group: int) -> list[str]:
    by_rank = {int(pattern.match(n).group(group)): n for n in names}
    if len(by_rank) != len(names):
        raise CheckpointError(f"{tag_dir} holds two files for one rank: {names}")
    for rank in range(len(names)):
        if rank not in by_rank:
            raise CheckpointError(f"{tag_dir}: rank {rank}'s file is missing (found {names})")
    return [by_rank[r] for r in range(len(names))]


# -- the source: an index and its pieces ---------------------------------------------------------------------
@dataclass
class DeepSpeedSource:
    """A DeepSpeed checkpoint as a zero_plugin index (``index``: params with their shards, buffers, optimizer
    state, ``extra``, ``aliases`` for tied names) whose pieces are views into the memory-mapped files.  "File"
    ``i`` is DeepSpeed's rank ``i``; it answers as ``load.Reader`` does (``handle``, ``slice``, ``tensor``)."""

    directory: str
    files: list[str]
    index: dict = field(default_factory=dict)
    export: dict = field(default_factory=dict)
    pieces: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def add(self, i: int, key: str, tensor: torch.Tensor) -> None:
        self.pieces[(i, key)] = tensor

    def handle(self, i: int, key: str | None = None) -> _File:
        if key is not None and (i, key) not in self.pieces:
            raise CheckpointError(f"{self.where(i, key)} is missing")
        return _File(self, i)

    def where(self, i: int, key: str) -> str:
        return f"tensor {key!r} of {self.files[i] if i < len(self.files) else self.directory}"

    def slice(self, i: int, key: str, length: int, dtype: torch.dtype) -> torch.Tensor:
        piece = self.pieces.get((i, key))
        if piece is None or piece.shape != (length,) or piece.dtype != dtype:
            got = "nothing" if piece is None else f"{tuple(piece.shape)} {piece.dtype}"
            raise CheckpointError(f"{self.where(i, key)}: expected [{length}] {dtype}, found {got}")
        return piece

    def tensor(self, i: int, key: str) -> torch.Tensor:
        self.handle(i, key)
        return self.pieces[(i, key)].clone()  # a step count must not be one tensor shared by every parameter

    def metadata(self, i: int) -> dict[str, str]:
        return {}  # DeepSpeed saves no RNG state in these files

    def encode(self, value: Any, where: str) -> Any:
        """``value`` as the index stores it; its tensors become pieces of file 0 under ``s/<n>``."""
        tensors: dict[str, torch.Tensor] = {}
        encoded = encode(value, tensors, f"s{len(self.pieces)}", where)
        for key, tensor in tensors.items():
            self.add(0, key, tensor)
        return encoded


@dataclass(frozen=True, slots=True)
class _File:
    source: DeepSpeedSource
    i: int

    def get_slice(self, key: str) -> torch.Tensor:
        return self.source.pieces[(self.i, key)]

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.source.tensor(self.i, key)


def open_checkpoint(tag_dir: str) -> DeepSpeedSource:
    """Read and check the DeepSpeed checkpoint in ``tag_dir`` ([Note: DeepSpeed checkpoint layout])."""
    files = _layout(tag_dir)
    models = [safe_load(f) for f in files.model]
    optims = [_optimizer_record(safe_load(f), f) for f in files.optim]
    source = DeepSpeedSource(tag_dir, files.optim)
    try:
        _describe(source, models, optims, tag_dir)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"{tag_dir}: not a DeepSpeed ZeRO checkpoint this reader understands ({type(exc).__name__}: {exc}); "
            f"{_EXPORT_WEIGHTS}"
        ) from exc
    source.export = _hf_export(os.path.dirname(tag_dir))
    return source


def client_state_keys(tag_dir: str) -> list[str]:
    """The keys of the ``client_state`` the checkpoint was saved with (Lightning's ``loops``, ``lr_schedulers``
    ...), from the first model-states file alone (memory-mapped)."""
    model = safe_load(_layout(tag_dir).model[0])
    return sorted(str(k) for k in model if k not in _DS_KEYS) if isinstance(model, dict) else []


def _optimizer_record(loaded: Any, path: str) -> dict:
    record = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
    if not isinstance(record, dict) or "zero_stage" not in record:
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict.zero_stage)")
    return record


def _describe(source: DeepSpeedSource, models: list[dict], optims: list[dict], tag_dir: str) -> None:
    stage, world = int(optims[0]["zero_stage"]), len(optims)
    counts = optims[0]["partition_count"]
    expected = max(counts if isinstance(counts, list) else [counts])
    if expected != world or not 1 <= stage <= 3:
        first = os.path.basename(source.files[0])
        missing = [first.replace("_rank_0_", f"_rank_{r}_", 1) for r in range(world, expected)]
        raise CheckpointError(
            f"{tag_dir}: the optimizer files say ZeRO stage {stage} over {expected} ranks, {world} were found"
            + (f"; missing {', '.join(missing)} (an interrupted or partial save?)" if missing else "")
        )
    model = models[0]
    source.index = {"world_size": world, "files": source.files, "params": {}, "buffers": {}}
    bases = [o["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"] for o in optims]
    if not all(isinstance(b, dict) for b in bases):
        raise CheckpointError(
            f"{tag_dir}: elastic (per-group list) optimizer state is not supported; {_EXPORT_WEIGHTS}"
        )
    flats = [o["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for o in optims]
    states = [b["state"] for b in bases]
    walk = _walk_zero12 if stage <= 2 else _walk_zero3
    state_keys = walk(source, model["param_shapes"], flats, states, optims[0].get("param_alignment_paddings"))
    _frozen(source, models, stage, world)
    _buffers_and_aliases(source, model)
    source.index["optimizer"] = _optimizer_index(source, model["param_shapes"], bases[0], state_keys)
    source.index["optimizer"]["grad_guard"] = _grad_guard(optims[0], model, source.files[0])
    source.index["extra"] = _extra(source, model)


# -- trainable parameters: where each one's pieces are ---------------------------------------------------------
def _shape(value: Any) -> tuple[int, ...]:
    shape = tuple(int(d) for d in value)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in {shape}")
    return shape


def _walk_zero12(source, param_shapes, flats, states, paddings) -> dict:
    """Stages 1-2: rank r holds ``[r * P, (r + 1) * P)`` of each group's flat master; a parameter may span ranks.
    The group's end padding is not saved (the last rank's partition is shorter); its Adam state keeps it."""
    world, keys = len(flats), {}
    for g, shapes in enumerate(param_shapes):
        size = max(flat[g].numel() for flat in flats)
        offset = 0
        for j, (name, shape) in enumerate(shapes.items()):
            shape = _shape(shape)
            numel, shards = math.prod(shape), []
            for r in range(world):
                lo, hi = max(offset, r * size), min(offset + numel, (r + 1) * size)
                if lo < hi:
                    shards.append([r, lo - offset, hi - offset])
                    keys[name] = _add_piece(source, r, name, flats[r][g], states[r].get(g, {}), lo - r * size, hi - lo)
            source.index["params"][name] = _param_entry(shape, flats[0][g].dtype, shards)
            offset += numel + (paddings[g][j] if paddings else 0)
        saved = (world - 1) * size + flats[-1][g].numel()
        if offset > saved:
            raise CheckpointError(f"{source.directory}: group {g}'s parameters need {offset} elements, found {saved}")
    return keys


def _walk_zero3(source, param_shapes, flats, states, _paddings) -> dict:
    """Stage 3: every parameter is cut into ``ceil(numel / N)`` elements per rank, in each rank's sub-group."""
    world, keys = len(flats), {}
    for s, shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in shapes.items():
            shape = _shape(shape)
            numel = math.prod(shape)
            part, shards = math.ceil(numel / world), []
            for r in range(world):
                lo, hi = r * part, min((r + 1) * part, numel)
                if lo < hi:
                    shards.append([r, lo, hi])
                    keys[name] = _add_piece(source, r, name, flats[r][s], states[r].get(s, {}), offset, hi - lo)
            source.index["params"][name] = _param_entry(shape, flats[0][s].dtype, shards)
            offset += part
        if offset != flats[0][s].numel():
            raise CheckpointError(
                f"{source.directory}: sub-group {s}'s parameters need {offset} elements per rank, found {flats[0][s].numel()}"
            )
    return keys


def _add_piece(source, r: int, name: str, flat: torch.Tensor, state: dict, start: int, length: int) -> dict:
    """Add rank ``r``'s piece of parameter ``name`` (and of its optimizer state tensors); returns how the
    optimizer state of ``name`` is recorded: tensors of the flat's size as regions, the rest (step) as values."""
    if flat.dim() != 1 or start + length > flat.numel():
        raise CheckpointError(f"{source.where(r, 'p/' + name)}: the flat master is too short")
    source.add(r, f"p/{name}", flat[start : start + length])
    record = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= flat.numel():
            source.add(r, f"o/{name}/{key}", value[start : start + length])
            record[key] = {"region": dtype_name(value.dtype)}
        else:
            record[key] = {"value": source.encode(value, f"optimizer state {key!r}")}
    return record


def _param_entry(shape: tuple, dtype: torch.dtype, shards: list) -> dict:
    return {"shape": list(shape), "dtype": dtype_name(dtype), "shards": shards}


# -- frozen parameters, buffers, tied names --------------------------------------------------------------------
def _frozen(source: DeepSpeedSource, models: list[dict], stage: int, world: int) -> None:
    model = models[0]
    shapes = model.get("frozen_param_shapes") or {}
    if stage == 3:
        for name, shape in shapes.items():
            shape = _shape(shape)
            numel = math.prod(shape)
            first = models[0]["frozen_param_fragments"][name]
            part, shards = first.numel(), []  # rank r's fragment is [r * part, (r + 1) * part), as zero_to_fp32 reads
            if part * world < numel:
                raise CheckpointError(f"{source.directory}: frozen {name!r} has {part} x {world} of {numel} elements")
            for r in range(world):
                lo, hi = r * part, min((r + 1) * part, numel)
                if lo < hi:
                    source.add(r, f"p/{name}", models[r]["frozen_param_fragments"][name].reshape(-1)[: hi - lo])
                    shards.append([r, lo, hi])
            source.index["params"][name] = _param_entry(shape, first.dtype, shards)
        return
    # stages 1-2: whole values, recorded as fragments (stage 2) or only in the module state dict (stage 1)
    fragments = model.get("frozen_param_fragments") or {}
    known = set(source.index["params"]) | set(model["buffer_names"]) | set(model["shared_params"])
    for name, value in model["module"].items():
        if name not in known and isinstance(value, torch.Tensor):
            value = fragments.get(name, value)
            source.add(0, f"p/{name}", value.reshape(-1))
            source.index["params"][name] = _param_entry(tuple(value.shape), value.dtype, [[0, 0, value.numel()]])


def _buffers_and_aliases(source: DeepSpeedSource, model: dict) -> None:
    """Buffers keep the dtype they were saved in (zero_to_fp32 casts floating buffers to fp32).  Tied names
    (``shared_params``: alias -> name) are exported, not loaded: the model's parameters are deduplicated."""
    module = model["module"]
    for name in model["buffer_names"]:
        if name in module:  # non-persistent buffers are named but not saved
            source.add(0, f"b/{name}", module[name])
            source.index["buffers"][name] = {"shape": list(module[name].shape), "dtype": dtype_name(module[name].dtype)}
    aliases = {str(a): str(t) for a, t in model["shared_params"].items()}
    source.index["aliases"] = {a: t for a, t in aliases.items() if t in source.index["params"]}


# -- optimizer and extra -----------------------------------------------------------------------------------------
def _optimizer_index(source: DeepSpeedSource, param_shapes: list, base: dict, state_keys: dict) -> dict:
    """Group ``g`` of the torch optimizer DeepSpeed wrapped holds the flat masters (stage 3: sub-groups) listed
    in its ``params``; its parameters are theirs in order.  No class is recorded: see :func:`fit_optimizer`."""
    groups = []
    for g, group in enumerate(base["param_groups"]):
        names = [name for i in group["params"] for name in param_shapes[i]]
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"param_names": names, "hyper": source.encode(hyper, f"optimizer param group {g}")})
    return {"class": None, "param_groups": groups, "state": state_keys}


def _grad_guard(optim: dict, model: dict, path: str) -> dict:
    """[Note: DeepSpeed's loss scaler]
    The optimizer files hold DeepSpeed's loss scaler (``loss_scaler``: ``cur_scale``; dynamic: ``cur_iter``,
    ``last_overflow_iter``, ``scale_window``), the model file ``skipped_steps``; they become the record of
    [Note: scaler state] (``optim/loss_scale.py``), so a resumed fp16 run keeps DeepSpeed's scale.  DeepSpeed grows
    the scale at the update where ``cur_iter - last_overflow_iter - 1`` is a positive multiple of the window, we
    after every ``loss_scale_growth_interval``-th clean step: ``clean_steps = cur_iter - last_overflow_iter - 2``
    puts our next growth on DeepSpeed's when the two intervals are equal (set ``loss_scale_growth_interval`` to
    DeepSpeed's ``loss_scale_window``).  Saved right after an overflow (or before any step) DeepSpeed waits one
    step longer than the window, which the count cannot say: there we grow one step earlier.  DeepSpeed's
    hysteresis (overflows tolerated before backing off) has no counterpart here."""
    attrs = vars(optim["loss_scaler"]) if isinstance(optim.get("loss_scaler"), _Record) else {}
    dynamic = bool(attrs.get("dynamic", False))
    clean = int(attrs.get("cur_iter", 0)) - int(attrs.get("last_overflow_iter", -1)) - 2 if dynamic else 0
    record = {
        "dynamic": dynamic,
        "scale": float(attrs.get("cur_scale", 1.0)),
        "clean_steps": max(clean, 0),
        "skipped_steps": int(model.get("skipped_steps") or 0),
    }
    if (problem := scaler_state_problem(record)) is not None:
        raise CheckpointError(f"{path}: DeepSpeed's loss scaler record is damaged: {problem}")
    return record


def _extra(source: DeepSpeedSource, model: dict) -> dict:
    """What ``zp.load_checkpoint`` returns: DeepSpeed's counters, its LR scheduler state and the client_state
    given to ``save_checkpoint`` (values that are not JSON, tuples or tensors are listed under ``unreadable``)."""
    record: dict[str, Any] = {k: model.get(k) for k in ("global_steps", "global_samples", "skipped_steps")}
    record["lr_scheduler"], record["client_state"], unreadable = model.get("lr_scheduler"), {}, []
    for key in model:
        if key not in _DS_KEYS:
            record["client_state"][key] = model[key]
    encoded = {}
    for key, value in record.items():
        try:
            encoded[key] = source.encode(value, f"DeepSpeed {key}")
        except CheckpointError:
            unreadable.append(key)
    encoded["unreadable"] = unreadable
    return {"deepspeed": encoded}


def _hf_export(folder: str) -> dict:
    """An HF Trainer checkpoint folder (``checkpoint-N/``) has the model's ``config.json`` beside ``latest``."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return {"hf_config": config} if isinstance(config, dict) else {}


def stored_views(source: DeepSpeedSource, views: list) -> list:
    """The parameters to load: all but frozen ones the checkpoint does not hold.  DeepSpeed's
    ``exclude_frozen_parameters=True`` (the HF Trainer saves PEFT models so) leaves the frozen base out: it
    stays as the model has it, as in DeepSpeed's own non-strict load; a trainable one missing is still refused."""
    return [v for v in views if v.name in source.index["params"] or v.slot is not None]


def fit_optimizer(source: DeepSpeedSource, inner: torch.optim.Optimizer) -> None:
    """DeepSpeed records no optimizer class: refuse Adam state for an optimizer without ``betas``, and keep each
    live group's own hyper-parameters where DeepSpeed's optimizer had none (FusedAdam's groups lack torch's
    ``foreach`` / ``fused`` ..., and carry ``bias_correction``, which torch's AdamW does not take)."""
    saved = source.index["optimizer"]["param_groups"]
    for g, (entry, group) in enumerate(zip(saved, inner.param_groups)):
        hyper = entry["hyper"]
        if "betas" in hyper and "betas" not in group:
            raise CheckpointError(
                f"zp.load_checkpoint: DeepSpeed checkpoint {source.directory} holds Adam state (exp_avg, "
                f"exp_avg_sq); this optimizer is a {type(inner).__name__}. Load it into torch.optim.AdamW (or "
                "Adam), or load the model alone (optimizer=None) and start this optimizer fresh"
            )
        live = {k: v for k, v in group.items() if k != "params" and k not in hyper}
        kept = {k: v for k, v in hyper.items() if k in group}
        entry["hyper"] = {**kept, **source.encode(live, f"optimizer param group {g}")}
