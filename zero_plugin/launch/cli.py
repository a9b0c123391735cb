"""``zero-plugin`` command line: ``estimate`` (see ``estimate_command.py``), ``launch`` (see ``run.py``),
``consolidate`` (see ``ckpt/consolidate.py``)."""

from __future__ import annotations

import argparse
import sys

from .arg_types import DTYPES, parse_bytes
from .estimate_command import add_estimate

__all__ = ["main"]


def _add_consolidate(sub) -> None:
    p = sub.add_parser(
        "consolidate",
        help="a sharded checkpoint to safetensors, a save_pretrained folder or one "
        "Lightning .ckpt file (offline, one process)",
        description="Write a sharded checkpoint as standard files (see zero_plugin/ckpt/"
        "consolidate.py). --format hf writes what save_pretrained writes: config.json + "
        "weights, or for a PEFT model only the adapter (adapter_model.safetensors + "
        "adapter_config.json). --format lightning turns a sharded Lightning/Fabric "
        "checkpoint directory (ZeroStrategy's epoch=N.ckpt/) into the one file that "
        "LightningModule.load_from_checkpoint and other strategies read. --format dcp writes a "
        "torch.distributed.checkpoint folder that FSDP2 resumes from (zero_plugin/ckpt/dcp_export.py). "
        "CHECKPOINT may also be an FSDP / DCP folder (dcp.save, or Accelerate's pytorch_model_fsdp_0/ + "
        "optimizer_0/), exported as safetensors or hf.",
    )
    p.add_argument(
        "checkpoint",
        help="folder written by zp.save_checkpoint, a sharded Lightning checkpoint directory, or an FSDP / DCP folder",
    )
    p.add_argument("out", help="new folder to create (must not exist, or be empty); --format lightning: new file")
    p.add_argument("--format", choices=["safetensors", "hf", "lightning", "dcp"], default="safetensors")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating-point tensors")
    p.add_argument(
        "--max-shard-size",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="largest output file, like 5GB (the default) or 500MiB",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint's files")
    p.add_argument(
        "--no-weights-only",
        action="store_true",
        help="--format lightning: unpickle meta.pt with torch.load(weights_only=False), as "
        "load_from_checkpoint(weights_only=False) does (trusted checkpoints only)",
    )
    p.set_defaults(run=_consolidate)


def _torch_dtype(name: str | None):
    from ..config_values import as_dtype as _as_dtype

    return _as_dtype("--dtype", name) if name else None


def _consolidate(args: argparse.Namespace) -> int:
    from ..ckpt.consolidate import DEFAULT_MAX_SHARD_BYTES, consolidate
    from ..ckpt.format import CheckpointError

    try:
        written = consolidate(
            args.checkpoint,
            args.out,
            format=args.format,
            dtype=_torch_dtype(args.dtype),
            max_shard_bytes=int(args.max_shard_size or DEFAULT_MAX_SHARD_BYTES),
            verify=not args.no_verify,
            weights_only=not args.no_weights_only,
        )
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"zero-plugin consolidate: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .launcher import launch

    return launch(args.argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zero-plugin", description="ZeRO sharded data parallelism tools")
    sub = ap.add_subparsers(dest="command", required=True)
    add_estimate(sub)
    # Every launch option is parsed by Accelerate's own parser in zero_plugin.launch.launcher.launch (imported
    # only when launching); prefix_chars="\0" keeps argparse from reading any of them here.
    launch = sub.add_parser(
        "launch",
        help="run an Accelerate / transformers.Trainer script under a ZeRO stage",
        add_help=False,
        prefix_chars="\0",
    )
    launch.add_argument("argv", nargs=argparse.REMAINDER)
    launch.set_defaults(run=_launch)
    _add_consolidate(sub)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
