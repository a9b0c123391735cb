"""A DeepSpeed configuration at every door of zero_plugin, through the one table (``config_deepspeed.py``).

* ``zero-plugin launch`` (``launch/launcher.py``): an Accelerate config's ``DEEPSPEED`` section and the
  ``--use_deepspeed`` flags become a DeepSpeed dict (:func:`from_accelerate`), translated in the parent.
* a ``transformers.Trainer`` script's ``TrainingArguments(deepspeed=...)`` (a path or a dict), under
  ``zero_plugin.run``: :func:`install` lets ``TrainingArguments.__post_init__`` run without DeepSpeed (which
  transformers would import) and translates the configuration with its ``"auto"`` values resolved from the
  arguments as transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` resolves them
  (:func:`trainer_autos`); ``hf_trainer.py`` then gives the Trainer's Accelerator that ``ZeroConfig`` and builds
  the section's optimizer and schedule.

Either way the DeepSpeed settings meet zero_plugin's own (``--stage``, ``--offload``, ``--zero_config``, a
``zero_plugin:`` section, ``ZERO_PLUGIN_*`` variables): a field both set must agree, else ``ValueError`` names
both (:func:`merged_config`).  What ran is printed once: by the launcher, or by rank 0 of a Trainer script.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from zero_plugin import config_sources as sources
from zero_plugin import upstream
from zero_plugin.config import ZeroConfig
from zero_plugin.config_deepspeed import DeepSpeedTranslation, OptimizerSpec, ScheduleSpec, read_deepspeed, translate
from zero_plugin.config_groups import FLAT_NAMES, GROUPS, flat_name, kind_of, label

__all__ = ["TakenOver", "from_accelerate", "install", "merged_config", "taken_over", "to_yaml"]


# -- zero_plugin's own settings against DeepSpeed's ---------------------------------------------------
def explicit_settings(environ: Mapping[str, str] | None = None) -> dict[str, tuple[Any, str]]:
    """The settings zero_plugin's own sources give explicitly: flat field -> (value, where it was given), from
    ``ZERO_PLUGIN_CONFIG`` (its keys, flat or grouped) and the ``ZERO_PLUGIN_*`` variables (which win)."""
    env = os.environ if environ is None else environ
    out: dict[str, tuple[Any, str]] = {}
    path = env.get(sources.ENV_CONFIG, "")
    if path:
        for key, value in sources.read_config_file(Path(path)).items():
            if key in GROUPS and isinstance(value, Mapping):
                fields = {f.name: flat_name(f) for f in dataclasses.fields(GROUPS[key])}
                out.update((fields.get(k, k), (v, f"{path}: {key}.{k}")) for k, v in value.items())
            else:
                out[key] = (value, f"{path}: {key}")
    for var, field in sources.env_overrides(env, ("stage", *FLAT_NAMES)).items():
        flag = {"ZERO_PLUGIN_STAGE": "--stage", "ZERO_PLUGIN_OFFLOAD": "--offload"}.get(var)
        out[field] = (env[var], f"{flag} {env[var]} / {var}={env[var]}" if flag else f"{var}={env[var]}")
    return out


def _normalised(field: str, value: Any) -> Any:
    if field == "stage":
        return int(value)
    key, dc_field = FLAT_NAMES[field]
    kind = kind_of(dc_field)
    return kind.from_text(label(key, dc_field), value) if isinstance(value, str) else kind.check(field, value)


def merged_config(translation: DeepSpeedTranslation, explicit: Mapping[str, tuple[Any, str]]) -> ZeroConfig:
    """The DeepSpeed settings with zero_plugin's explicit ones; a field both set to different values is refused,
    naming both."""
    clashes = []
    for field, value in translation.settings.items():
        if field in explicit and field not in translation.defaulted:
            given, where = explicit[field]
            if _normalised(field, given) != _normalised(field, value):
                clashes.append(
                    f"zero_plugin's {field}={given!r} (from {where}) and DeepSpeed's {translation.origins[field]} "
                    f"(giving {field}={value!r}, in {translation.source}) disagree"
                )
    if clashes:
        raise ValueError("; ".join(clashes) + "; drop one of each pair (or make them equal)")
    data = {**translation.settings, **{field: value for field, (value, _) in explicit.items()}}
    try:
        return ZeroConfig.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"DeepSpeed config {translation.source} with zero_plugin's settings: {exc}") from exc


def changed_fields(config: ZeroConfig) -> dict[str, Any]:
    """The flat fields that differ from ``ZeroConfig()``'s, stage always included."""
    default = ZeroConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if k == "stage" or v != default[k]}


def to_yaml(config: ZeroConfig, translation: DeepSpeedTranslation) -> str:
    """zero_plugin's YAML for ``config`` (``ZeroConfig.from_file`` reads it back equal), headed by comments on
    what lies outside ``ZeroConfig``: the optimizer, the schedule and the batch sizes."""
    lines = [f"# zero_plugin configuration from DeepSpeed config {translation.source}"]
    if translation.optimizer is not None:
        lines.append(
            f"# optimizer: torch.optim.{translation.optimizer.name}(trainable parameters, {translation.optimizer.params})"
        )
    if translation.schedule is not None:
        lines.append(
            f"# scheduler: DeepSpeed's {translation.schedule.name}({translation.schedule.params}), built by the Trainer"
        )
    if translation.batch:
        lines.append(f"# batch sizes (the script's): {translation.batch}")
    if translation.unknown:
        lines.append(f"# unknown DeepSpeed keys, ignored: {', '.join(translation.unknown)}")
    return "\n".join(lines) + "\n" + yaml.safe_dump(changed_fields(config), sort_keys=False)


def report(translation: DeepSpeedTranslation, config: ZeroConfig) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in changed_fields(config).items())
    return translation.report(f"ZeroConfig({fields})")


_PRINTED: set[str] = set()


def print_once(translation: DeepSpeedTranslation, config: ZeroConfig) -> None:
    """Rank 0 prints the report, once per process and configuration."""
    text = report(translation, config)
    if os.environ.get("RANK", "0") != "0" or text in _PRINTED:
        return
    _PRINTED.add(text)
    print(text, file=sys.stderr, flush=True)


# -- the launcher: Accelerate's DEEPSPEED config and flags -------------------------------------------
_ACCELERATE_KEYS = {
    "zero_stage": ("zero_optimization", "stage"),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_param_device": ("zero_optimization", "offload_param", "device"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "gradient_clipping": ("gradient_clipping",),
    "zero3_init_flag": ("zero3_init_flag",),
    "zero3_save_16bit_model": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
    "offload_optimizer_nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
    "offload_param_nvme_path": ("zero_optimization", "offload_param", "nvme_path"),
}
"""Accelerate's ``deepspeed_config:`` keys / ``accelerate launch`` flags -> the DeepSpeed key they stand for."""
_ACCELERATE_IGNORED = ("deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
                       "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names")  # fmt: skip


def from_accelerate(section: Mapping[str, Any], flags: Mapping[str, Any]) -> tuple[dict, dict, str]:
    """(DeepSpeed dict, resolved autos, its name) for Accelerate's ``deepspeed_config:`` ``section`` with the
    launch ``flags`` (``None`` = not given) on top.  With ``deepspeed_config_file`` the file is the configuration
    and the other keys only resolve its ``"auto"`` values, as Accelerate does; without one, Accelerate's
    defaults apply (stage 2, clipping 1.0)."""
    given = {k: v for k, v in {**section, **{k: v for k, v in flags.items() if v is not None}}.items()}
    unknown = [
        k for k in given if k not in _ACCELERATE_KEYS and k not in _ACCELERATE_IGNORED and k != "deepspeed_config_file"
    ]
    if unknown:
        raise ValueError(f"Accelerate's deepspeed_config: unknown key(s) {', '.join(map(repr, unknown))}")
    path = given.get("deepspeed_config_file")
    path = None if str(path).lower() in ("none", "") else path  # Accelerate's config writes 'none' for unset
    autos = {"gradient_clipping": float(given.get("gradient_clipping", 1.0))}
    if "gradient_accumulation_steps" in given:
        autos["gradient_accumulation_steps"] = int(given["gradient_accumulation_steps"])
    if path:
        try:
            data, name = read_deepspeed(path)
        except FileNotFoundError as exc:
            raise ValueError(f"--deepspeed_config_file / deepspeed_config_file: {exc}") from None
        data.setdefault("gradient_accumulation_steps", 1)  # Accelerate's rule for a file that leaves it out
        if "zero3_init_flag" in given:
            data["zero3_init_flag"] = _bool(given["zero3_init_flag"])
        return data, autos, name
    data: dict = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
    for key, value in given.items():
        if key in _ACCELERATE_KEYS:
            node = data
            *parents, leaf = _ACCELERATE_KEYS[key]
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = _bool(value) if key.startswith("zero3_") else value
    return data, autos, "(Accelerate's deepspeed_config and launch flags)"


def _bool(value: Any) -> Any:
    return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value


def precision_autos(mixed_precision: str | None) -> dict:
    """``fp16`` / ``bf16`` ``"auto"`` from Accelerate's (or the Trainer's) mixed precision."""
    mp = str(mixed_precision or "no").lower()
    return {"fp16": {"enabled": mp == "fp16"}, "bf16": {"enabled": mp == "bf16"}}


# -- the Trainer: TrainingArguments(deepspeed=...) ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TakenOver:
    """What a ``TrainingArguments(deepspeed=...)`` means under zero_plugin."""

    config: ZeroConfig
    optimizer: OptimizerSpec | None
    schedule: ScheduleSpec | None
    translation: DeepSpeedTranslation


_ATTRIBUTE = "_zero_plugin_deepspeed"


def taken_over(args: Any) -> TakenOver | None:
    """The record :func:`install` left on ``TrainingArguments`` built with ``deepspeed=...``, else None."""
    return getattr(args, _ATTRIBUTE, None)


def trainer_autos(args: Any) -> dict:
    """The ``"auto"`` values, as transformers' ``trainer_config_process`` fills them from ``TrainingArguments``
    (the schedule's step counts wait for ``Trainer.create_scheduler``, as its ``trainer_config_finalize`` does)."""
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": args.world_size * micro * accum,
        "gradient_clipping": args.max_grad_norm,
        "optimizer": {
            "params": {
                "lr": args.learning_rate,
                "betas": [args.adam_beta1, args.adam_beta2],
                "eps": args.adam_epsilon,
                "weight_decay": args.weight_decay,
            }
        },
        "scheduler": {"params": {"warmup_max_lr": args.learning_rate}},
        "fp16": {"enabled": bool(args.fp16 or args.fp16_full_eval)},
        "bf16": {"enabled": bool(args.bf16 or args.bf16_full_eval)},
    }


def take_over(args: Any, deepspeed: Any) -> TakenOver:
    """Translate ``TrainingArguments.deepspeed`` (a path or a dict) for these arguments."""
    source = deepspeed if isinstance(deepspeed, Mapping) else str(deepspeed)
    translation = translate(source, resolved=trainer_autos(args), world_size=args.world_size,
                            warn_unknown=os.environ.get("RANK", "0") == "0")  # fmt: skip
    config = merged_config(translation, explicit_settings())
    print_once(translation, config)
    return TakenOver(config, translation.optimizer, translation.schedule, translation)


_ON_TAKE_OVER: list[Callable[[ZeroConfig], None]] = []


def install(on_take_over: Callable[[ZeroConfig], None] | None = None) -> None:
    """``TrainingArguments.__post_init__`` with ``deepspeed`` set: run it as without DeepSpeed (transformers would
    import it and build its plugin), then record the translation on the arguments; ``args.deepspeed`` keeps the
    user's value.  ``on_take_over(config)`` then runs (``zero_plugin.run``: the lazy ``from_pretrained`` at stage
    3).  Idempotent; subclasses (``Seq2SeqTrainingArguments``, TRL's configs) call it through super()."""
    from transformers import training_args

    if on_take_over is not None and on_take_over not in _ON_TAKE_OVER:
        _ON_TAKE_OVER.append(on_take_over)
    cls = training_args.TrainingArguments
    if getattr(cls, "_zero_plugin_takes_deepspeed", False):
        return
    upstream.check("transformers.training_args.TrainingArguments", cls)  # [Note: patched upstream names]
    original = cls.__post_init__

    def __post_init__(self) -> None:
        given = self.deepspeed
        if not given:
            return original(self)
        self.deepspeed = None
        try:
            original(self)
        finally:
            self.deepspeed = given
        taken = take_over(self, given)
        setattr(self, _ATTRIBUTE, taken)
        for callback in _ON_TAKE_OVER:
            callback(taken.config)

    cls.__post_init__ = __post_init__
    cls._zero_plugin_takes_deepspeed = True
