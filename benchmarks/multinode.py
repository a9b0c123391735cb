"""Bytes per step per link with the ranks standing for nodes: N=4 as 2 "nodes" × 2 ranks (issue #22).

    python -m benchmarks.multinode --size medium

Each variant runs in its own 4-rank gloo spawn (a variant that fails or hangs, as DeepSpeed's ZeRO++
switches may on CPU, cannot take the others down; its error is recorded), all in one invocation.  Per
rank and timed step it counts the logical bytes of every collective by the ranks of the group it ran
on, and splits them into bytes that stay inside a node (ranks {0,1}, {2,3}) and bytes that cross
nodes by one rule for every variant ([Note: link attribution] in ``links.py``).  Step time is the
slowest rank's step, median over the timed steps, as a ratio to tuned DDP (``ddp``) of the same
invocation.  Writes ``results/multinode.md`` and ``.json`` (raw per-rank records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .compare import _free_port, _load
from .links import link_bytes
from .measure import release_memory
from .models import SIZES, build_model, make_batch
from .runner import RunConfig, _train
from .variants import SkipVariant, make_variant

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT = (
    "ddp",
    "zp3",
    "zp3_shard2",
    "zp3_hpz",
    "zp3_qwz_qgz",
    "zp3_all",
    "fsdp2",
    "fsdp2_hsdp",
    "ds3",
    "ds3_hpz",
    "ds3_qwz",
    "ds3_qgz",
    "ds3_zeropp",
)


def _worker(rank: int, cfg: RunConfig, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.port), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir, f"{name}.rank{rank}.json")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
        rec = _measure(name, cfg, rank)
    except SkipVariant as exc:
        rec = {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded verbatim in the report
        rec = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps({"rank": rank, **rec}))
    sys.stdout.flush()
    os._exit(0)  # a failed variant may leave collectives pending; do not wait for them


def _measure(name: str, cfg: RunConfig, rank: int) -> dict:
    vocab = SIZES[cfg.size].vocab
    batches = [make_batch(vocab, cfg.batch, cfg.seq, cfg.seed, rank, s) for s in range(cfg.warmup + cfg.steps)]
    release_memory()
    variant = make_variant(name, build_model(cfg.size, cfg.seed), cfg.lr, cfg.batch)
    rec = _train(variant, batches, cfg, None, None)
    groups = variant.comm_by_group()
    rec["by_group"] = [[list(ranks), nbytes / cfg.steps] for ranks, nbytes in groups.items()]
    rec.pop("state", None)
    return rec


def _spawn(name: str, cfg: RunConfig, timeout_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, cfg, name)) for r in range(cfg.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    recs = []
    for r in range(cfg.world_size):
        path = Path(cfg.out_dir, f"{name}.rank{r}.json")
        recs.append(
            json.loads(path.read_text()) if path.exists() else {"rank": r, "error": f"no result in {timeout_s:.0f} s"}
        )
    return recs


def summarise(name: str, recs: list[dict], node_size: int) -> dict:
    """Per rank per timed step, averaged over the ranks: logical / intra-node / inter-node bytes; step time."""
    errors = [r["error"] for r in recs if "error" in r and not r["error"].startswith("no result")]
    if errors or any("error" in r for r in recs):
        return {"variant": name, "error": errors[0] if errors else recs[0]["error"]}
    if any("skipped" in r for r in recs):
        return {"variant": name, "error": next(r["skipped"] for r in recs if "skipped" in r)}
    links = [link_bytes({tuple(g): b for g, b in r["by_group"]}, node_size) for r in recs]
    mean = {k: sum(lk[k] for lk in links) / len(links) for k in links[0]}
    steps = zip(*(r["times"]["total"] for r in recs))
    return {"variant": name, **mean, "step_s": statistics.median(max(s) for s in steps), "loss": recs[0]["loss_last"]}


LABELS = {
    "ddp": ("DDP (tuned)", "reference"),
    "zp3": ("zero_plugin ZeRO-3", "plain, over all 4"),
    "zp3_shard2": ("zero_plugin ZeRO-3", "hierarchical `shard_group_size=2`"),
    "zp3_hpz": ("zero_plugin ZeRO++", "hpZ `secondary_shard_size=2`"),
    "zp3_qwz_qgz": ("zero_plugin ZeRO++", "qwZ + qgZ `quantized_weights`, `quantized_gradients`"),
    "zp3_all": ("zero_plugin ZeRO++", "hpZ + qwZ + qgZ"),
    "fsdp2": ("FSDP2", "`fully_shard`, 1-D mesh of 4"),
    "fsdp2_hsdp": ("FSDP2 HSDP", "`fully_shard(mesh=(2 replicate, 2 shard))`"),
    "ds3": ("DeepSpeed ZeRO-3", "defaults"),
    "ds3_hpz": ("DeepSpeed ZeRO++", "hpZ `zero_hpz_partition_size: 2`"),
    "ds3_qwz": ("DeepSpeed ZeRO++", "qwZ `zero_quantized_weights: true`"),
    "ds3_qgz": ("DeepSpeed ZeRO++", "qgZ `zero_quantized_gradients: true`"),
    "ds3_zeropp": ("DeepSpeed ZeRO++", "hpZ + qwZ + qgZ"),
}


def markdown(rows: list[dict], header: dict, psi: int) -> str:
    mib = 2**20
    base = next((r for r in rows if r["variant"] == "zp3" and "error" not in r), None)
    ddp = next((r for r in rows if r["variant"] == "ddp" and "error" not in r), None)
    lines = ["# Bytes per step per link: N=4 as 2 nodes × 2 ranks", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| system | variant | logical MiB | intra-node MiB | inter-node MiB | inter / plain ZeRO-3 | step / DDP "
              "| logical MiB on node-spanning groups |"]  # fmt: skip
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        system, what = LABELS.get(r["variant"], (r["variant"], ""))
        if "error" in r:
            lines.append(f"| {system} | {what} | failed: {r['error'][:400].replace('|', '/')} |  |  |  |  |  |")
            continue
        rel = f"{r['inter'] / base['inter']:.2f}" if base and base["inter"] else "–"
        step = f"{r['step_s'] / ddp['step_s']:.2f}" if ddp else "–"
        lines.append(
            f"| {system} | {what} | {r['logical'] / mib:.0f} | {r['intra'] / mib:.0f} | {r['inter'] / mib:.0f} "
            f"| {rel} | {step} | {r['spanning'] / mib:.0f} |"
        )
    lines += ["", f"Ψ = {psi:,} parameters (fp32: {4 * psi / mib:.0f} MiB)."]
    return "\n".join(lines) + "\n"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multinode", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="medium")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--timeout-s", type=float, default=900, help="per variant; a hung spawn is killed and recorded")
    p.add_argument("--out", type=Path, default=RESULTS / "multinode.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world, node = 4, 2
    rows, raw = [], {}
    load0, t0 = _load(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zp-multinode-") as tmp:
        for name in dict.fromkeys(args.variants):
            cfg = RunConfig(args.size, world, (name,), args.steps, args.warmup, 1, args.batch, args.seq, 0, 1e-4,
                            1, _free_port(), tmp, False)  # fmt: skip
            recs = _spawn(name, cfg, args.timeout_s)
            raw[name] = recs
            rows.append(summarise(name, recs, node))
            print(f"[multinode] {rows[-1]}", flush=True)
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "command": "python -m benchmarks.multinode " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": asdict(cfg) | {"variants": list(raw), "port": None, "out_dir": None},
        "machine": f"{os.cpu_count()} cores, gloo on loopback, 1 torch thread per rank, 4 ranks as 2 nodes × 2",
        "wall time": f"{time.perf_counter() - t0:.0f} s",
        "load average (1/5/15 min) before / after": f"{load0} / {_load()}",
    }
    psi = sum(p.numel() for p in build_model(args.size, 0).parameters())
    text = markdown(rows, header, psi)
    old = args.out.read_text() if args.out.exists() else ""
    if "\n## Reading" in old:  # hand-written; kept across reruns
        text += old[old.index("\n## Reading") :]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows, "raw": raw}))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
