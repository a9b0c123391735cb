"""Host work a framework adds to each training step, at 8 ranks in one CPU process (issue #39).

    python -m benchmarks.host_ops                       # prints the table, writes results/host_ops.md
    python -m benchmarks.host_ops --layers 2 --vocab 512 --out ''   # seconds (the smoke test)

On a GPU both zero_plugin stage 3 and torch FSDP2 are host-bound: the step is as long as the host takes
to issue its kernels.  torch's fake process group runs every world-size > 1 code path of both at 8 ranks
in one process with no data moved, and ``torch.profiler`` on the CPU then counts the ops each framework
issues.  Per step and variant:

  * ops: top-level aten ops (no aten op above them) that would launch a kernel: not a view, not an
    allocation, not a composite that did nothing (``aten::to`` of a tensor already in place); minus the
    plain model's own (the same model and optimizer without any framework, same per-rank batch).  An
    approximation of the kernel launches on a GPU (a composite such as ``aten::zeros`` counts once);
  * copies / fills: every ``aten::copy_`` / ``aten::fill_`` (and ``zero_``), nested ones included, minus the
    plain model's.  Neither these nor ops counts the aten ops the fake group runs inside a collective
    (``copy_`` of each rank's chunk in ``all_gather_single``): on a GPU the collective is one NCCL kernel,
    counted under collectives.  On the CPU a foreach op or ``split_with_sizes_copy`` runs one nested ``copy_`` per
    tensor, where CUDA runs one kernel for the list: on a GPU the ops column is the closer count;
  * collectives: ``c10d::`` ops issued (each one NCCL launch on a GPU);
  * hooks: Python callables the autograd engine or ``Module.__call__`` runs besides the forwards themselves
    (module hooks, tensor and post-accumulate-grad hooks, autograd Function backwards, engine callbacks),
    counted with ``sys.setprofile`` in a step of its own; DDP's hooks are C++ and not counted;
  * streams: CUDA stream switches.  0 here by construction (no CUDA streams on the CPU); on a GPU
    ``tests/gpu/trace.py``'s profile counts them;
  * CPU ms: process CPU time per step, the fastest of ``--steps`` steps without profiler (1 thread).

Models: a ``LlamaForCausalLM`` (hidden 64, untied 32000 vocabulary, bf16, fused AdamW) of 16 layers and
one of 32 (their difference / 16 is the per-layer cost), and the 16-layer one with biases (16 parameters
per layer instead of 9): a per-unit cost that does not grow with the parameters per unit is the same for
both.  Stage 3 runs against FSDP2 (``fully_shard`` per decoder layer and on the root, optimizer built after
it); stages 1-2 against DDP (torch's ``DistributedDataParallel`` runs on the fake group: its all-reduce per
bucket is a ``c10d::allreduce_`` in the profile).
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WORLD = 8
RESULTS = Path(__file__).resolve().parent / "results" / "host_ops.md"
# Views that the schema does not mark as one (list returns), and pure allocations: no kernel either way.
_VIEWS = {"split", "split_with_sizes", "unbind", "chunk", "tensor_split", "unsafe_split", "unsafe_chunk"}
_ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_"}
_ALLOCATIONS |= {"detach_", "lift_fresh", "_has_compatible_shallow_copy_type", "record_stream"}


@dataclass(kw_only=True, slots=True)
class Shape:
    """One model of the comparison."""

    name: str
    layers: int = 16
    """decoder layers (units)"""
    bias: bool = False
    """biases on every projection: 16 parameters per layer instead of 9"""
    hidden: int = 64
    vocab: int = 32000
    """untied: embedding and LM head are units of their own at stage 3"""


def build_llama(shape: Shape) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=shape.bias,
        mlp_bias=shape.bias,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


# -- variants -----------------------------------------------------------------------------------------------
def make_variant(name: str, shape: Shape) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``plain`` (no framework), ``zp1``-``zp3``, ``fsdp2`` or ``ddp`` of ``shape``, with fused AdamW."""
    model = build_llama(shape)
    if name == "fsdp2":
        return _fsdp2(model)
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        model.register_comm_hook(None, _allreduce_bucket)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if name.startswith("zp"):
        import zero_plugin as zp

        # trim_host_heap: a CPU-training setting (malloc_trim after steps) that never runs on a GPU, whose host
        # cost this benchmark stands in for
        return zp.setup(model, opt, zp.ZeroConfig(stage=int(name[2:]), trim_host_heap=False))
    return model, opt


def _fsdp2(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One FSDP2 group per decoder layer and the root; ``fully_shard`` replaces the parameters, so the
    optimizer is built after it (built before, it would hold the old tensors and never step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def _allreduce_bucket(state, bucket):  # no annotation: DDP checks a string one as wrong
    """DDP's built-in all-reduce, issued from Python: on the fake group the built-in one's future holds no
    tensor and DDP's reducer asserts.  Average and all-reduce the bucket, as the built-in does."""
    buffer = bucket.buffer().div_(WORLD)
    dist.all_reduce(buffer, async_op=True).wait()
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


# -- counting -----------------------------------------------------------------------------------------------
_launching_cache: dict[str, bool] = {}


def _leaf_launches(name: str) -> bool:
    """Whether an aten op with no aten op below it launches a kernel (see the module docstring)."""
    if name not in _launching_cache:
        _launching_cache[name] = _classify(name.removeprefix("aten::"))
    return _launching_cache[name]


def _classify(op: str) -> bool:
    if op in _VIEWS or op in _ALLOCATIONS:
        return False
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return True
    overloads = [getattr(packet, o) for o in packet.overloads()]
    views = [any(r.alias_info is not None and not r.alias_info.is_write for r in o._schema.returns) for o in overloads]
    composite = []
    for o in overloads:
        try:
            composite.append(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CompositeImplicitAutograd"))
        except RuntimeError:  # an overload without a registration under this name
            pass
    return not (all(views) or (composite and all(composite)))


def _launches(event) -> bool:
    children = [c for c in event.cpu_children if c.name.startswith("aten::")]
    return any(_launches(c) for c in children) if children else _leaf_launches(event.name)


def _under(event, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def _under_aten(event) -> bool:
    return _under(event, "aten::")


def op_counts(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> dict[str, int]:
    """One profiled step: launching top-level aten ops, every copy_ and fill_, and collectives."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, opt, ids)
    counts = {"ops": 0, "copy_": 0, "fill_": 0, "collectives": 0}
    for event in prof.events():
        if event.name.startswith("c10d::"):
            counts["collectives"] += 1
        if not event.name.startswith("aten::") or _under(event, "c10d::"):
            continue  # the fake group's own copies inside a collective: one NCCL kernel on a GPU
        counts["copy_"] += event.name == "aten::copy_"
        counts["fill_"] += event.name in ("aten::fill_", "aten::zero_")
        counts["ops"] += (not _under_aten(event)) and _launches(event)
    return counts


def hooks_fired(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> int:
    """One step under ``sys.setprofile``: Python callables entered from ``Module.__call__``'s hook calls
    (``hook(self, args...)`` lines) or from the C++ autograd engine (a frame whose caller stands on
    ``_engine_run_backward``'s ``run_backward(`` line: tensor and post-accumulate-grad hooks, autograd
    Function backwards, queued callbacks)."""
    fired = 0
    lines: dict[tuple[str, int], bool] = {}

    def count(frame, event, arg):
        nonlocal fired
        caller = frame.f_back
        if event != "call" or caller is None:
            return
        key = (caller.f_code.co_filename, caller.f_lineno)
        if key not in lines:
            text = linecache.getline(*key)
            lines[key] = key[0].endswith(("nn/modules/module.py", "autograd/graph.py")) and (
                " hook(" in text or "run_backward(" in text
            )
        fired += lines[key]

    sys.setprofile(count)
    try:
        train_step(model, opt, ids)
    finally:
        sys.setprofile(None)
    return fired


def cpu_ms(variant: tuple, plain: tuple | None, ids: torch.Tensor, steps: int) -> tuple[float, float | None]:
    """The fastest of ``steps`` steps of the variant, and of the plain model in steps interleaved with them
    (both then see the same load): other jobs on a shared machine only ever slow a step down."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(steps):
        for i, (model, opt) in enumerate([variant] if plain is None else [variant, plain]):
            t = time.process_time()
            train_step(model, opt, ids)
            times[i].append(1e3 * (time.process_time() - t))
    return min(times[0]), min(times[1]) if times[1] else None


def measure(name: str, shape: Shape, ids: torch.Tensor, steps: int, plain: tuple | None = None) -> dict:
    """One variant's row; ``plain``: the plain model and optimizer, stepped between the variant's timed steps."""
    model, opt = make_variant(name, shape)
    for _ in range(2):  # warm-up: lazy state (optimizer, FSDP2's lazy init, zp's recorded order)
        train_step(model, opt, ids)
    # (the plain model's count is the model's: the others hold shards)
    row = {"variant": name, "model": shape.name, "params": sum(p.numel() for p in model.parameters())}
    row["tensors"] = len(list(model.parameters()))
    row["cpu_ms"], row["plain_cpu_ms"] = cpu_ms((model, opt), plain, ids, steps)
    row.update(op_counts(model, opt, ids))
    row["hooks"] = hooks_fired(model, opt, ids)
    row["streams"] = 0  # no CUDA streams on the CPU (module docstring)
    _check_steps(name, model, opt, ids)
    del model, opt
    gc.collect()  # zp's engine and the model reference each other: freed by the cycle collector
    return row


def _check_steps(name: str, model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """The variant trains: a step changes the model's parameters (FSDP2 with the optimizer built before
    ``fully_shard`` fails this: its optimizer steps the replaced tensors)."""
    held = list(model.parameters())
    before = [_local(p).clone() for p in held]
    train_step(model, opt, ids)
    assert any(not torch.equal(b, _local(p)) for b, p in zip(before, held)), f"{name}: a step changed nothing"


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's values (FSDP2's parameters are DTensors)."""
    return param.to_local().detach() if hasattr(param, "to_local") else param.detach()


# -- report -------------------------------------------------------------------------------------------------
_COUNTS = ("ops", "copy_", "fill_", "collectives", "hooks")


def over_plain(rows: list[dict]) -> list[dict]:
    """Each framework row with its counts minus the plain model's (collectives and hooks: the plain model
    has none)."""
    plain = {r["model"]: r for r in rows if r["variant"] == "plain"}
    out = []
    for r in rows:
        if r["variant"] == "plain":
            continue
        base = plain[r["model"]]
        counts = {k: r[k] - base[k] for k in _COUNTS}
        out.append({**r, **counts, "params": base["params"], "tensors": base["tensors"]})
    return out


def per_unit(framework: list[dict], shapes: dict[str, Shape]) -> list[dict]:
    """Per variant of stage 3: framework ops per decoder layer (deep minus base, over the added layers) and
    per extra parameter in a layer (with biases minus without)."""
    by = {(r["variant"], r["model"]): r for r in framework}
    base, deep, bias = shapes["base"], shapes["deep"], shapes["bias"]
    rows = []
    for variant in ("zp3", "fsdp2"):
        b, d, w = by[(variant, "base")], by[(variant, "deep")], by[(variant, "bias")]
        row = {"variant": variant}
        for k in ("ops", "copy_", "fill_", "hooks"):
            row[f"{k}_per_layer"] = (d[k] - b[k]) / (deep.layers - base.layers)
            row[f"{k}_per_bias_param"] = (w[k] - b[k]) / (7 * bias.layers)  # 7 projections get a bias
        rows.append(row)
    return rows


def over_ddp(framework: list[dict]) -> list[dict]:
    """Stages 1-2 against DDP on the base model: ops beyond DDP's, per parameter tensor and per collective
    (DDP: one all-reduce per bucket)."""
    by = {r["variant"]: r for r in framework if r["model"] == "base"}
    ddp = by["ddp"]
    rows = []
    for variant in ("zp1", "zp2"):
        r = by[variant]
        extra = r["ops"] - ddp["ops"]
        per = {"per_tensor": extra / r["tensors"], "per_collective": extra / max(r["collectives"], 1)}
        rows.append({"variant": variant, "ops_over_ddp": extra, "collectives": r["collectives"], **per})
    return rows


def _md_table(rows: list[dict], columns: list[str]) -> list[str]:
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return lines


def render(framework: list[dict], units: list[dict], args) -> str:
    head = [
        "# Host work per training step (`python -m benchmarks.host_ops`)",
        "",
        f"torch {torch.__version__}, fake process group at {WORLD} ranks in one CPU process, 1 thread; "
        f"LlamaForCausalLM hidden {args.hidden}, untied vocab {args.vocab}, bf16, fused AdamW, batch 2 x {args.seq} "
        f"per rank; CPU ms: the fastest of {args.steps} steps.  Counts are per step, over the plain model's own "
        "(`plain_cpu_ms`: the plain model's step, timed in steps interleaved with the variant's); how each is counted: the docstring of `benchmarks/host_ops.py`. "
        "streams: CUDA stream switches, 0 on the CPU by construction.  DDP runs on the fake group with a Python "
        "comm hook standing in for its C++ all-reduce (the built-in one's future holds no tensor there): its "
        "`hooks` are that comm hook, once per bucket, and its `ops` include the hook's division per bucket.",
        "",
        "## Per step",
        "",
    ]
    cols = [
        "model",
        "variant",
        "params",
        "tensors",
        "ops",
        "copy_",
        "fill_",
        "collectives",
        "hooks",
        "streams",
        "cpu_ms",
    ]
    body = _md_table(framework, cols + ["plain_cpu_ms"])
    body += ["", "## Stage 3 per decoder layer, and per parameter added to a layer (biases: 9 -> 16 per layer)", ""]
    keys = [f"{k}_{w}" for w in ("per_layer", "per_bias_param") for k in ("ops", "copy_", "fill_", "hooks")]
    body += _md_table(units, ["variant"] + keys)
    body += ["", "## Stages 1-2 against DDP (base model): ops beyond DDP's", ""]
    body += _md_table(over_ddp(framework), ["variant", "ops_over_ddp", "collectives", "per_tensor", "per_collective"])
    return "\n".join(head + body) + "\n"


def _shapes(args) -> dict[str, Shape]:
    common = {"hidden": args.hidden, "vocab": args.vocab}
    return {
        "base": Shape(name="base", layers=args.layers, **common),
        "deep": Shape(name="deep", layers=2 * args.layers, **common),
        "bias": Shape(name="bias", layers=args.layers, bias=True, **common),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS), help="markdown file; '' for none")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake group moves no data: gathered values are whatever memory held
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    shapes = _shapes(args)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(0))
    plan = [(v, "base") for v in ("plain", "zp3", "fsdp2", "zp1", "zp2", "ddp")]
    plan += [(v, m) for m in ("deep", "bias") for v in ("plain", "zp3", "fsdp2")]
    rows, plain = [], {}
    for variant, model in plan:
        rows.append(measure(variant, shapes[model], ids, args.steps, plain.get(model)))
        print(json.dumps(rows[-1]), flush=True)
        if variant == "plain":
            plain[model] = make_variant("plain", shapes[model])
    framework = over_plain(rows)
    text = render(framework, per_unit(framework, shapes), args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
