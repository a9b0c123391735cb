"""``zero-plugin`` command line: ``estimate``, ``launch`` (see ``run.py``); ``consolidate`` with its issue."""
from __future__ import annotations

import argparse
import sys

from .memory import theory_bytes

__all__ = ["main"]

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _parse_count(text: str) -> int:
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(float(t))
    except (ValueError, IndexError, KeyError):
        raise argparse.ArgumentTypeError(f"--params must be a count like 7e9, 1.3B or 350M; got {text!r}") from None


def _count_from_model(name_or_path: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from .materialize import empty_model

    cfg = AutoConfig.from_pretrained(name_or_path)
    model = empty_model(lambda: AutoModelForCausalLM.from_config(cfg))
    return sum(p.numel() for p in model.parameters())


def _estimate(args: argparse.Namespace) -> int:
    psi = args.params if args.params is not None else _count_from_model(args.model)
    pb = _DTYPE_BYTES[args.dtype]
    mixed = pb < 4
    print(f"model states per rank for {psi / 1e9:.3f}B parameters, {args.dtype}, AdamW, world size {args.world_size}")
    print(f"{'stage':>5} | {'params GiB':>10} | {'grads GiB':>9} | {'optim GiB':>9} | {'total GiB':>9}")
    for stage in range(4):
        t = theory_bytes(stage=stage, world_size=args.world_size, trainable=psi, frozen=0, param_bytes=pb,
                         master_bytes=4, state_per_param=2, mixed=mixed)
        g = {k: v / 2**30 for k, v in t.items()}
        print(f"{stage:>5} | {g['params']:>10.2f} | {g['grads']:>9.2f} | {g['optimizer']:>9.2f} | {g['total']:>9.2f}")
    return 0


def _not_yet(what: str):
    def run(args: argparse.Namespace) -> int:
        print(f"zero-plugin {what}: not implemented yet", file=sys.stderr)
        return 2
    return run


def _launch(args: argparse.Namespace) -> int:
    from .run import launch

    return launch(args.argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zero-plugin", description="ZeRO sharded data parallelism tools")
    sub = ap.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="memory per rank by stage")
    src = est.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_parse_count, help="parameter count, e.g. 7B")
    src.add_argument("--model", help="a transformers config name or local path")
    est.add_argument("--world-size", type=int, default=8)
    est.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bf16")
    est.set_defaults(run=_estimate)
    # Every launch option is parsed by Accelerate's own parser in zero_plugin.run.launch (imported
    # only when launching); prefix_chars="\0" keeps argparse from reading any of them here.
    launch = sub.add_parser("launch", help="run an Accelerate / transformers.Trainer script under a ZeRO stage",
                            add_help=False, prefix_chars="\0")
    launch.add_argument("argv", nargs=argparse.REMAINDER)
    launch.set_defaults(run=_launch)
    for name in ("consolidate",):
        sub.add_parser(name, help="(coming)").set_defaults(run=_not_yet(name))
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
