"""``Planner``: one model's activation trace planned for any stage, world size and offload setting.

A step's memory is replayed as a timeline, not summed from maxima (that overestimates by the size of
whatever is gone when the other peaks):
  * model states: ``memory.theory_bytes`` (ZeRO paper section 5, the same numbers ``zp.memory_report``
    prints as theory).  Parameters and optimizer state live all step; gradients exist from the
    backward that produces them to the ``zero_grad`` after the step;
  * activations: one forward + backward traced on fake tensors (``trace.py``);
  * our transient buffers, replayed at the trace's events exactly as the engine allocates them, in
    the layout ``Comm`` uses on the planned backend ([Note: in-place region gather] in
    ``collectives.py``; device "cpu" plans gloo, "cuda" NCCL):
    stages 0-2: a buffer per gradient bucket (``grads/bucket.py``), as many buckets pending as
    ``grads/reducer.py`` allows, then (stages 1-2) the all-gather of updated parameters after the step,
    as many buckets at once as ``engines/param_sync.py`` allows; in place (stages 1-2 on gloo) no bucket
    buffer (the gradients themselves are summed, or a copy in the reduce dtype), stage 2's region copied
    out at completion, and no buffer for the parameter gather;
    stage 3: the root unit gathered for the whole step and the last unit of the forward order from its
    forward through its backward ([Note: last unit kept] in ``hooks.py``), each other unit gathered around its forward
    and backward with ``prefetch_depth`` more in flight (``stage3/hooks.py``'s ``prefetch_span``);
    buffered (NCCL): input ``width+t`` and output ``N*(width+t)`` in ``param_dtype`` (``t``: the unit
    tag's elements, ``stage3/unit.py``), reduce-scatter buffers ``N*(width+k)``; in place (gloo): the
    full tensors from the launch and no buffers, gradients kept whole until their reduction completes;
    as many reductions in flight as ``stage3/hooks.py`` allows;
  * hierarchical sharding (``config.shard_group_size=k``): states sharded over the shard group's k
    ranks (``memory_report``'s theory with N = k) and the collectives replayed over k; the replica
    all-reduce of the reduced shards adds no buffer (the regions or row it sums exist already; in place
    one concatenated copy of them, Ψ/k, is not counted);
  * stage 3 with ``config.stage3.accumulate_full_grads``: the full gradients kept between ``no_sync``
    micro-batches (Ψ x reduce-dtype bytes, ``Planner.kept_grad_bytes``), alive in the synced
    micro-batch's forward and backward until each unit's reduction completes;
  * the optimizer step: AdamW on one tensor at a time allocates two parameter-sized temporaries
    (CPU default), ``foreach`` one list of all of them (CUDA default), the fused kernel none (offload).
The estimate counts live tensor bytes: what ``torch.cuda.max_memory_allocated`` reports on a GPU, and
the peak RSS of a CPU run whose allocator returns freed blocks (``benchmarks/planner_accuracy.py``,
"exact" allocator); ``rss_glibc`` adds the slack of glibc's default one ([Note: glibc slack]).  The
constants of that schedule are imported from the engine modules named above (``replay.py``).

[Note: glibc slack]
With glibc's default malloc, freed blocks up to 32 MiB stay in the heap (its mmap threshold rises to
the largest block freed), so a CPU run's peak RSS is higher than its live tensor bytes: ``rss_glibc``
(device "cpu" only) adds one activation peak, the documented slack term that the runs in
``benchmarks/results/planner.md`` support (the heap keeps the freed blocks of one step's activations;
see the numbers there for how well it holds).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch

from ..comm.collectives import regions_in_place
from ..config import ZeroConfig
from ..memory import theory_bytes
from .long_context import long_context_step
from .replay import Memory, Replay, ReplicatedReplay, Setting, Stage3Replay
from .trace import ParamInfo, Trace, checkpointing, default_loss, hf_inputs, resolve_model, synthetic_trace, trace_model

__all__ = ["COST_MODEL", "SETTINGS", "Planner", "cost", "estimate"]

# Relative step cost used by ``Planner.fit`` to rank settings that fit (lower is faster):
# communication per step in units of Ψ (ZeRO paper section 7: 2Ψ for stages 0-2, 3Ψ for stage 3),
# plus a penalty for host traffic and the CPU optimizer step (ZeRO-Offload moves Ψ/N gradients down and
# Ψ/N parameters up each step over PCIe, and steps on the CPU; offloading parameters copies every
# gathered shard in, twice per step).  Ties go to the lower stage: least sharding, fewest collectives.
COST_MODEL = {"comm": {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}, "offload_optimizer": 1.5, "offload_params": 2.0}


# -- planner ------------------------------------------------------------------------------------------
SETTINGS = (
    (0, False, False),
    (1, False, False),
    (2, False, False),
    (3, False, False),
    (1, True, False),
    (2, True, False),
    (3, True, False),
    (3, True, True),
)
"""(stage, offload_optimizer, offload_params) rows of a plan."""


class Planner:
    """One model and one activation trace, planned for any stage, world size and offload setting.

    ``model``: an ``nn.Module`` (any device; meta is fine), a transformers config, a built-in name
    (``BUILTIN_MODELS``), a config path or Hub id, or a parameter count (no structure: stage 3 assumes
    ``SYNTHETIC_BLOCKS`` equal blocks, no activations).  ``batch``/``seq``: per-rank micro-batch for the
    activation trace (transformers causal LMs; other models pass ``inputs`` and ``loss_fn``).
    ``config``: the rest of ``ZeroConfig`` (bucket size, prefetch depth, units, reduce dtype).
    ``device``: "cuda" (the default planning target) or "cpu" (what a CPU-only run does: offload copies
    nothing and the optimizer steps one tensor at a time).
    Long context (``long_context.py``): ``sequence_parallel=K`` traces one rank of a Ulysses group of K, its
    ceil(seq / K) tokens with attention over the whole ``seq`` for 1/K of the heads (the real wrapper and
    exchange over a stand-in group) and the loss on its logits; ``offload_activations`` (with checkpointing, on
    device "cuda") moves the checkpointed layers' inputs to the host (``peak["host"]``); ``tiled_loss`` (tokens
    per tile) computes the loss with ``zp.tiled_lm_loss`` instead of whole logits.
    """

    def __init__(
        self,
        model: Any,
        *,
        param_dtype: torch.dtype | str | None = None,
        batch: int | None = None,
        seq: int | None = None,
        checkpointing: bool = False,
        config: ZeroConfig | None = None,
        device: str = "cuda",
        state_per_param: int = 2,
        inputs: Callable | None = None,
        loss_fn: Callable | None = None,
        sequence_parallel: int = 1,
        offload_activations: bool = False,
        tiled_loss: int | None = None,
    ) -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"planner: device must be 'cuda' or 'cpu'; got {device!r}")
        if (batch is None) != (seq is None) or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in (batch, seq)
        ):
            raise ValueError(
                f"planner: batch and seq must be given together, as ints >= 1; got batch={batch!r}, seq={seq!r}"
            )
        if offload_activations and not checkpointing:
            raise ValueError("planner: offload_activations moves checkpointed layers' inputs: it needs checkpointing")
        if isinstance(sequence_parallel, bool) or not isinstance(sequence_parallel, int) or sequence_parallel < 1:
            raise ValueError(f"planner: sequence_parallel must be an int >= 1; got {sequence_parallel!r}")
        self.sequence_parallel, self.tiled_loss = sequence_parallel, tiled_loss
        self.offload_activations = offload_activations and device == "cuda"  # on CPU nothing moves
        config = config or ZeroConfig()
        self.config = config.replace(param_dtype=param_dtype) if param_dtype is not None else config
        self.device, self.state_per_param = device, state_per_param
        self.batch, self.seq, self.checkpointing = batch, seq, checkpointing
        resolved = resolve_model(model)
        if isinstance(resolved, int):
            self.model, self.model_dtype = None, torch.float32
            self.trace = synthetic_trace(resolved)
        else:
            self.model = resolved
            self.model_dtype = next((p.dtype for p in resolved.parameters() if p.is_floating_point()), torch.float32)
            self.trace = self._trace(inputs, loss_fn)
        self.params: list[ParamInfo] = self.trace.params
        cfg = self.config  # precision as memory.py decides it
        self.mixed = cfg.precision.param_dtype is not None and cfg.precision.param_dtype != cfg.precision.master_dtype
        self.param_bytes = (cfg.precision.param_dtype or self.model_dtype).itemsize
        self.master_bytes = cfg.precision.master_dtype.itemsize if self.mixed else self.param_bytes

    def _trace(self, inputs: Callable | None, loss_fn: Callable | None) -> Trace:
        from ..stage3.policy import assign_units

        model = self.model
        modules, owner = assign_units(model, self.config)
        long = inputs is None and (self.sequence_parallel > 1 or self.tiled_loss is not None)
        make = inputs or hf_inputs(model, self.batch or 1, self.seq or 1)
        was_training = model.training
        model.train()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(checkpointing(model, self.checkpointing))
                if long:
                    make, loss_fn = stack.enter_context(
                        long_context_step(
                            model, self.batch or 1, self.seq or 1, self.sequence_parallel, self.tiled_loss
                        )
                    )
                trace = trace_model(
                    model,
                    [m for _, m in modules],
                    owner,
                    [n for n, _ in modules],
                    make,
                    param_dtype=self.config.precision.param_dtype,
                    loss_fn=loss_fn or default_loss,
                    offload_activations=self.offload_activations,
                )
        finally:
            model.train(was_training)
        if self.batch is None and inputs is None:  # structure only: no activations were asked for
            trace.events = [("seg", 0, 0) if ev[0] == "seg" else ev for ev in trace.events]
            trace.saved_bytes = trace.forward_bytes = trace.peak_bytes = 0
        return trace

    def with_trace(self, trace: Trace, seq: int) -> Planner:
        """This plan with another activation trace of the same model (``long_context.py`` extrapolates one
        to a sequence length it did not trace)."""
        other = copy.copy(self)
        other.trace, other.seq = trace, seq
        return other

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def counts(self) -> dict[str, int]:
        trainable = sum(p.numel for p in self.params if p.requires_grad)
        total = sum(p.numel for p in self.params)
        return {"total": total, "trainable": trainable, "frozen": total - trainable}

    def reduce_bytes(self, config: ZeroConfig) -> int:
        dtype = config.effective_reduce_dtype
        return dtype.itemsize if dtype is not None else self.param_bytes

    def shard_is_master(self, s: Setting) -> bool:
        """Stage 3 keeps one fp32 shard as parameter and master unless offload moves masters off the device."""
        return s.stage == 3 and self.mixed and not (s.offload and s.device == "cuda")

    def theory(self, s: Setting) -> dict[str, float]:
        c = self.counts
        return theory_bytes(
            stage=s.stage,
            world_size=s.shard_world,
            trainable=c["trainable"],
            frozen=c["frozen"],
            param_bytes=self.param_bytes,
            master_bytes=self.master_bytes,
            state_per_param=self.state_per_param,
            mixed=self.mixed,
            shard_is_master=self.shard_is_master(s),
        )

    # -- estimates ----------------------------------------------------------------------------------
    def setting(
        self, world_size: int, stage: int, offload: bool | str = False, offload_params: bool = False
    ) -> Setting:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"planner: world_size must be an int >= 1; got {world_size!r}")
        config = self.config.replace(stage=stage, offload_optimizer=offload, offload_params=offload_params)
        return Setting(
            config.stage,
            world_size,
            config.offload.optimizer == "cpu",
            config.offload.params,
            self.device,
            config,
            in_place=self.device == "cpu" and regions_in_place("gloo"),
            shard_world=config.resolved_shard_group_size(world_size) or world_size,
        )

    def estimate(
        self, world_size: int, stage: int, *, offload: bool | str = False, offload_params: bool = False
    ) -> dict[str, Any]:
        """Per-rank bytes for one setting; see the module docstring for what each part counts."""
        s = self.setting(world_size, stage, offload, offload_params)
        theory = self.theory(s)
        replay = (Stage3Replay if s.stage == 3 else ReplicatedReplay)(self, s, theory)
        mem = replay.run()
        return _result(self, s, theory, replay, mem)

    def kept_grad_bytes(self, s: Setting) -> float:
        """Stage 3 with ``accumulate_full_grads``: the full gradients ``zp.no_sync`` keeps on the compute
        device between micro-batches, every trainable parameter in the reduce dtype ([Note: deferred
        reduction] in stage3/accumulate.py).  The replay holds them from the forward of the step's synced
        micro-batch (every micro-batch before it left them) until the unit's reduction completes."""
        if s.stage != 3 or not s.config.stage3.accumulate_full_grads:
            return 0.0
        return float(self.counts["trainable"] * self.reduce_bytes(s.config))

    def parameter_partition(self, world_size: int, stage: int) -> dict[str, Any]:
        """What ``ZeroConfig.optimizer_partition="parameters"`` adds at ``stage`` (1-3) on ``world_size`` ranks
        ([Note: optimizer partitions] in optim/partition.py), from the same owner assignment the engine makes:
        ``owned`` (elements of the busiest owner), ``step_bytes`` (its whole masters and gradients during the
        step, in the masters' dtype), ``exchange_bytes`` (the most one rank sends per step: its regions of the
        gradients, and of the masters where the owner cannot read them from its full parameter, to the owners,
        and as owner the stepped regions back) and ``state_share`` (the busiest owner's share of the optimizer
        state; 1/N is the element partition's)."""
        from ..optim.partition import assign_owners
        from ..tensors.flat import ShardLayout

        numels = [p.numel for p in self.params if p.requires_grad]
        owners = assign_owners(numels, world_size)
        owned = [0] * world_size
        sent = [0] * world_size
        # stages 1-2 without separate masters: the owner's full parameter already holds the values
        regions_per_param = 1 if stage < 3 and not self.mixed else 2
        for numel, owner in zip(numels, owners):
            owned[owner] += numel
            for rank in range(world_size):
                lo, hi = ShardLayout(numel, world_size, rank).bounds()
                if rank != owner:
                    sent[rank] += regions_per_param * (hi - lo)
            lo, hi = ShardLayout(numel, world_size, owner).bounds()
            sent[owner] += numel - (hi - lo)
        total = max(sum(numels), 1)
        return {
            "owned": max(owned),
            "step_bytes": 2 * max(owned) * self.master_bytes,
            "exchange_bytes": max(sent) * self.master_bytes,
            "state_share": max(owned) / total,
        }

    def rows(self, world_size: int, settings=SETTINGS) -> list[dict[str, Any]]:
        return [self.estimate(world_size, st, offload=off, offload_params=op) for st, off, op in settings]

    def fit(
        self,
        world_size: int,
        gpu_mem: float | None,
        host_mem: float,
        *,
        margin: float = 0.1,
        ranks_per_host: int | None = None,
        settings=SETTINGS,
    ) -> dict[str, Any]:
        """Which settings fit ``gpu_mem`` per device and ``host_mem`` per machine, ranked by ``COST_MODEL``.

        ``margin``: fraction of each memory kept free (CUDA context, allocator fragmentation, the
        process itself).  ``ranks_per_host``: ranks sharing one machine's host memory (default min(N, 8)).
        Device "cpu": device and host are one memory, so a setting fits when every rank's whole peak
        (``peak["total"]``) fits ``host_mem`` together; ``gpu_mem`` is not used and may be None.
        """
        if self.device == "cuda" and gpu_mem is None:
            raise ValueError("planner: fit on device 'cuda' needs gpu_mem (bytes per device)")
        if not 0 <= margin < 1:
            raise ValueError(f"planner: margin must be a fraction in [0, 1); got {margin!r}")
        if ranks_per_host is not None and (not isinstance(ranks_per_host, int) or ranks_per_host < 1):
            raise ValueError(f"planner: ranks_per_host must be an int >= 1; got {ranks_per_host!r}")
        per_host = ranks_per_host or min(world_size, 8)
        rows = []
        for r in self.rows(world_size, settings):
            if self.device == "cpu":
                device_ok, host_ok = True, r["peak"]["total"] * per_host <= host_mem * (1 - margin)
            else:
                device_ok = r["peak"]["device"] <= gpu_mem * (1 - margin)
                host_ok = r["peak"]["host"] * per_host <= host_mem * (1 - margin)
            rows.append(
                {
                    **r,
                    "fits": device_ok and host_ok,
                    "device_ok": device_ok,
                    "host_ok": host_ok,
                    "cost": cost(r["stage"], r["offload"], r["offload_params"]),
                }
            )
        ranked = sorted(rows, key=lambda r: (not r["fits"], r["cost"], r["stage"]))
        best = ranked[0] if ranked and ranked[0]["fits"] else None
        return {
            "world_size": world_size,
            "gpu_mem": gpu_mem,
            "host_mem": host_mem,
            "margin": margin,
            "ranks_per_host": per_host,
            "rows": ranked,
            "best": best,
        }


def cost(stage: int, offload: bool, offload_params: bool) -> float:
    """Relative step cost of a setting (``COST_MODEL``)."""
    return (
        COST_MODEL["comm"][stage]
        + COST_MODEL["offload_optimizer"] * offload
        + COST_MODEL["offload_params"] * offload_params
    )


def _result(plan: Planner, s: Setting, theory: dict[str, float], replay: Replay, mem: Memory) -> dict:
    """The result dict; ``at_peak`` breaks down the device peak (CUDA) or the one-memory peak (CPU)."""
    device_peak = mem.peaks["device"][0]
    snapshot = mem.peaks["total" if s.device == "cpu" else "device"][1]
    at = mem.by_category(snapshot, ("device", "host") if s.device == "cpu" else ("device",))
    grads = at.get("grads", 0.0) + at.get("grad_shards", 0.0) + at.get("kept_grads", 0.0)
    transient = {
        k: at.get(k, 0.0)
        for k in ("gathered", "gather_buffers", "reduce_buffers", "allgather_buffers", "collective_temp", "step")
    }
    transient["total"] = sum(transient.values())
    placed = {"device": 0.0, "host": 0.0}
    for cat in ("params", "grads", "optimizer"):
        placed[replay.place("grad_shards" if cat == "grads" and s.stage >= 2 else cat)] += theory[cat]
    return {
        "stage": s.stage,
        "world_size": s.world_size,
        "shard_world": s.shard_world,
        "kept_grads": plan.kept_grad_bytes(s),
        "offload": s.offload,
        "offload_params": s.offload_params,
        "device": s.device,
        "param_dtype": str(plan.config.precision.param_dtype or plan.model_dtype).replace("torch.", ""),
        "params": plan.counts,
        "model_states": theory,
        "placement": placed,
        "activations": {
            "saved": plan.trace.saved_bytes,
            "end_of_forward": plan.trace.forward_bytes,
            "peak": plan.trace.peak_bytes,
            "at_peak": snapshot["activations"],
            "offloaded": plan.trace.offloaded_bytes,
        },
        "at_peak": {
            "phase": snapshot["phase"],
            "params": at.get("params", 0.0),
            "optimizer": at.get("optimizer", 0.0),
            "grads": grads,
            "transient": transient,
            "activations": snapshot["activations"],
        },
        "peak": {
            "device": device_peak,
            "host": mem.peaks["host"][0] + plan.trace.offloaded_bytes,
            "total": mem.peaks["total"][0],
            "phase": snapshot["phase"],
        },
        # rss_glibc: live bytes plus the slack of [Note: glibc slack]
        **({"rss_glibc": mem.peaks["total"][0] + plan.trace.peak_bytes} if s.device == "cpu" else {}),
    }


def estimate(
    model_or_config: Any,
    world_size: int,
    stage: int,
    *,
    param_dtype: torch.dtype | str | None = None,
    offload: bool | str = False,
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
    offload_params: bool = False,
    device: str = "cuda",
    config: ZeroConfig | None = None,
) -> dict[str, Any]:
    """Per-rank memory of one training step; see :class:`Planner` (which reuses one trace for many rows)."""
    plan = Planner(
        model_or_config,
        param_dtype=param_dtype,
        batch=batch,
        seq=seq,
        checkpointing=checkpointing,
        config=config,
        device=device,
    )
    return plan.estimate(world_size, stage, offload=offload, offload_params=offload_params)
