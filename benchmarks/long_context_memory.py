"""Long context: peak memory per rank against sequence length, measured and planned (issue #50).

    python -m benchmarks.long_context_memory                       # seq 1024 2048 4096, K 1 and 2, four variants
    python -m benchmarks.long_context_memory --seqs 2048 --ks 2 --variants checkpointing offload
    python -m benchmarks.long_context_memory --render benchmarks/results/long-context-memory.json

Every row is a fresh set of 2 spawned gloo processes (one thread each) training a random-init float32 Llama
(``MODEL``: 4 layers, hidden 256, 4 heads over 2 key/value heads, vocabulary 4096) at ZeRO stage 3 with AdamW on
one sequence per data-parallel group: K = 1 (two data-parallel ranks, each its own sequence, the model's own loss)
or K = 2 (one sequence split over both ranks: ``zp.SequenceParallelLoader`` and ``zp.sequence_parallel_loss``).
Variants: plain, ``checkpointing`` (every decoder layer), ``offload`` (checkpointing + ``offload_activations="cpu"``)
``tiled`` (checkpointing + ``zp.tiled_lm_loss``, tiles of 256 tokens) and ``offload+tiled`` (both).  Each rank measures as
``benchmarks/planner_accuracy.py`` does: a warm-up step of a tiny model with the same settings, the baseline RSS,
the model built and set up, the kernel's high-water mark reset, ``--steps`` steps, VmHWM - baseline; with the
"exact" allocator (every block of 128 KiB or more its own mapping, [Note: allocator modes] there), so RSS follows
live tensor bytes.  On CUDA (when a device is present) the same rows on NCCL with ``torch.cuda.max_memory_allocated``
above the memory allocated before the model was built, against the planner's device peak.

*predicted* is ``zero_plugin.planner.Planner(..., sequence_parallel=K, checkpointing, offload_activations,
tiled_loss)`` for the same model, sequence, stage and world size (device "cpu": ``peak.total``).  On CPU activation
offload cannot lower the RSS (the host is the device): the report gives what it moved instead (the counters of
``zero_plugin.sequence.offload``, against the planner's ``checkpointed_input_bytes``) and what the planner says it
saves on a CUDA device for the same row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .measure import RssPeak, release_memory
from .planner_accuracy import ALLOCATOR_ENV, _free_port, _rss

__all__ = ["main", "measure", "predict"]

RESULTS = Path(__file__).resolve().parent / "results"
_MIB = 2**20
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=688,
    vocab_size=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
    use_cache=False,
)
VARIANTS = ("plain", "checkpointing", "offload", "tiled", "offload+tiled")
OFFLOADED, TILED = ("offload", "offload+tiled"), ("tiled", "offload+tiled")
TILE = 256
STAGE, WORLD = 3, 2


def _model(tiny: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(MODEL, attn_implementation="sdpa")
    if tiny:
        fields.update(hidden_size=64, num_hidden_layers=1, intermediate_size=128, vocab_size=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**fields)).float().train()


def _config(job: dict):
    import zero_plugin as zp

    return zp.ZeroConfig(
        stage=STAGE,
        sequence_parallel_size=job["k"],
        offload_activations="cpu" if job["variant"] in OFFLOADED else "none",
    )


def _setup(model, job: dict, device: torch.device):
    import zero_plugin as zp

    model = model.to(device)
    if job["variant"] != "plain":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), _config(job))


def _loss(model, ids: torch.Tensor, job: dict) -> torch.Tensor:
    import zero_plugin as zp

    if job["k"] > 1:
        batch = zp.sequence_parallel_batch({"input_ids": ids, "labels": ids}, model)
        labels = batch.pop("shift_labels")
        if job["variant"] in TILED:
            return _tiled(model, batch, labels, sequence_parallel=model)
        return zp.sequence_parallel_loss(model(**batch).logits, labels, model)
    if job["variant"] in TILED:
        return _tiled(model, {"input_ids": ids}, ids, shift=True)
    return model(input_ids=ids, labels=ids).loss


def _tiled(model, batch: dict, labels: torch.Tensor, **options) -> torch.Tensor:
    """The backbone and ``zp.tiled_lm_loss`` inside the model's forward (stage 3 gathers the root unit there:
    docs/long-context.md)."""
    import zero_plugin as zp

    def forward(**kwargs):
        hidden = model.model(**kwargs).last_hidden_state
        return zp.tiled_lm_loss(hidden, model.lm_head, labels, tile_tokens=TILE, **options)

    model.forward = forward
    try:
        return model(**batch)
    finally:
        del model.forward


def _train(model, optimizer, job: dict, vocab: int, steps: int, device: torch.device) -> None:
    rank = torch.distributed.get_rank()
    group = rank // job["k"]  # the ranks of a sequence-parallel group train on the same sequence
    for step in range(steps):
        gen = torch.Generator().manual_seed(group * 10_007 + step)
        ids = torch.randint(0, vocab, (1, job["seq"]), generator=gen).to(device)
        _loss(model, ids, job).backward()
        optimizer.step()
        optimizer.zero_grad()


def _rank_main(rank: int, world: int, port: int, job: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from zero_plugin.sequence.offload import offload_of

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        warm, warm_opt = _setup(_model(tiny=True), job, device)
        _train(warm, warm_opt, dict(job, seq=64), 256, 1, device)
        del warm, warm_opt
        release_memory()
        dist.barrier()
        baseline = torch.cuda.memory_allocated() if cuda else _rss()
        model, optimizer = _setup(_model(), job, device)
        release_memory()
        after_setup = 0 if cuda else _rss() - baseline
        peak = RssPeak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            peak.start()
        t0 = time.perf_counter()
        _train(model, optimizer, job, MODEL["vocab_size"], job["steps"], device)
        wall = time.perf_counter() - t0
        measured = torch.cuda.max_memory_allocated() - baseline if cuda else peak.stop() + after_setup
        offload = offload_of(model)
        record = {
            "rank": rank,
            "peak": measured,
            "method": "torch.cuda.max_memory_allocated" if cuda else RssPeak.method,
            "device": "cuda" if cuda else "cpu",
            "wall_s": wall,
            "offload": None
            if offload is None
            else {k: getattr(offload.stats, k) for k in ("packed_bytes", "host_peak_bytes")},
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(job: dict, out_dir: Path) -> list[dict]:
    """Peak memory above the baseline on each rank of one fresh 2-process run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank*.json"):
        stale.unlink()
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", *ALLOCATOR_ENV["exact"])}
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(ALLOCATOR_ENV["exact"])
    try:
        mp.start_processes(
            _rank_main, args=(WORLD, _free_port(), job, str(out_dir)), nprocs=WORLD, start_method="spawn", join=True
        )
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]


def predict(job: dict, device: str) -> dict:
    """The planner's row for ``job`` on ``device``, and the bytes offload moves per step."""
    from transformers import LlamaConfig

    from zero_plugin.planner import Planner
    from zero_plugin.planner.long_context import checkpointed_input_bytes

    with torch.device("meta"):
        meta = _model()
    variant = job["variant"]
    plan = Planner(
        meta,
        batch=1,
        seq=job["seq"],
        device=device,
        checkpointing=variant != "plain",
        sequence_parallel=job["k"],
        offload_activations=variant in OFFLOADED,
        tiled_loss=TILE if variant in TILED else None,
    )
    row = plan.estimate(WORLD, STAGE)
    moved = checkpointed_input_bytes(
        LlamaConfig(**MODEL), batch=1, seq=job["seq"], sequence_parallel=job["k"], dtype=torch.float32
    )
    return {"peak": row["peak"], "activations": row["activations"], "moved": moved}


def _jobs(args: argparse.Namespace) -> list[dict]:
    return [
        {"seq": seq, "k": k, "variant": variant, "steps": args.steps}
        for seq in args.seqs
        for k in args.ks
        for variant in args.variants
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_context_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--ks", nargs="+", type=int, choices=[1, 2], default=[1, 2])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "long-context-memory.md")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON")
    args = p.parse_args(argv)
    if args.render is not None:
        runs = [json.loads(path.read_text()) for path in args.render]
        data = {
            "runs": [h for r in runs for h in r["runs"]],
            "measurements": [m for r in runs for m in r["measurements"]],
        }
    else:
        data = _run(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    text = render(data)
    args.out.write_text(text)
    print(text)
    return 0


def _run(args: argparse.Namespace) -> dict:
    run = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "load_before": os.getloadavg(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    data: dict = {"runs": [run], "measurements": []}
    scratch = Path(os.environ.get("TMPDIR", "/tmp"), f"long-context-{os.getpid()}")
    for job in _jobs(args):
        t0 = time.perf_counter()
        ranks = measure(job, scratch)
        data["measurements"].append({"job": job, "ranks": ranks})
        device = ranks[0]["device"]
        predicted = predict(job, device)["peak"]["total" if device == "cpu" else "device"]
        print(
            f"[long-context] seq {job['seq']:>6} K={job['k']} {job['variant']:>13}: predicted "
            f"{predicted / _MIB:8.1f} MiB, measured {ranks[0]['peak'] / _MIB:8.1f} MiB "
            f"({predicted / ranks[0]['peak'] - 1:+.1%}) in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    run["load_after"] = os.getloadavg()
    return data


def render(data: dict) -> str:
    rows = sorted(
        data["measurements"], key=lambda m: (m["job"]["seq"], m["job"]["k"], VARIANTS.index(m["job"]["variant"]))
    )
    device = rows[0]["ranks"][0]["device"] if rows else "cpu"
    lines = [
        "# Long context: peak memory per rank against sequence length",
        "",
        *[
            f"- {r['started']}: `python -m benchmarks.long_context_memory {' '.join(r['argv'])}` on {r['device']}, "
            f"load average before {' / '.join(f'{x:.1f}' for x in r['load_before'])}"
            for r in data["runs"]
        ],
        "",
        _ABOUT,
        "",
        "| seq | K | tokens per rank | variant | measured MiB, rank 0 / 1 | predicted MiB | predicted / measured | "
        "offload moved MiB per step (counted / planned) | planned on CUDA: device MiB, host MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for m in rows:
        job, ranks = m["job"], m["ranks"]
        ratio = _ratio(job, ranks, device)
        errors.append(ratio - 1)
        cuda = predict(job, "cuda")
        moved = "-"
        if ranks[0]["offload"] is not None:
            counted = ranks[0]["offload"]["packed_bytes"] / job["steps"]
            moved = f"{counted / _MIB:.2f} / {cuda['moved'] / _MIB:.2f}"
        lines.append(
            f"| {job['seq']} | {job['k']} | {-(-job['seq'] // job['k'])} | {job['variant']} | "
            f"{ranks[0]['peak'] / _MIB:.1f} / {ranks[1]['peak'] / _MIB:.1f} | "
            f"{_predicted(job, device) / _MIB:.1f} | {ratio:.3f} | {moved} | "
            f"{cuda['peak']['device'] / _MIB:.1f}, {cuda['peak']['host'] / _MIB:.1f} |"
        )
    if errors:
        worst = max(errors, key=abs)
        lines += [
            "",
            f"{len(errors)} rows; predicted / measured - 1: worst {worst:+.1%}, mean |error| "
            f"{sum(abs(e) for e in errors) / len(errors):.1%} (done-when of issue #50: within 10%).",
            "",
            _FINDINGS,
        ]
    return "\n".join(lines) + "\n"


def _predicted(job: dict, device: str) -> float:
    return predict(job, device)["peak"]["total" if device == "cpu" else "device"]


def _ratio(job: dict, ranks: list[dict], device: str) -> float:
    return _predicted(job, device) / ranks[0]["peak"]


_ABOUT = """\
Each row: 2 fresh gloo processes (one thread each), the float32 Llama of `MODEL` in the script (4 layers, hidden
256, 4 heads / 2 key/value heads, intermediate 688, vocabulary 4096, untied head), ZeRO stage 3, AdamW, one
sequence per data-parallel group, 2 steps; K = 1: two data-parallel ranks, the model's own loss; K = 2: one sequence
over both ranks (`zp.SequenceParallelLoader`, `zp.sequence_parallel_loss`). *measured*: the peak RSS increase above
the RSS before the model was built (VmHWM, exact allocator: `MALLOC_MMAP_THRESHOLD_=131072`), model states
included. *predicted*: `zero_plugin.planner.Planner(..., sequence_parallel=K, checkpointing=..., offload_activations=...,
tiled_loss=...)` on device "cpu", `peak.total`, recomputed when this file is rendered. Variants: plain;
checkpointing (every decoder layer, non-reentrant); offload (checkpointing + `offload_activations="cpu"`); tiled
(checkpointing + `zp.tiled_lm_loss`, tiles of 256 tokens); offload+tiled (both). On CPU the offload rows cannot be lower than the
checkpointing rows (device and host are one memory: the offload keeps the tensors where they are); the *moved*
column is what it counted per step against the planner's `checkpointed_input_bytes`, and the last column what the
planner gives the same row on a CUDA device (device peak; host: the parked inputs plus the host's model states)."""

_FINDINGS = """\
What the rows show (2026-12-07, the rows above):
- The planner is under the measured peak in every row, by 0.2-1.1% for plain, checkpointing and offload except
  K = 2 at 1024 tokens with checkpointing (6.9-7.6%, 4-5 MiB: a fixed amount the trace misses at that size; from
  2048 tokens on those rows are within 1.1%), and by 1.2-4.8% for the tiled loss (up to 7.5 MiB, growing with the
  tokens per rank to about 4096 and then flat: not attributed yet).
- K = 2 halves the activations per rank: at 8192 tokens with checkpointing 255.7 MiB per rank against 255.5 MiB for
  K = 1 at half the tokens (4096), and plain 572 against 556.
- Offload on CPU: the RSS of the offload rows equals the checkpointing rows (within 0.5 MiB; nothing is copied),
  and its counters moved exactly `checkpointed_input_bytes` per step (4 layers x tokens per rank x 256 x 4 bytes).
- The CUDA column is the planner's, not measured (no GPU here): with offload the device keeps one layer input of
  four, so the plain-loss rows drop by three inputs (4096 tokens, K = 1: 254.7 -> 242.7 MiB); with the tiled loss
  the planned device peak is 1-3 MiB *higher* with offload than without (the inputs brought back for the
  recompute land at a point of the replay where more gradient and gather buffers are alive): at this size the
  parked inputs are a small share of the peak, which the loss and the model states dominate."""

if __name__ == "__main__":
    sys.exit(main())
