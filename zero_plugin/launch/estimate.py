"""What ``zero-plugin launch`` prints before it starts the processes: the planner's memory per rank.

    zero-plugin launch --stage 3 --num_processes 2 train.py --model ./my-3b ...
    zero-plugin launch: memory per rank planned for --model ./my-3b (3.142B parameters, fp32) ...

The model is the one the script's own arguments name (``--model`` / ``--model_name_or_path``): a local
folder or config file, or a Hub id already in the local Hugging Face cache.  Only its config is read
(``local_files_only``: no network), the model is built on the meta device (``planner/trace.py``), and no
weight is loaded.  The stage, offload and precision are the ``ZeroConfig`` the children will read
(``ZERO_PLUGIN_*``), the world size is Accelerate's ``--num_processes``.  When the script passes
``--batch_size`` / ``--per_device_train_batch_size`` and ``--max_length`` / ``--block_size`` /
``--max_seq_length``, activations of that micro-batch are traced too.

[Note: two rows at launch]
The launcher cannot know which parameters the script will train, and that decides the optimizer
state: a full fine-tune holds 16 bytes per fp32 parameter before sharding, a LoRA run on a frozen
base about 4.  So it prints both: every parameter trainable, and a frozen base where only the 1-D
parameters (norms, biases) train, which makes backward run through every block as LoRA's does
(adapters, ~1% of the parameters, are not counted).  The warning says which of the two will not fit.

[Note: shard groups at launch]
``ZeroConfig.shard_group_size="node"`` is resolved by each child from ``LOCAL_WORLD_SIZE``, which the
launcher does not have yet: Accelerate starts ``num_processes // num_machines`` processes per machine, so
the plan uses that many ranks per shard group (``ranks_per_host``).  The rest of the config (an int
``shard_group_size``, ``accumulate_full_grads``) goes to the planner as the children will read it.

Nothing here may stop a launch: a model that cannot be seen, or any failure of the estimate, costs
one debug log line and the launch goes on (``print_launch_estimate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from typing import Any, Sequence

from ..config import ZeroConfig

__all__ = ["Machine", "estimate_lines", "find_model", "plan_launch", "print_launch_estimate"]

_LOG = logging.getLogger("zero_plugin.launch")
_MODEL_FLAGS = ("--model", "--model_name_or_path")
_BATCH_FLAGS = ("--batch_size", "--per_device_train_batch_size")
_SEQ_FLAGS = ("--max_length", "--block_size", "--max_seq_length")
_CHECKPOINTING_FLAGS = ("--gradient_checkpointing",)
MARGIN = 0.1  # fraction of each memory kept free, as ``Planner.fit`` defaults


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this machine offers the ranks launched on it."""

    host_bytes: float
    """Host memory available now (``MemAvailable``: what other processes leave), bytes."""
    gpu_bytes: float | None = None
    """Memory of one GPU in bytes; None: no GPU, the ranks compute on the CPU."""

    @classmethod
    def this(cls, has_gpus: bool) -> Machine:
        return cls(host_bytes=_available_host_memory(), gpu_bytes=_gpu_memory() if has_gpus else None)


def _available_host_memory() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: free pages
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _gpu_memory() -> float | None:
    """The smallest GPU's memory, from nvidia-smi (NVML: no CUDA context in the launcher), else torch."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        sizes = [float(v) * 2**20 for v in out.stdout.split()] if out.returncode == 0 else []
        if sizes:
            return min(sizes)
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


# -- what the script's arguments say ----------------------------------------------------------------
def _flag_value(script_args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The last value given to any of ``flags`` (``--flag value`` or ``--flag=value``), as argparse keeps."""
    value = None
    for i, arg in enumerate(script_args):
        name, eq, inline = arg.partition("=")
        if name in flags:
            value = inline if eq else (script_args[i + 1] if i + 1 < len(script_args) else None)
    return value


def find_model(script_args: Sequence[str]) -> str | None:
    return _flag_value(script_args, _MODEL_FLAGS)


def _micro_batch(script_args: Sequence[str]) -> tuple[int | None, int | None]:
    batch, seq = _flag_value(script_args, _BATCH_FLAGS), _flag_value(script_args, _SEQ_FLAGS)
    if batch is None or seq is None or not (batch.isdigit() and seq.isdigit()) or "0" in (batch, seq):
        return None, None
    return int(batch), int(seq)


def _checkpointing(script_args: Sequence[str]) -> bool:
    """``--gradient_checkpointing`` given, alone (a switch) or with a true value (HF's argument parser)."""
    if not any(a.partition("=")[0] in _CHECKPOINTING_FLAGS for a in script_args):
        return False
    value = _flag_value(script_args, _CHECKPOINTING_FLAGS)
    return value is None or value.startswith("-") or value.lower() in ("true", "1", "yes")


def _model_config(spec: str):
    """The transformers config of ``spec`` from local files only: a folder, a config file or the HF cache."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(spec, local_files_only=True)


# -- the plan -----------------------------------------------------------------------------------------
def plan_launch(
    model_config: Any,
    zero_config: ZeroConfig,
    world_size: int,
    machine: Machine,
    *,
    ranks_per_host: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
) -> dict:
    """``Planner.fit`` of the launched model for every setting, trainable and frozen ([Note: two rows at launch]).

    Returns ``{"setting", "device", "shard_group_size", "activations", "full", "frozen"}``: the launched (stage,
    offload, offload_params), the planned device, the ranks per shard group (None: the whole world), the
    planner's activation arguments, and one fit result per row (``frozen`` is None when the model has no 1-D
    parameter).  With a micro-batch, the activations are
    planned as the children run them: one rank of a ``sequence_parallel_size`` group, checkpointed as the script
    asks, checkpointed inputs offloaded with ``offload_activations``.
    """
    from ..planner import SETTINGS, Planner, resolve_model

    device = "cpu" if machine.gpu_bytes is None else "cuda"
    if zero_config.comm.shard_group_size == "node" and ranks_per_host is not None:  # [Note: shard groups at launch]
        zero_config = zero_config.replace(shard_group_size=ranks_per_host)
    setting = (zero_config.stage, zero_config.offload.optimizer == "cpu", zero_config.offload.params)
    settings = SETTINGS if setting in SETTINGS else (*SETTINGS, setting)
    activations = _activations(zero_config, batch, checkpointing, device)
    fits = {}
    for row in ("full", "frozen"):
        model = resolve_model(model_config)
        if row == "frozen":
            if not any(p.ndim == 1 for p in model.parameters()):
                fits[row] = None
                continue
            for p in model.parameters():
                p.requires_grad_(p.ndim == 1)
        plan = Planner(
            model,
            config=zero_config,
            batch=batch,
            seq=seq,
            device=device,
            **activations,
        )
        fits[row] = plan.fit(
            world_size,
            machine.gpu_bytes,
            machine.host_bytes,
            margin=MARGIN,
            ranks_per_host=ranks_per_host,
            settings=settings,
        )
    shard = zero_config.resolved_shard_group_size(world_size)
    return {"setting": setting, "device": device, "shard_group_size": shard, "activations": activations, **fits}


def _activations(zero_config: ZeroConfig, batch: int | None, checkpointing: bool, device: str) -> dict:
    """The planner's activation arguments for the children's run (none without a micro-batch to trace); on a
    CPU-only machine activation offload moves nothing."""
    if batch is None:
        return {}
    offload = checkpointing and zero_config.offload.activations == "cpu" and device == "cuda"
    k = zero_config.comm.sequence_parallel_size
    return {"checkpointing": checkpointing, "sequence_parallel": k, "offload_activations": offload}


def launched_row(fit: dict, setting: tuple) -> dict:
    return next(r for r in fit["rows"] if (r["stage"], r["offload"], r["offload_params"]) == setting)


# -- the lines ------------------------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _activation_notes(activations: dict) -> list[tuple[bool, str]]:
    k = activations.get("sequence_parallel", 1)
    return [
        (k > 1, f"sequence split over {k} ranks"),
        (activations.get("checkpointing", False), "checkpointed"),
        (activations.get("offload_activations", False), "offloaded"),
    ]


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _per_rank(row: dict, device: str) -> str:
    if device == "cpu":  # one memory: what the planner calls device and host is all RSS
        return f"{_size(row['peak']['total'])} per rank"
    return f"device {_size(row['peak']['device'])}, host {_size(row['peak']['host'])} per rank"


def _flags(row: dict) -> str:
    text = f"--stage {row['stage']}" + (" --offload cpu" if row["offload"] else "")
    return text + (" with offload_params: true in --zero_config" if row["offload_params"] else "")


def _groups(plan: dict) -> str:
    k = plan["shard_group_size"]
    return f" (shard groups of {k})" if k else ""


def _shortfall(row: dict, fit: dict, device: str) -> str:
    """Which memory is short, by how much."""
    usable = 1 - fit["margin"]
    per_host, host = fit["ranks_per_host"], fit["host_mem"]
    need = row["peak"]["total" if device == "cpu" else "host"]
    parts = []
    if not row["device_ok"]:
        parts.append(f"GPU: {_size(row['peak']['device'])} per rank, {_size(fit['gpu_mem'])} per device")
    if not row["host_ok"]:
        parts.append(
            f"host: {per_host} ranks x {_size(need)} = {_size(per_host * need)}, "
            f"{_size(host * usable)} usable of {_size(host)} available"
        )
    return "; ".join(parts)


def _advice(plan: dict, rows: Sequence[str] = ("full", "frozen")) -> str:
    """The cheapest setting that fits (``Planner.fit``'s ranking), for the first of ``rows`` that any fits."""
    names = {"full": "a full fine-tune", "frozen": "a frozen base"}
    for row in rows:
        best = plan[row] and plan[row]["best"]
        if best is not None:
            return f"{_flags(best)} fits {names[row]} ({_per_rank(best, plan['device'])})"
    return (
        f"no setting fits {' or '.join(names[r] for r in rows)} on {plan['full']['world_size']} ranks: use "
        "more ranks or machines, a smaller batch, or activation checkpointing (zero-plugin estimate --fit "
        "shows every setting)"
    )


def _warning(plan: dict) -> list[str]:
    full = launched_row(plan["full"], plan["setting"])
    if full["fits"]:
        return []
    name = f"--stage {full['stage']}" + (" with offload" if full["offload"] else "")
    frozen = plan["frozen"] and launched_row(plan["frozen"], plan["setting"])
    if frozen and frozen["fits"]:
        short = _shortfall(full, plan["full"], plan["device"])
        return [
            f"zero-plugin launch: note: a full fine-tune at {name} will not fit ({short}); "
            f"it fits only if the base model is frozen (LoRA / PEFT); {_advice(plan, ('full',))}"
        ]
    worst = frozen or full
    return [
        f"zero-plugin launch: WARNING: {name} will not fit this machine"
        f"{' even with a frozen base' if frozen else ''} "
        f"({_shortfall(worst, plan['frozen' if frozen else 'full'], plan['device'])}); {_advice(plan)}"
    ]


def render(plan: dict, model: str, machine: Machine, batch: int | None, seq: int | None) -> list[str]:
    full = launched_row(plan["full"], plan["setting"])
    counts, device, fit = full["params"], plan["device"], plan["full"]
    acts = f"activations of {batch} x {seq} tokens per rank" if batch else "no activations (no batch/length flags)"
    acts += "".join(f", {text}" for shown, text in _activation_notes(plan["activations"]) if shown)
    lines = [
        f"zero-plugin launch: memory per rank planned for --model {model} ({_count(counts['total'])} "
        f"parameters, {full['param_dtype']}; zero_plugin.planner: model states, our buffers, {acts}):",
        f"  {_flags(full)}, {fit['world_size']} ranks on {device}{_groups(plan)}, full fine-tune (every parameter trains): "
        f"{_per_rank(full, device)}",
    ]
    if plan["frozen"] is not None:
        frozen = launched_row(plan["frozen"], plan["setting"])
        lines.append(
            f"  same with a frozen base (only norms and biases train, as under LoRA; adapters not "
            f"counted): {_per_rank(frozen, device)}"
        )
    gpu = f"GPU {_size(machine.gpu_bytes)} per device, " if machine.gpu_bytes is not None else ""
    lines.append(
        f"  this machine: {gpu}{_size(machine.host_bytes)} host memory available for "
        f"{fit['ranks_per_host']} ranks ({fit['margin']:.0%} kept free); skip with --no_estimate"
    )
    return lines + _warning(plan)


def estimate_lines(
    script_args: Sequence[str],
    zero_config: ZeroConfig,
    world_size: int,
    machine: Machine,
    *,
    ranks_per_host: int | None = None,
) -> list[str]:
    """The lines ``zero-plugin launch`` prints; [] when the script's arguments name no model.

    Raises what loading the config or planning raises (``print_launch_estimate`` turns that into a debug line).
    """
    model = find_model(script_args)
    if model is None:
        return []
    batch, seq = _micro_batch(script_args)
    plan = plan_launch(
        _model_config(model),
        zero_config,
        world_size,
        machine,
        ranks_per_host=ranks_per_host,
        batch=batch,
        seq=seq,
        checkpointing=_checkpointing(script_args),
    )
    return render(plan, model, machine, batch, seq)


def print_launch_estimate(
    script_args: Sequence[str], args: argparse.Namespace, accelerate_settings: dict, env: dict[str, str], has_gpus: bool
) -> None:
    """``launch``'s call: print the estimate to stderr; never raises (see the module docstring)."""
    try:
        world_size = int(args.num_processes or accelerate_settings.get("num_processes") or _gpu_count(has_gpus))
        machines = int(getattr(args, "num_machines", None) or accelerate_settings.get("num_machines") or 1)
        lines = estimate_lines(
            script_args,
            ZeroConfig.from_env({**os.environ, **env}),
            world_size,
            Machine.this(has_gpus),
            ranks_per_host=max(1, world_size // machines),
        )
    except Exception as exc:  # noqa: BLE001 - an estimate is advice: it must never stop the launch
        _LOG.debug("zero-plugin launch: no memory estimate: %s: %s", type(exc).__name__, exc)
        return
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def _gpu_count(has_gpus: bool) -> int:
    import torch

    return torch.cuda.device_count() if has_gpus and torch.cuda.is_available() else 1
