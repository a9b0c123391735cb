"""A DeepSpeed configuration (``ds_config.json``, or its dict) read as zero_plugin settings: **the one table**.

Every DeepSpeed key zero_plugin knows is one :class:`Row` of :data:`TABLE`, which says what happens to it:

* ``mapped``: it becomes a ``ZeroConfig`` field (``zero_optimization.stage`` -> ``stage``), the optimizer or
  schedule the HF Trainer would let DeepSpeed build (``optimizer``, ``scheduler``: :class:`OptimizerSpec`,
  :class:`ScheduleSpec`), or a batch size checked against the others (``train_batch_size``);
* ``ignored``: accepted, with the reason it changes nothing here (``overlap_comm``: always on);
* ``refused``: it would change the numerics and zero_plugin has no equivalent (``nvme`` offload, pipeline
  sections), or it names something unknown (a stage 4); a ``ValueError`` names the key, its value and the fix.
  Some rows refuse only certain values (``fp16.hysteresis`` other than 1 while fp16 is on).

A key that no row names warns once, naming it, and is otherwise ignored.  ``"auto"`` (the HF Trainer's
placeholder) must be resolved by the caller (``resolved`` in :func:`translate`, ``**resolved_autos`` in
``ZeroConfig.from_deepspeed``), as transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` does from
the ``TrainingArguments`` (``integrations/deepspeed_config.py`` does it for the Trainer); an ``"auto"`` left on
a key that only tunes performance takes zero_plugin's default, anywhere else it is refused.

The table is the documentation: ``docs/deepspeed.md`` lists the same rows (``tests/unit/test_config_deepspeed.py``
checks that the two agree).  This module knows nothing of ``ZeroConfig`` itself (it sits below it): it returns
flat field names and values, and ``ZeroConfig.from_deepspeed`` builds the config from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from .config_groups import FLAT_NAMES

__all__ = [
    "TABLE",
    "markdown_table",
    "DeepSpeedTranslation",
    "OptimizerSpec",
    "Row",
    "ScheduleSpec",
    "read_deepspeed",
    "translate",
]

AUTO = "auto"


class Refused(Exception):
    """Raised by a row's rule: the value cannot run here; the message says why and the fix."""


class Ignored(Exception):
    """Raised by a row's rule: this value changes nothing here; the message says why."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer a DeepSpeed ``optimizer`` section asks for, as torch builds it: ``torch.optim.<name>`` over
    every trainable parameter in one group (as DeepSpeed builds it for the Trainer) with ``params``."""

    name: str
    """``"AdamW"`` or ``"Adam"`` (DeepSpeed's ``Adam`` with ``adam_w_mode: false``)."""
    params: dict
    """torch keyword arguments: ``lr``, ``betas``, ``eps``, ``weight_decay`` (those given), ``amsgrad``."""

    def build(self, parameters) -> Any:
        import torch

        return getattr(torch.optim, self.name)(parameters, **self.params)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """A DeepSpeed ``scheduler`` section: ``WarmupLR``, ``WarmupDecayLR`` or ``WarmupCosineLR``, with its
    parameters (``total_num_steps`` / ``warmup_num_steps`` may still be ``"auto"``: the Trainer knows them only
    once it trains).  :meth:`build` makes a torch ``LambdaLR`` giving each step DeepSpeed's learning rate."""

    name: str
    params: dict

    def resolved(self, total_num_steps: int, warmup_steps: int, lr: float) -> ScheduleSpec:
        """``"auto"`` filled as transformers' ``trainer_config_finalize`` / ``trainer_config_process`` fill it."""
        fill = {"total_num_steps": total_num_steps, "warmup_num_steps": max(1, warmup_steps)}
        fill.update(warmup_min_lr=0, warmup_max_lr=lr)
        return ScheduleSpec(self.name, {k: fill.get(k, v) if v == AUTO else v for k, v in self.params.items()})

    def factor(self, step: int, base_lr: float) -> float:
        """The learning rate of optimizer step ``step`` (0-based) over ``base_lr``.  DeepSpeed's schedulers set the
        rate of iteration -1 at construction and step after every optimizer step, so step ``s`` runs at the rate
        of iteration ``s - 1`` (the first two steps at the warm-up's start)."""
        p, it = self.params, step - 1
        if self.name == "WarmupCosineLR":
            return _cosine_ratio(it, p)
        low = float(p.get("warmup_min_lr", 0.0))
        high = float(p["warmup_max_lr"]) if p.get("warmup_max_lr") is not None else base_lr
        gamma = 0.0 if it < 0 else _warmup_gamma(it, p)
        if it >= _warmup_steps(p) and self.name == "WarmupDecayLR":
            total = int(p["total_num_steps"])
            gamma = max(0.0, (total - it) / max(1.0, total - _warmup_steps(p)))
        return (low + (high - low) * gamma) / base_lr

    def build(self, optimizer) -> Any:
        import torch

        bases = [group["lr"] for group in optimizer.param_groups]
        rules = [lambda step, base=base: self.factor(step, base) for base in bases]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, rules)


def _warmup_steps(p: Mapping[str, Any]) -> int:
    return max(2, int(p.get("warmup_num_steps", 1000)))


def _warmup_gamma(it: int, p: Mapping[str, Any]) -> float:
    """DeepSpeed's warm-up fraction at iteration ``it``: log (its default) or linear, 1 after the warm-up."""
    steps = _warmup_steps(p)
    if it >= steps:
        return 1.0
    if p.get("warmup_type", "log") == "linear":
        return it / steps
    return math.log(it + 1) / math.log(steps)


def _cosine_ratio(it: int, p: Mapping[str, Any]) -> float:
    """``WarmupCosineLR``: a ratio of the optimizer's own rate (warm-up from ``warmup_min_ratio``, then cosine
    down to ``cos_min_ratio``)."""
    if it < 0:
        return 0.0
    steps, low = _warmup_steps(p), float(p.get("warmup_min_ratio", 0.0))
    if it < steps:
        return low + _warmup_gamma(it, p) * (1.0 - low)
    progress = min(1.0, (it - steps + 1) / max(1, int(p["total_num_steps"]) - steps))
    floor = float(p.get("cos_min_ratio", 0.0001))
    return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)


# -- the table ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    """One DeepSpeed key (dotted path; a ``section`` row takes the whole sub-tree as its value)."""

    key: str
    action: str
    """``mapped``, ``ignored``, ``refused``, or ``mapped/refused`` / ``ignored/refused`` (some values refused)."""
    doc: str
    """What it becomes or why it is ignored / refused, as ``docs/deepspeed.md`` shows it."""
    rule: Callable[[Any, Context], dict] | None = None
    """value, context -> ZeroConfig fields ({} for none); raises :class:`Refused`.  None: ignored."""
    section: bool = False
    auto_ok: bool = False
    """An unresolved ``"auto"`` is accepted: a performance knob takes zero_plugin's default, a batch size goes
    unchecked (the script's data loader sets it)."""


@dataclasses.dataclass
class Context:
    """What rules read besides their own value: the whole (resolved) configuration."""

    config: Mapping[str, Any]

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def fp16(self) -> bool:
        return _truthy(self.get("fp16.enabled", False))


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true") or value == 1


def _stage(value: Any, ctx: Context) -> dict:
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise Refused("DeepSpeed's ZeRO stages are 0, 1, 2 and 3 (zero_plugin's --stage); set one of them")
    return {"stage": int(value)}


def _offload_device(field: str) -> Callable[[Any, Context], dict]:
    def rule(value: Any, ctx: Context) -> dict:
        device = "none" if value is None else str(value).lower()
        if device == "nvme":
            raise Refused(
                "zero_plugin offloads to host memory only (no NVMe / ZeRO-Infinity); set device to 'cpu' "
                "(or 'none'), and check the states fit in host memory: `zero-plugin estimate`"
            )
        if device not in ("none", "cpu"):
            raise Refused("allowed devices are 'none' and 'cpu'")
        if field == "offload_params":
            return {"offload_params": device == "cpu"}
        return {"offload_optimizer": device}

    return rule


def _bucket_mb(value: Any, ctx: Context) -> dict:
    elements = _number(value)
    return {"bucket_size_mb": min(4096.0, max(elements * 4 / 2**20, 1e-3))}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise Refused("expected a number >= 0")
    return float(value)


def _persistence(value: Any, ctx: Context) -> dict:
    return {"persistence_threshold": int(_number(value))}


def _hpz(value: Any, ctx: Context) -> dict:
    k = int(_number(value))
    return {} if k <= 1 else {"secondary_shard_size": k}


def _mics(value: Any, ctx: Context) -> dict:
    k = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
    return {} if k <= 0 else {"shard_group_size": k}


def _flag(field: str) -> Callable[[Any, Context], dict]:
    def rule(value: Any, ctx: Context) -> dict:
        return {field: _truthy(value)}

    return rule


def _only_false(fix: str) -> Callable[[Any, Context], dict]:
    def rule(value: Any, ctx: Context) -> dict:
        if _truthy(value):
            raise Refused(fix)
        return {}

    return rule


def _section_disabled(fix: str) -> Callable[[Any, Context], dict]:
    """A section accepted only when it turns its feature off (``enabled: false``, or empty)."""

    def rule(value: Any, ctx: Context) -> dict:
        if isinstance(value, Mapping) and (not value or value.get("enabled") is False):
            return {}
        raise Refused(fix)

    return rule


def _clip(value: Any, ctx: Context) -> dict:
    norm = _number(value)
    return {"clip_grad_norm": norm if norm > 0 else None}


def _bf16(value: Any, ctx: Context) -> dict:
    if not _truthy(value):
        return {}
    if ctx.fp16:
        raise Refused("fp16.enabled and bf16.enabled are both true; DeepSpeed refuses that too: keep one")
    return {"param_dtype": "bf16"}


def _fp16(value: Any, ctx: Context) -> dict:
    return {"param_dtype": "fp16"} if _truthy(value) else {}


def _fp16_only(rule: Callable[[Any, Context], dict]) -> Callable[[Any, Context], dict]:
    """An ``fp16.*`` setting matters only while fp16 is on."""

    def guarded(value: Any, ctx: Context) -> dict:
        if not ctx.fp16:
            raise Ignored("fp16 is off")
        return rule(value, ctx)

    return guarded


def _loss_scale(value: Any, ctx: Context) -> dict:
    scale = _number(value)
    return {"loss_scale": "dynamic"} if scale == 0 else {"loss_scale": scale}


def _scale_power(value: Any, ctx: Context) -> dict:
    return {"loss_scale_init": float(2 ** _number(value))}


def _scale_window(value: Any, ctx: Context) -> dict:
    return {"loss_scale_growth_interval": max(1, int(_number(value)))}


def _hysteresis(value: Any, ctx: Context) -> dict:
    if _number(value) != 1:
        raise Refused(
            "zero_plugin's loss scaler halves the scale at every overflow (torch GradScaler's rule); DeepSpeed "
            "waits for this many overflows, which skips other steps; set hysteresis: 1"
        )
    return {}


def _min_scale(value: Any, ctx: Context) -> dict:
    if _number(value) > 1:
        raise Refused("zero_plugin's loss scaler has no floor; set min_loss_scale: 1 (or leave it out)")
    return {}


def _comm_dtype(value: Any, ctx: Context) -> dict:
    names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "float32": "fp32", "float16": "fp16"}
    if str(value).lower() not in names:
        raise Refused("allowed: fp32, fp16, bf16")
    return {"reduce_dtype": names[str(value).lower()]}


def _predivide(value: Any, ctx: Context) -> dict:
    if _number(value) != 1.0:
        raise Refused("zero_plugin averages gradients once, after the sum; set gradient_predivide_factor: 1.0")
    return {}


def _positive_int(value: Any, ctx: Context) -> dict:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused("expected an integer >= 1")
    return {}


def _lazy(value: Any, ctx: Context) -> dict:
    return {"lazy_loading": _truthy(value)}


_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _optimizer_type(value: Any, ctx: Context) -> dict:
    if str(value).lower() not in _OPTIMIZERS:
        raise Refused(
            f"zero_plugin builds torch's AdamW / Adam from a DeepSpeed optimizer section, not {value!r} (DeepSpeed's "
            "own kernel); remove the optimizer section and build the optimizer in the script (or "
            "TrainingArguments.optim)"
        )
    return {}


def _optimizer_params(value: Any, ctx: Context) -> dict:
    # "auto" entries are left out of the spec: the Trainer resolves them all before building the optimizer.
    _optimizer_spec(value, "adam")  # refuses what torch's Adam cannot take
    return {}


def _scheduler_type(value: Any, ctx: Context) -> dict:
    if value not in _SCHEDULES:
        raise Refused(
            f"zero_plugin gives DeepSpeed's {', '.join(_SCHEDULES)} their learning rates, not {value!r}; remove "
            "the scheduler section and use the script's (or TrainingArguments.lr_scheduler_type)"
        )
    return {}


_MAPPED, _IGNORED, _REFUSED = "mapped", "ignored", "refused"
_Z = "zero_optimization."
_ALWAYS_ON = "always on here: gradients are reduced into fixed buckets during backward, overlapped with it"


def _rows() -> tuple[Row, ...]:
    m, i, r = _MAPPED, _IGNORED, _REFUSED
    mr, ir = f"{m}/{r}", f"{i}/{r}"
    # fmt: off
    return (
        Row(_Z + "stage", mr, "`stage` (0-3); any other value refused", _stage),
        Row(_Z + "offload_optimizer.device", mr, "`offload_optimizer`: `none`, `cpu`; `nvme` refused (host memory only)", _offload_device("offload_optimizer")),
        Row(_Z + "offload_param.device", mr, "`offload_params` (`cpu` = true; stage 3 only); `nvme` refused", _offload_device("offload_params")),
        Row(_Z + "offload_optimizer.pin_memory", i, "host buffers are pinned whenever a GPU is used"),
        Row(_Z + "offload_param.pin_memory", i, "host buffers are pinned whenever a GPU is used"),
        Row(_Z + "offload_optimizer.buffer_count", i, "NVMe / pipelining knob; placement only"),
        Row(_Z + "offload_param.buffer_count", i, "NVMe knob; placement only"),
        Row(_Z + "offload_param.buffer_size", i, "NVMe knob; placement only"),
        Row(_Z + "offload_param.max_in_cpu", i, "NVMe knob; placement only"),
        Row(_Z + "offload_optimizer.fast_init", i, "NVMe knob; placement only"),
        Row(_Z + "offload_optimizer.ratio", i, "partial offload; placement only (all of the offloaded state moves here)"),
        Row(_Z + "offload_optimizer.nvme_path", i, "used by `nvme` offload only, which is refused"),
        Row(_Z + "offload_param.nvme_path", i, "used by `nvme` offload only, which is refused"),
        Row(_Z + "reduce_bucket_size", m, "`bucket_size_mb` (elements x 4 bytes, at most 4096 MiB); performance only", _bucket_mb, auto_ok=True),
        Row(_Z + "allgather_bucket_size", i, "stages 1-2 gather the updated parameters per gradient bucket (`bucket_size_mb`); performance only", auto_ok=True),
        Row(_Z + "stage3_prefetch_bucket_size", i, "stage 3 prefetches whole units (`prefetch_depth`, in units, not elements); performance only", auto_ok=True),
        Row(_Z + "stage3_param_persistence_threshold", m, "`persistence_threshold` (elements): small parameters gathered once per step with the root unit", _persistence, auto_ok=True),
        Row(_Z + "stage3_max_live_parameters", i, "a unit is released after use and at most `prefetch_depth` units are gathered ahead; memory only", auto_ok=True),
        Row(_Z + "stage3_max_reuse_distance", i, "a unit is released after use and at most `prefetch_depth` units are gathered ahead; memory only", auto_ok=True),
        Row(_Z + "stage3_gather_16bit_weights_on_model_save", i, "`save_model` / `save_pretrained` always write the gathered full weights here", auto_ok=True),
        Row(_Z + "stage3_gather_fp16_weights_on_model_save", i, "older name of `stage3_gather_16bit_weights_on_model_save`", auto_ok=True),
        Row(_Z + "zero_hpz_partition_size", m, "`secondary_shard_size` (ZeRO++ hpZ; 1 = off)", _hpz),
        Row(_Z + "zero_quantized_weights", m, "`quantized_weights` (ZeRO++ qwZ, stage 3)", _flag("quantized_weights")),
        Row(_Z + "zero_quantized_gradients", m, "`quantized_gradients` (ZeRO++ qgZ, stage 3)", _flag("quantized_gradients")),
        Row(_Z + "zero_quantized_nontrainable_weights", ir, "`false` ignored; `true` refused: no int8 storage of frozen weights here", _only_false("zero_plugin keeps frozen weights in their dtype; set it to false")),
        Row(_Z + "mics_shard_size", m, "`shard_group_size` (hierarchical sharding; <= 0 = off)", _mics),
        Row(_Z + "mics_hierarchical_params_gather", i, "gathers stay inside the shard group already"),
        Row(_Z + "overlap_comm", i, _ALWAYS_ON, auto_ok=True),
        Row(_Z + "contiguous_gradients", i, "always on here: gradients are reduced from contiguous buckets", auto_ok=True),
        Row(_Z + "reduce_scatter", i, "always on here (stages 2-3 reduce-scatter); the sum is the same", auto_ok=True),
        Row(_Z + "allgather_partitions", i, "always on here (one all-gather of the updated shards)", auto_ok=True),
        Row(_Z + "round_robin_gradients", i, "performance only", auto_ok=True),
        Row(_Z + "sub_group_size", i, "the optimizer steps each rank's shard at once; performance only", auto_ok=True),
        Row(_Z + "elastic_checkpoint", i, "checkpoints here load at any world size and stage"),
        Row(_Z + "load_from_fp32_weights", i, "checkpoints here always hold the fp32 master weights"),
        Row(_Z + "ignore_unused_parameters", i, "parameters without a gradient are handled at every stage"),
        Row(_Z + "memory_efficient_linear", i, "memory only"),
        Row(_Z + "stage3_module_granularity_threshold", i, "units are chosen by block (`unit_classes`); performance only"),
        Row(_Z + "use_multi_rank_bucket_allreduce", i, "performance only"),
        Row(_Z + "cpu_offload", m, "older name of `offload_optimizer.device: cpu`", lambda v, c: {"offload_optimizer": "cpu" if _truthy(v) else "none"}),
        Row("gradient_clipping", m, "`clip_grad_norm` (0 = none)", _clip),
        Row("bf16.enabled", mr, "`param_dtype: bf16` (fp32 master weights); refused with `fp16.enabled` true", _bf16),
        Row("bfloat16.enabled", mr, "older name of `bf16.enabled`", _bf16),
        Row("bf16.immediate_grad_update", i, "gradients are reduced as they are produced here"),
        Row("bf16.check_grad_overflow", i, "no loss scaling in bf16"),
        Row("fp16.enabled", m, "`param_dtype: fp16` with dynamic loss scaling (fp32 master weights)", _fp16),
        Row("fp16.loss_scale", m, "`loss_scale` (0 = `dynamic`, else that fixed scale); read only with fp16 on", _fp16_only(_loss_scale)),
        Row("fp16.initial_scale_power", m, "`loss_scale_init` = 2 ** power; read only with fp16 on", _fp16_only(_scale_power)),
        Row("fp16.loss_scale_window", m, "`loss_scale_growth_interval`; read only with fp16 on", _fp16_only(_scale_window)),
        Row("fp16.hysteresis", ir, "1 accepted; other values refused with fp16 on (the scale halves at every overflow here)", _fp16_only(_hysteresis)),
        Row("fp16.min_loss_scale", ir, "<= 1 accepted; higher refused with fp16 on (no floor here)", _fp16_only(_min_scale)),
        Row("fp16.consecutive_hysteresis", ir, "`false` accepted; `true` refused with fp16 on", _fp16_only(_only_false("set consecutive_hysteresis: false (the scale halves at every overflow here)"))),
        Row("fp16.auto_cast", ir, "`false` accepted; `true` refused: cast inputs in the script", _fp16_only(_only_false("zero_plugin does not cast the inputs; set auto_cast: false and cast them in the script") )),
        Row("fp16.fp16_master_weights_and_grads", ir, "`false` accepted; `true` refused: master weights are fp32 or fp64 here", _only_false("master weights are fp32 here (`master_dtype`); set it to false")),
        Row("amp", ir, "a section with `enabled: false` accepted; NVIDIA Apex AMP refused: use `fp16` / `bf16`", _section_disabled("zero_plugin has no Apex AMP; use the fp16 or bf16 section instead"), section=True),
        Row("communication_data_type", m, "`reduce_dtype` (fp32, fp16, bf16)", _comm_dtype),
        Row("gradient_predivide_factor", ir, "1.0 accepted; other values refused (gradients are averaged once, after the sum)", _predivide),
        Row("prescale_gradients", i, "gradients are averaged after the sum here; the result differs by rounding only"),
        Row("gradient_accumulation_steps", m, "the run's accumulation: the Trainer's `gradient_accumulation_steps` (must agree), Accelerate's `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` at launch; checked in `train_batch_size`", _positive_int, auto_ok=True),
        Row("train_micro_batch_size_per_gpu", m, "the per-process batch: the Trainer's `per_device_train_batch_size` (must agree); checked in `train_batch_size`", _positive_int, auto_ok=True),
        Row("train_batch_size", mr, "checked: micro batch x accumulation x world size; a mismatch refused, naming the three numbers", _positive_int, auto_ok=True),
        Row("zero3_init_flag", m, "`lazy_loading` (Accelerate's key: `true` = the model is built unit by unit, never whole; `false` = every process loads it whole)", _lazy),
        Row("zero_allow_untested_optimizer", i, "any torch optimizer is accepted here"),
        Row("zero_force_ds_cpu_optimizer", i, "the offloaded step runs torch's own CPU kernels"),
        Row("optimizer.type", mr, "`AdamW` / `Adam` -> torch's `AdamW` (`Adam` with `adam_w_mode: false` -> torch's `Adam`) over every trainable parameter in one group, as DeepSpeed builds it; other types refused by name", _optimizer_type),
        Row("optimizer.params", mr, "`lr`, `betas`, `eps`, `weight_decay`, `amsgrad` passed to torch; `adam_w_mode`, `torch_adam`, `fused` read or ignored; `bias_correction: false` refused", _optimizer_params, section=True),
        Row("scheduler.type", mr, "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` -> a torch `LambdaLR` with DeepSpeed's rates step for step; other types refused by name", _scheduler_type),
        Row("scheduler.params", m, "the schedule's parameters (`auto` filled as the Trainer fills them)", lambda v, c: {}, section=True),
        Row("steps_per_print", i, "logging only"),
        Row("wall_clock_breakdown", i, "logging only"),
        Row("memory_breakdown", i, "logging only (`zp.memory_report`)"),
        Row("dump_state", i, "logging only"),
        Row("flops_profiler", i, "profiling only", section=True),
        Row("tensorboard", i, "DeepSpeed's own monitor; logging only", section=True),
        Row("wandb", i, "DeepSpeed's own monitor; logging only", section=True),
        Row("csv_monitor", i, "DeepSpeed's own monitor; logging only", section=True),
        Row("comet", i, "DeepSpeed's own monitor; logging only", section=True),
        Row("comms_logger", i, "logging only (`zp.comm_stats`)", section=True),
        Row("checkpoint", i, "DeepSpeed's checkpoint storage options; checkpoints are zero_plugin's here", section=True ),
        Row("aio", i, "NVMe I/O, used by `nvme` offload only, which is refused", section=True),
        Row("activation_checkpointing", i, "read only by `deepspeed.checkpointing`, which a script under zero_plugin does not call; use the model's gradient checkpointing (`cpu_checkpointing`'s equivalent with it: `offload_activations: cpu`)", section=True),
        Row("data_types", ir, "`grad_accum_dtype` fp32 (or unset) accepted; other values refused", _data_types, section=True),
        Row("pipeline", r, "pipeline parallelism has no equivalent here; remove the section", _refuse("zero_plugin is data parallel only (no pipeline stages); remove the pipeline section"), section=True),
        Row("moe", r, "DeepSpeed-MoE expert parallelism has no equivalent here; remove the section", _refuse("zero_plugin has no expert parallelism; remove the moe section"), section=True),
        Row("tensor_parallel", ir, "`autotp_size` <= 1 accepted; tensor parallelism refused", _tensor_parallel, section=True),
        Row("sequence_parallel_size", ir, "1 accepted; sequence parallelism refused", _at_most_one("zero_plugin's sequence parallelism (ZeroConfig.sequence_parallel_size) needs the training loop to split batches and reduce the loss with its own helpers (docs/long-context.md), which a DeepSpeed-configured script does not call; set sequence_parallel_size: 1")),
        Row("elasticity", ir, "disabled accepted; elastic batch sizes refused", _section_disabled("zero_plugin has no elastic training; remove the elasticity section"), section=True),
        Row("autotuning", ir, "disabled accepted; DeepSpeed's autotuner refused (`zero-plugin estimate --fit` advises settings)", _section_disabled("run `zero-plugin estimate --fit` instead of DeepSpeed's autotuner; remove the section"), section=True),
        Row("compression_training", r, "DeepSpeed Compression changes the model; remove the section", _refuse("zero_plugin has no DeepSpeed Compression; remove the compression_training section"), section=True),
        Row("data_efficiency", ir, "disabled accepted; curriculum / data sampling refused", _section_disabled("zero_plugin does not sample the data; remove the data_efficiency section"), section=True),
        Row("curriculum_learning", ir, "disabled accepted; refused otherwise", _section_disabled("zero_plugin does not schedule sequence lengths; remove the curriculum_learning section"), section=True),
        Row("sparse_attention", r, "changes the model's attention; remove the section", _refuse("zero_plugin does not change the attention; remove the sparse_attention section"), section=True),
        Row("quantize_training", ir, "disabled accepted; quantization-aware training refused", _section_disabled("zero_plugin has no quantization-aware training; remove the section"), section=True),
        Row("hybrid_engine", ir, "disabled accepted; DeepSpeed-Chat's hybrid engine refused", _section_disabled("zero_plugin has no hybrid engine (for colocated generation see zp.offload_states); remove the section" ), section=True),
        Row("nebula", i, "checkpoint service; storage only", section=True),
    )
    # fmt: on


def _refuse(fix: str) -> Callable[[Any, Context], dict]:
    def rule(value: Any, ctx: Context) -> dict:
        raise Refused(fix)

    return rule


def _at_most_one(fix: str) -> Callable[[Any, Context], dict]:
    def rule(value: Any, ctx: Context) -> dict:
        if _number(value) > 1:
            raise Refused(fix)
        return {}

    return rule


def _tensor_parallel(value: Any, ctx: Context) -> dict:
    size = value.get("autotp_size", 1) if isinstance(value, Mapping) else value
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size <= 1:
        return {}
    raise Refused("zero_plugin has no tensor parallelism; remove the tensor_parallel section")


def _data_types(value: Any, ctx: Context) -> dict:
    dtype = value.get("grad_accum_dtype") if isinstance(value, Mapping) else None
    if dtype in (None, "fp32", "float32"):
        return {}
    raise Refused("gradients accumulate in the parameter's dtype (fp32 masters) here; set grad_accum_dtype: fp32")


TABLE: tuple[Row, ...] = _rows()
"""Every DeepSpeed key zero_plugin knows, in the order ``docs/deepspeed.md`` lists them."""

_BY_KEY = {row.key: row for row in TABLE}
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_SECTIONS = {row.key for row in TABLE if row.section}


def markdown_table() -> str:
    """:data:`TABLE` as the Markdown table of ``docs/deepspeed.md`` (the test compares the two)."""
    lines = ["| DeepSpeed key | zero_plugin | what happens |", "|---|---|---|"]
    for row in TABLE:
        key = f"`{row.key}`" + (" (section)" if row.section else "")
        lines.append(f"| {key} | {row.action} | {row.doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# -- reading and translating -------------------------------------------------------------------------


def read_deepspeed(path_or_dict: str | Path | Mapping[str, Any], name: str | None = None) -> tuple[dict, str]:
    """(the configuration as a dict, how to name it in messages: ``name``, else its path or "(a dict)")."""
    if isinstance(path_or_dict, Mapping):
        return _plain(path_or_dict), name or "(a dict)"
    path = Path(path_or_dict)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config: no such file: {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"DeepSpeed config {str(path)!r}: cannot parse it as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {str(path)!r} must hold a JSON object; got {type(data).__name__}")
    return data, name or repr(str(path))


def _plain(data: Mapping[str, Any]) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in data.items()}


@dataclasses.dataclass(frozen=True)
class DeepSpeedTranslation:
    """What one DeepSpeed configuration means here."""

    source: str
    """How messages name the configuration (its path, or "the DeepSpeed config")."""
    settings: dict
    """``ZeroConfig`` flat field -> value (only the fields some key set)."""
    origins: dict
    """``ZeroConfig`` flat field -> the DeepSpeed key that set it."""
    mapped: tuple
    """(key, value) of every mapped key, in the file's order."""
    ignored: tuple
    """(key, why) of every ignored key."""
    unknown: tuple
    """Keys no row names (warned about once)."""
    optimizer: OptimizerSpec | None
    schedule: ScheduleSpec | None
    batch: dict
    """``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``: those set."""
    defaulted: tuple = ()
    """Fields in ``settings`` set by DeepSpeed's own default for a key the configuration leaves out (``stage`` 0
    without ``zero_optimization.stage``): a zero_plugin setting given explicitly overrides them, no conflict."""

    def report(self, config: str | None = None) -> str:
        """What rank 0 prints: the config (as the caller writes it), then the DeepSpeed keys mapped and ignored."""
        lines = [f"zero_plugin: DeepSpeed config {self.source} runs as:"]
        if config is not None:
            lines.append(f"  {config}")
        lines += [f"  default: {self.origins[field]}" for field in self.defaulted]
        lines += [f"  mapped:  {key} = {json.dumps(value)}" for key, value in self.mapped]
        lines += [f"  ignored: {key} ({why})" for key, why in self.ignored]
        lines += [f"  unknown (ignored): {key}" for key in self.unknown]
        return "\n".join(lines)


def translate(
    path_or_dict: str | Path | Mapping[str, Any],
    *,
    resolved: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    warn_unknown: bool = True,
    name: str | None = None,
    later_autos: bool = False,
) -> DeepSpeedTranslation:
    """Read a DeepSpeed configuration through :data:`TABLE`.

    ``resolved``: values for ``"auto"`` entries, as top-level DeepSpeed keys whose mappings nest like the file's
    (``{"gradient_clipping": 1.0, "bf16": {"enabled": False}}``); a resolved value where the file has a different
    concrete one is refused (transformers refuses that mismatch too).  ``world_size``: checks
    ``train_batch_size``; ``name``: how messages name the configuration; ``later_autos``: an ``"auto"`` left
    unresolved is skipped, not refused (a check before the values are known, as the launcher's of a Trainer
    script's ``--deepspeed``).  Every refused key is named in one ``ValueError``.
    """
    data, source = read_deepspeed(path_or_dict, name)
    data = _resolve(data, resolved, source)
    ctx = Context(data)
    settings: dict[str, Any] = {}
    origins: dict[str, str] = {}
    mapped, ignored, unknown, refused = [], [], [], []
    for key, value in _leaves(data):
        row = _BY_KEY.get(key)
        if row is None:
            unknown.append(key)
            continue
        outcome, detail = _judge(row, key, value, ctx, later_autos)
        if outcome == _MAPPED:
            for field, field_value in detail.items():
                assert field in FLAT_NAMES or field == "stage", f"row {key} maps to unknown field {field}"
                settings[field], origins[field] = field_value, key
            mapped.append((key, value))
        elif outcome == _IGNORED:
            ignored.append((key, detail))
        else:
            refused.append(detail)
    batch = _check_batch(ctx, world_size, refused)
    defaulted = () if "stage" in settings else ("stage",)
    if defaulted:  # DeepSpeed's own default: without a stage, ZeRO is off
        settings["stage"], origins["stage"] = 0, "zero_optimization.stage (absent: DeepSpeed's default 0)"
    if refused:
        raise ValueError(f"DeepSpeed config {source}: refused: " + "; ".join(refused))
    if unknown and warn_unknown:
        warnings.warn(
            f"DeepSpeed config {source}: unknown key(s) {', '.join(unknown)} ignored (zero_plugin knows the keys "
            "listed in docs/deepspeed.md)",
            stacklevel=3,
        )
    return DeepSpeedTranslation(
        source=source,
        settings=settings,
        origins=origins,
        mapped=tuple(mapped),
        ignored=tuple(ignored),
        unknown=tuple(unknown),
        optimizer=_optimizer(ctx),
        schedule=_schedule(ctx),
        batch=batch,
        defaulted=defaulted,
    )


def _resolve(data: dict, resolved: Mapping[str, Any] | None, source: str) -> dict:
    """``data`` with its ``"auto"`` entries resolved; a concrete value that differs from the resolved one is
    refused, as transformers' ``fill_match`` refuses it."""
    mismatches: list[str] = []
    data = _fill(data, dict(resolved or {}), "", mismatches)
    if mismatches:
        raise ValueError(
            f"DeepSpeed config {source}: values that disagree with the run's own settings: "
            + "; ".join(mismatches)
            + '; set these DeepSpeed values to "auto" (or to the same values)'
        )
    return data


def _judge(row: Row, key: str, value: Any, ctx: Context, later_autos: bool = False) -> tuple[str, Any]:
    """One key's outcome: (mapped, its fields), (ignored, why) or (refused, the message naming key, value, fix)."""
    if value == AUTO and row.rule is not None and not row.section:
        if not row.auto_ok and not later_autos:
            return _REFUSED, (
                f"{key}='auto': only the HF Trainer resolves it; give a value in the file, or resolve it "
                f"(ZeroConfig.from_deepspeed(..., {_nested_hint(key)}), zero-plugin config --auto {key}=VALUE)"
            )
        why = "auto: unchecked, the script's batch sizes apply" if key in _BATCH else "auto: zero_plugin's default"
        return _IGNORED, why if row.auto_ok else "auto: resolved later"
    if row.rule is None:
        return _IGNORED, row.doc
    try:
        return _MAPPED, row.rule(value, ctx)
    except Refused as exc:
        return _REFUSED, f"{key}={_show(value)}: {exc}"
    except Ignored as exc:
        return _IGNORED, str(exc)


def _nested_hint(key: str) -> str:
    head, *rest = key.split(".")
    inner = "..."
    for part in reversed(rest):
        inner = f"{{{part!r}: {inner}}}"
    return f"{head}={inner}"


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, Mapping) else "{...}"


def _leaves(data: Mapping[str, Any], prefix: str = ""):
    """(dotted key, value) of every leaf, a section row's whole sub-tree counting as one leaf."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and key not in _SECTIONS:
            yield from _leaves(value, key + ".")
        else:
            yield key, value


def _fill(data: Any, resolved: Any, key: str, mismatches: list[str]) -> Any:
    """``data`` with its ``"auto"`` entries taken from ``resolved`` (same nesting; a key the file lacks stays
    absent, as in transformers' ``fill_match``)."""
    if isinstance(resolved, Mapping):
        if not isinstance(data, Mapping):
            return data
        return {k: _fill(v, resolved[k], f"{key}{k}.", mismatches) if k in resolved else v for k, v in data.items()}
    if data == AUTO:
        return resolved
    if not _same(data, resolved):
        mismatches.append(f"{key.rstrip('.')}={_show(data)} vs the run's {_show(resolved)}")
    return data


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _check_batch(ctx: Context, world_size: int | None, refused: list[str]) -> dict:
    """The three batch numbers that are set; train_batch_size = micro x accumulation x world size (DeepSpeed's
    rule), one missing one derived from the others as DeepSpeed derives it."""
    names = _BATCH
    batch = {n: ctx.get(n) for n in names if isinstance(ctx.get(n), int) and not isinstance(ctx.get(n), bool)}
    total, micro, accum = (batch.get(n) for n in names)
    if total is None or world_size is None:
        return batch
    if micro is not None and accum is not None:
        if total != micro * accum * world_size:
            refused.append(
                f"train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accum} x world size {world_size} (= {micro * accum * world_size}); "
                'fix one of the three (or set train_batch_size to "auto")'
            )
    elif micro is not None or accum is not None:
        known = micro if micro is not None else accum
        if total % (known * world_size):
            refused.append(
                f"train_batch_size={total} is not a multiple of {known} x world size {world_size}; fix the batch sizes"
            )
        else:
            batch["gradient_accumulation_steps" if micro is not None else "train_micro_batch_size_per_gpu"] = total // (
                known * world_size
            )
    return batch


def _optimizer(ctx: Context) -> OptimizerSpec | None:
    section = ctx.get("optimizer")
    if not isinstance(section, Mapping) or "type" not in section:
        return None
    return _optimizer_spec(section.get("params", {}), str(section["type"]).lower())


def _optimizer_spec(params: Any, kind: str) -> OptimizerSpec:
    if not isinstance(params, Mapping):
        raise Refused("optimizer.params must be a mapping")
    if params.get("bias_correction", True) is False:
        raise Refused("torch's Adam always corrects the bias; remove bias_correction: false")
    w_mode = params.get("adam_w_mode", True)
    name = "AdamW" if kind == "adamw" or _truthy(w_mode) else "Adam"
    torch_args = {}
    for key in ("lr", "eps", "weight_decay", "amsgrad"):
        if key in params and params[key] != AUTO:
            torch_args[key] = params[key]
    if "betas" in params and params["betas"] != AUTO:
        torch_args["betas"] = tuple(float(b) for b in params["betas"])
    return OptimizerSpec(name, torch_args)


def _schedule(ctx: Context) -> ScheduleSpec | None:
    section = ctx.get("scheduler")
    if not isinstance(section, Mapping) or "type" not in section:
        return None
    return ScheduleSpec(str(section["type"]), dict(section.get("params", {})))
