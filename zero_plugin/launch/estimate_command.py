"""``zero-plugin estimate``: memory per rank by stage and offload for a model or a parameter count, which
settings fit (``--fit``), communication per link (``--nodes`` / ``--gpus-per-node`` / ``--accum``) and a plot
against world size.  Everything it prints comes from ``zero_plugin.planner``.

Not to be confused with ``launch/estimate.py``: what ``zero-plugin launch`` prints before it starts the
processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .arg_types import DTYPES, GIB, parse_bytes, parse_count, parse_latency, parse_rate

__all__ = ["add_estimate"]

_PLOT_WORLD_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _settings(args: argparse.Namespace, fit: bool) -> list[tuple[int, bool, bool]]:
    """Rows: stages 0-3 without and 1-3 with optimizer offload (``--offload`` narrows), plus
    parameter offload at stage 3 with ``--offload-params`` (always considered by ``--fit``)."""
    from ..planner import SETTINGS

    rows = [s for s in SETTINGS if not s[2]]
    if args.offload != "both":
        rows = [s for s in rows if s[1] == (args.offload == "cpu")]
    if args.offload_params or fit:
        rows += [(3, args.offload != "none", True)] + ([(3, False, True)] if fit and args.offload == "both" else [])
    return rows


def _planner(args: argparse.Namespace):
    from ..config import ZeroConfig
    from ..planner import Planner

    if args.params is not None and (args.batch is not None or args.checkpointing or _long_context(args)):
        raise ValueError(
            "--batch/--seq/--checkpointing and the long-context options need --model: activations come from "
            "tracing the model"
        )
    if args.offload_activations and not args.checkpointing:
        raise ValueError("--offload-activations moves the checkpointed layers' inputs: add --checkpointing")
    if args.world_size % args.sequence_parallel_size:
        raise ValueError(
            f"--sequence-parallel-size {args.sequence_parallel_size} must divide the world size {args.world_size}"
        )
    if args.device_memory is not None and args.batch is None:
        args.batch, args.seq = 1, args.seq or 4096
    config = ZeroConfig(
        bucket_size_mb=args.bucket_size_mb,
        prefetch_depth=args.prefetch_depth,
        shard_group_size=args.shard_group_size,
        accumulate_full_grads=args.accumulate_full_grads,
    )
    if args.nodes is not None or args.gpus_per_node is not None:
        nodes, per_node = args.nodes or 1, args.gpus_per_node or 8
        if args.world_size_given and args.world_size != nodes * per_node:
            raise ValueError(
                f"--world-size {args.world_size} is not --nodes x --gpus-per-node = {nodes} x {per_node}; give one"
            )
        args.world_size, args.gpus_per_node = nodes * per_node, per_node
    return Planner(
        args.params if args.params is not None else args.model,
        param_dtype=DTYPES[args.dtype],
        batch=args.batch,
        seq=args.seq,
        checkpointing=args.checkpointing,
        config=config,
        device=args.device,
        **_long_options(args),
    )


def _long_context(args: argparse.Namespace) -> bool:
    return (
        args.sequence_parallel_size > 1
        or args.offload_activations
        or args.tiled_loss is not None
        or args.device_memory is not None
    )


def _long_options(args: argparse.Namespace) -> dict:
    return {
        "sequence_parallel": args.sequence_parallel_size,
        "offload_activations": args.offload_activations,
        "tiled_loss": args.tiled_loss,
    }


def _long_context_lines(plan, args: argparse.Namespace, settings) -> list[str]:
    """``--device-memory``: the longest sequence per row ([Note: long-context trace] in planner/long_context.py)."""
    from ..planner.long_context import longest_sequence

    memory = args.device_memory * (1 - args.margin)
    options = dict(
        batch=args.batch,
        checkpointing=args.checkpointing,
        config=plan.config,
        device=args.device,
        param_dtype=DTYPES[args.dtype],
        **_long_options(args),
    )
    traces: dict = {}
    rows = []
    for stage, offload, offload_params in settings:
        found = longest_sequence(
            plan.model,
            memory,
            world_size=args.world_size,
            stage=stage,
            offload=offload,
            offload_params=offload_params,
            traces=traces,
            **options,
        )
        rows.append((stage, offload, offload_params, found))
    lo, hi = sorted(traces)[-2:] if len(traces) > 1 else (None, None)
    what = "per device" if args.device == "cuda" else "per rank (device cpu: the whole peak)"
    lines = [
        f"longest sequence in {args.device_memory / GIB:.2f} GiB {what}, {args.margin:.0%} kept free: batch "
        f"{args.batch}, {_long_setting(args)}",
        f"{'stage':>5} {'offload':>12} | {'max seq':>10} {'per rank':>9} | {'peak GiB':>8} {'acts GiB':>8} "
        f"{'host GiB':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for stage, offload, offload_params, found in rows:
        row = found["row"]
        name = _offload_name({"offload": offload, "offload_params": offload_params})
        if not found["seq"]:
            lines.append(f"{stage:>5} {name:>12} | {'none fits':>10}")
            continue
        k = args.sequence_parallel_size
        lines.append(
            f"{stage:>5} {name:>12} | {found['seq']:>10,} {-(-found['seq'] // k):>9,} | "
            f"{found['peak'] / GIB:>8.2f} {row['at_peak']['activations'] / GIB:>8.2f} {row['peak']['host'] / GIB:>8.2f}"
        )
    if lo is not None:
        a, b = traces[lo].trace, traces[hi].trace
        per = (b.peak_bytes - a.peak_bytes) / (hi - lo)
        off = (b.offloaded_bytes - a.offloaded_bytes) / (hi - lo)
        lines.append(
            f"activations per token of the sequence, per rank: peak {per / 1024:.1f} KiB on the device"
            + (f", {off / 1024:.1f} KiB parked on the host" if off else "")
            + f" (traces at {lo:,} and {hi:,} tokens; zero_plugin/planner/long_context.py)"
        )
    return lines


def _long_setting(args: argparse.Namespace) -> str:
    parts = [f"sequence parallel K={args.sequence_parallel_size}"]
    parts.append("checkpointing" if args.checkpointing else "no checkpointing")
    if args.offload_activations:
        parts.append("activations offloaded")
    parts.append(f"tiled loss ({args.tiled_loss} tokens per tile)" if args.tiled_loss else "whole logits")
    return ", ".join(parts)


def _unit(rows: list[dict]) -> tuple[str, float]:
    """GiB, or MiB when every peak is under 1 GiB."""
    big = max((max(r["peak"]["device"], r["peak"]["host"]) for r in rows), default=0)
    return ("GiB", GIB) if big >= GIB else ("MiB", 2**20)


def _offload_name(row: dict) -> str:
    return {(False, False): "-", (True, False): "optim", (True, True): "optim+params", (False, True): "params"}[
        (row["offload"], row["offload_params"])
    ]


def _header(plan, args: argparse.Namespace) -> list[str]:
    c = plan.counts
    what = args.model if args.model is not None else "a parameter count (no structure: stage 3 assumes 32 blocks)"
    lines = [
        f"model {what}: {c['total'] / 1e9:.3f}B parameters ({c['trainable'] / 1e9:.3f}B trainable); "
        f"{args.dtype} parameters{', fp32 master' if args.dtype != 'fp32' else ''}, AdamW; "
        f"world size {args.world_size}; device {args.device}"
    ]
    if args.batch is not None:
        t = plan.trace
        k = args.sequence_parallel_size
        where = "per rank" if k == 1 else f"over a group of {k} ranks ({-(-args.seq // k)} tokens per rank)"
        lines.append(
            f"activations for batch {args.batch} x {args.seq} {where}"
            f"{' with checkpointing' if args.checkpointing else ''}: saved for backward "
            f"{t.saved_bytes / GIB:.2f} GiB, peak during forward+backward {t.peak_bytes / GIB:.2f} GiB"
            + (f", offloaded to the host {t.offloaded_bytes / GIB:.2f} GiB" if t.offloaded_bytes else "")
        )
        if _long_context(args):
            lines.append(f"long context: {_long_setting(args)}")
    else:
        lines.append("activations: not estimated (give --model with --batch and --seq)")
    k = plan.config.comm.shard_group_size
    if k is not None and k != args.world_size:
        lines.append(
            f"hierarchical sharding: shard groups of {k} ranks, model states sharded over {k} and replicated "
            f"{args.world_size // k} times (stages 1-3)"
        )
    if plan.config.stage3.accumulate_full_grads:
        kept = plan.kept_grad_bytes(plan.setting(args.world_size, 3))
        lines.append(
            f"accumulate_full_grads: stage 3 keeps the full gradients under zp.no_sync, +{kept / GIB:.2f} GiB "
            "per rank on the device (in grads and the peak)"
        )
    return lines


def _table(rows: list[dict]) -> list[str]:
    name, scale = _unit(rows)
    head = (
        f"{'stage':>5} {'offload':>12} | {'params':>8} {'grads':>8} {'optim':>8} {'states':>8} | "
        f"{'grads':>8} {'buffers':>8} {'acts':>8} | {'device':>8} {'host':>8}  phase"
    )
    lines = [
        f"{'':>18} | {f'model states, {name} (ZeRO paper)':^35} | {f'at the peak, {name}':^26} | "
        f"{f'peak per rank, {name}':^17}",
        head,
        "-" * len(head),
    ]
    for r in rows:
        t, at = r["model_states"], r["at_peak"]
        cells = [
            t["params"],
            t["grads"],
            t["optimizer"],
            t["total"],
            at["grads"],
            at["transient"]["total"],
            at["activations"],
            r["peak"]["device"],
            r["peak"]["host"],
        ]
        v = [f"{c / scale:8.2f}" for c in cells]
        lines.append(
            f"{r['stage']:>5} {_offload_name(r):>12} | {' '.join(v[:4])} | {' '.join(v[4:7])} | "
            f"{' '.join(v[7:])}  {r['peak']['phase']}"
        )
    lines.append(
        "peak = parameters + optimizer state + the gradients, buffers (gathered units, collective "
        "buffers, optimizer temporaries) and activations alive at that moment (live tensor bytes)"
    )
    if rows and rows[0]["device"] == "cpu":
        slack = rows[0]["activations"]["peak"]
        lines.append(
            f"cpu: device and host are one memory (per rank: device + host); glibc's default malloc keeps "
            f"freed blocks: expect about {slack / scale:.2f} {name} (one activation peak) more RSS, or run "
            "with MALLOC_MMAP_THRESHOLD_=131072 (see zero_plugin/planner/plan.py, [Note: glibc slack])"
        )
    return lines


def _fit_lines(result: dict) -> list[str]:
    from ..planner import COST_MODEL

    one_memory = result["gpu_mem"] is None  # device "cpu": a rank's device bytes are host memory too
    device = (
        "no GPU (device and host are one memory)" if one_memory else f"{result['gpu_mem'] / GIB:.2f} GiB per device"
    )
    lines = [
        f"fit: {result['world_size']} ranks, {device}, "
        f"{result['host_mem'] / GIB:.2f} GiB host per machine shared by {result['ranks_per_host']} ranks, "
        f"{result['margin']:.0%} kept free",
        f"{'stage':>5} {'offload':>12} | {'device GiB':>10} {'host GiB/machine':>16} | {'fits':>4} {'cost':>5}",
    ]
    for r in result["rows"]:
        host = r["peak"]["total" if one_memory else "host"] * result["ranks_per_host"]
        lines.append(
            f"{r['stage']:>5} {_offload_name(r):>12} | {r['peak']['device'] / GIB:>10.2f} "
            f"{host / GIB:>16.2f} | {'yes' if r['fits'] else 'no':>4} {r['cost']:>5.1f}"
        )
    lines.append(
        f"cost: per-step communication in Ψ ({COST_MODEL['comm'][0]:g} for stages 0-2, "
        f"{COST_MODEL['comm'][3]:g} for stage 3) + {COST_MODEL['offload_optimizer']:g} for optimizer "
        f"offload + {COST_MODEL['offload_params']:g} for parameter offload; ties go to the lower stage"
    )
    best = result["best"]
    if best is None:
        lines.append("nothing fits: try --checkpointing, a smaller --batch, more ranks or --offload-params")
    else:
        extra = {
            (True, False): ', offload_optimizer="cpu"',
            (True, True): ', offload_optimizer="cpu", offload_params=True',
            (False, True): ", offload_params=True",
        }.get((best["offload"], best["offload_params"]), "")
        if best["shard_world"] != best["world_size"]:
            extra += f", shard_group_size={best['shard_world']}"
        if best["kept_grads"]:
            extra += ", accumulate_full_grads=True"
        lines.append(
            f"best: ZeroConfig(stage={best['stage']}{extra}): {best['peak']['device'] / GIB:.2f} GiB "
            f"per device, cost {best['cost']:g}"
        )
    return lines


def _topology(args: argparse.Namespace):
    from ..planner import DEFAULT_INTER, DEFAULT_INTRA, Link, Topology

    def link(default: Link, bandwidth: float | None, latency: float | None) -> Link:
        return Link(
            default.bandwidth if bandwidth is None else bandwidth, default.latency if latency is None else latency
        )

    return Topology(
        nodes=args.nodes or 1,
        gpus_per_node=args.world_size // (args.nodes or 1),
        intra=link(DEFAULT_INTRA, args.intra_bw, args.intra_latency),
        inter=link(DEFAULT_INTER, args.inter_bw, args.inter_latency),
    )


def _comm_lines(plan, args: argparse.Namespace) -> list[str]:
    from ..planner import comm_rows

    topo = _topology(args)
    rows = comm_rows(plan, topo, accum=args.accum)
    gb = 1e9
    lines = [
        f"communication per step: {topo.nodes} node(s) x {topo.gpus_per_node} GPUs = {topo.world_size} ranks, "
        f"{args.accum} micro-batch(es) per optimizer step; NVLink {topo.intra.bandwidth / gb:g} GB/s, "
        f"{topo.intra.latency * 1e6:g} us; network {topo.inter.bandwidth / gb:g} GB/s "
        f"({topo.inter.bandwidth * 8 / gb:g} Gb/s) per GPU, {topo.inter.latency * 1e6:g} us",
        f"{'stage':>5} {'option':<16} | {'intra GB':>9} {'inter GB':>9} | {'comm ms':>9} | {'states GiB':>10}  status",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(
            f"{r['stage']:>5} {r['name']:<16} | {r['bytes']['intra'] / gb:>9.2f} {r['bytes']['inter'] / gb:>9.2f} | "
            f"{r['time'] * 1e3:>9.2f} | {r['model_states'] / GIB:>10.2f}  "
            f"{'available' if r['implemented'] else 'planned'}"
        )
    if args.accum > 1:
        kept = plan.counts["trainable"] * plan.reduce_bytes(plan.config)
        lines.append(
            f"accum rows keep the full gradients of every unit between micro-batches: +{kept / GIB:.2f} GiB per rank "
            f"(trainable parameters x {plan.reduce_bytes(plan.config)} bytes of the reduce dtype)"
        )
    lines += [
        "bytes: logical bytes per rank per step (zp.comm_stats' count); intra: collectives inside a node, inter: "
        "collectives across nodes; comm ms: alpha-beta ring model, nothing overlapped (zero_plugin/planner/"
        "comm_time.py, [Note: alpha-beta model]); states: parameters + gradients + optimizer state per rank",
        "options: hier = shard group of one node (HSDP/MiCS); hpZ = secondary parameter shard inside the node for "
        "backward (secondary_shard_size); qwZ = int8 weight all-gather (quantized_weights); qgZ = int8 gradient "
        "all-to-all (quantized_gradients) (ZeRO++); accum = "
        "ZeroConfig(accumulate_full_grads=True) under zp.no_sync (+ full gradients of every unit)",
    ]
    return lines


def _plot(plan, args: argparse.Namespace, settings) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'zero-plugin[bench]')"
        ) from None
    fig, ax = plt.subplots(figsize=(8, 5))
    k = plan.config.comm.shard_group_size  # world sizes that --shard-group-size divides
    sizes = [n for n in _PLOT_WORLD_SIZES if k is None or n % k == 0]
    for stage, offload, offload_params in settings:
        ys = [
            plan.estimate(n, stage, offload=offload, offload_params=offload_params)["peak"]["device"] / GIB
            for n in sizes
        ]
        label = f"stage {stage}" + {
            (True, False): " + offload",
            (True, True): " + offload + params",
            (False, True): " + params offload",
        }.get((offload, offload_params), "")
        ax.plot(sizes, ys, marker="o", linestyle="--" if offload else "-", label=label)
    if args.gpu_mem:
        ax.axhline(args.gpu_mem / GIB, color="grey", linewidth=1, label="--gpu-mem")
    ax.set_xscale("log", base=2)
    ax.set_xticks(_PLOT_WORLD_SIZES, [str(n) for n in _PLOT_WORLD_SIZES])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("peak device memory per rank (GiB)")
    ax.set_title(
        f"{args.model or f'{args.params:.3g} parameters'}, {args.dtype}"
        + (f", batch {args.batch} x {args.seq}" if args.batch else "")
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot)
    plt.close(fig)


def _partition_line(plan, world_size: int) -> str:
    """What the parameter partition adds to the rows above (stage 3's numbers; stages 1-2 send less)."""
    cost = plan.parameter_partition(world_size, 3)
    gib = 2**30
    return (
        f"optimizer_partition='parameters' (Adafactor, Muon, LAMB, 8-bit bitsandbytes: docs/optimizers.md): the busiest "
        f"owner holds {cost['state_share']:.1%} of the optimizer state (the rows count {1 / world_size:.1%}), plus "
        f"{cost['step_bytes'] / gib:.2f} GiB of whole masters and gradients during the step; per step a rank sends "
        f"up to {cost['exchange_bytes'] / gib:.2f} GiB more (regions to owners and back, point to point)"
    )


def _estimate(args: argparse.Namespace) -> int:
    args.world_size_given = args.world_size is not None
    args.world_size = 8 if args.world_size is None else args.world_size
    if args.fit and args.gpu_mem is None and args.device == "cuda":
        print(
            "zero-plugin estimate: error: --fit needs --gpu-mem (e.g. --gpu-mem 24GiB), or --device cpu",
            file=sys.stderr,
        )
        return 2
    try:
        plan = _planner(args)
        settings = _settings(args, fit=args.fit)
        rows = plan.rows(args.world_size, settings)
        print("\n".join(_header(plan, args) + [""] + _table(rows)))
        if args.nodes is not None or args.gpus_per_node is not None or args.accum != 1:
            print("\n" + "\n".join(_comm_lines(plan, args)))
        if args.optimizer_partition == "parameters":
            print("\n" + _partition_line(plan, args.world_size))
        status = 0
        if args.device_memory is not None:
            print("\n" + "\n".join(_long_context_lines(plan, args, settings)))
        if args.fit:
            gpu_mem = args.gpu_mem if args.device == "cuda" else None
            result = plan.fit(
                args.world_size,
                gpu_mem,
                args.host_mem,
                margin=args.margin,
                ranks_per_host=args.ranks_per_host or args.gpus_per_node,
                settings=settings,
            )
            print("\n" + "\n".join(_fit_lines(result)))
            status = 0 if result["best"] is not None else 1
        if args.plot is not None:
            _plot(plan, args, settings)
            print(f"\nplot written to {args.plot}")
        return status
    except ValueError as exc:
        print(f"zero-plugin estimate: error: {exc}", file=sys.stderr)
        return 2


def add_estimate(sub) -> None:
    est = sub.add_parser(
        "estimate",
        help="memory per rank by stage and offload; --fit: which settings fit",
        description="Per-rank device and host memory of one training step (model states, our "
        "buffers, activations) for stages 0-3 with and without offload.",
    )
    src = est.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=parse_count, help="parameter count, e.g. 7B (model states and buffers only)")
    src.add_argument(
        "--model",
        help="built-in name (tiny-llama, llama-1b, llama-7b, llama-13b), a transformers "
        "config file or folder, or a Hub id (org/name)",
    )
    est.add_argument("--world-size", type=int, default=None, help="ranks (default 8, or --nodes x --gpus-per-node)")
    net = est.add_argument_group(
        "communication",
        "with --nodes, --gpus-per-node or --accum: bytes per step on each link and an alpha-beta estimate of the "
        "communication time, per stage and option (plain, hierarchical sharding, hpZ, qwZ, qgZ, stage-3 "
        "accumulation); defaults model HGX H100/H200 nodes: NVLink 450GB/s per direction, one 400Gb/s NIC "
        "per GPU (use --inter-bw 100Gb/s for a 100G network)",
    )
    net.add_argument("--nodes", type=int, help="machines (default 1)")
    net.add_argument("--gpus-per-node", type=int, help="ranks per machine (default 8)")
    net.add_argument("--intra-bw", type=parse_rate, help="NVLink bandwidth per GPU and direction (default 450GB/s)")
    net.add_argument(
        "--inter-bw",
        type=parse_rate,
        help="network bandwidth per GPU and direction (default 400Gb/s = 50GB/s: one NDR NIC per GPU)",
    )
    net.add_argument("--intra-latency", type=parse_latency, help="per ring step (default 3us)")
    net.add_argument("--inter-latency", type=parse_latency, help="per ring step (default 10us)")
    net.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    est.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="parameter dtype in forward/backward; bf16/fp16 keep fp32 masters (default bf16)",
    )
    est.add_argument(
        "--offload",
        choices=["none", "cpu", "both"],
        default="both",
        help="rows without (none) or with (cpu) optimizer offload, or both (default)",
    )
    est.add_argument("--offload-params", action="store_true", help="add stage 3 with parameters offloaded")
    est.add_argument(
        "--optimizer-partition",
        choices=["elements", "parameters"],
        default="elements",
        help="parameters: also say what stepping whole parameters on owners costs (shape-aware optimizers)",
    )
    est.add_argument("--batch", type=int, help="sequences per rank (with --seq: activations)")
    est.add_argument("--seq", "--seq-len", type=int, help="tokens per sequence")
    est.add_argument(
        "--checkpointing",
        "--activation-checkpointing",
        action="store_true",
        help="activation checkpointing of every block",
    )
    long = est.add_argument_group(
        "long context",
        "Ulysses sequence parallelism, activation offload and the tiled loss (docs/long-context.md); with "
        "--device-memory: the longest sequence that fits, per row",
    )
    long.add_argument(
        "--sequence-parallel-size",
        type=int,
        default=1,
        help="ZeroConfig.sequence_parallel_size K: each rank holds seq/K tokens of every sequence (default 1)",
    )
    long.add_argument(
        "--offload-activations",
        action="store_true",
        help="ZeroConfig.offload_activations='cpu': checkpointed layers' inputs in host memory (needs --checkpointing)",
    )
    long.add_argument(
        "--tiled-loss",
        type=int,
        nargs="?",
        const=1024,
        default=None,
        metavar="TOKENS",
        help="the loss through zp.tiled_lm_loss, tiles of TOKENS (default 1024) instead of whole logits",
    )
    long.add_argument(
        "--device-memory",
        type=parse_bytes,
        help="memory per device, e.g. 80GiB: print the longest sequence that fits at each stage (batch 1 unless "
        "--batch; --device cpu: the whole per-rank peak)",
    )
    est.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="what the ranks compute on")
    est.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        help="ZeroConfig.shard_group_size: hierarchical sharding, states sharded over K ranks (a node: K=G)",
    )
    est.add_argument(
        "--accumulate-full-grads",
        action="store_true",
        help="ZeroConfig.accumulate_full_grads: stage 3 keeps full gradients under no_sync (+memory)",
    )
    est.add_argument("--bucket-size-mb", type=float, default=25.0, help="ZeroConfig.bucket_size_mb (default 25)")
    est.add_argument("--prefetch-depth", type=int, default=1, help="ZeroConfig.prefetch_depth (default 1)")
    est.add_argument(
        "--fit",
        action="store_true",
        help="which settings fit --gpu-mem/--host-mem (--device cpu: "
        "--host-mem only), and the fastest (exit 1 when none fits)",
    )
    est.add_argument("--gpu-mem", type=parse_bytes, help="memory per device, e.g. 24GiB (ignored with --device cpu)")
    est.add_argument(
        "--host-mem", type=parse_bytes, default=parse_bytes("128GiB"), help="host memory per machine (default 128GiB)"
    )
    est.add_argument("--ranks-per-host", type=int, default=None, help="ranks sharing a machine (default min(N, 8))")
    est.add_argument("--margin", type=float, default=0.1, help="fraction of each memory kept free (default 0.1)")
    est.add_argument("--plot", type=Path, help="draw peak device memory per rank against world size 1..64 (PNG)")
    est.set_defaults(run=_estimate)
