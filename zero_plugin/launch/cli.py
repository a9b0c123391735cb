"""``zero-plugin`` command line: ``estimate`` (see ``estimate_command.py``), ``launch`` (see ``run.py``),
``consolidate`` (see ``ckpt/consolidate.py``), ``config --from-deepspeed`` (see ``config_deepspeed.py``)."""

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


def _add_config(sub) -> None:
    p = sub.add_parser(
        "config",
        help="print the zero_plugin YAML equivalent to a DeepSpeed config",
        description="Read a DeepSpeed JSON (ds_config.json) through zero_plugin's table of DeepSpeed keys "
        "(docs/deepspeed.md) and print the equivalent zero_plugin YAML (for --zero_config, or a zero_plugin: "
        "section); ZeroConfig.from_file of it equals ZeroConfig.from_deepspeed of the JSON. What lies outside "
        "ZeroConfig (the optimizer and scheduler sections, batch sizes) is printed as comments; refused keys "
        "fail naming the key and the fix.",
    )
    p.add_argument("--from-deepspeed", required=True, metavar="DS_JSON", help="the DeepSpeed configuration file")
    p.add_argument(
        "--auto",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='a value for an "auto" entry, by its dotted DeepSpeed key and a JSON value (repeatable), e.g. '
        "--auto gradient_clipping=1.0 --auto bf16.enabled=true",
    )
    p.add_argument("--world-size", type=int, default=None, help="checks train_batch_size against it")
    p.set_defaults(run=_config)


def _resolved_autos(pairs: list[str]) -> dict:
    import json

    out: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--auto {pair!r}: expected KEY=VALUE, e.g. gradient_clipping=1.0")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _config(args: argparse.Namespace) -> int:
    from ..config import ZeroConfig
    from ..config_deepspeed import translate
    from ..integrations.deepspeed_config import to_yaml

    try:
        autos = _resolved_autos(args.auto)
        translation = translate(args.from_deepspeed, resolved=autos, world_size=args.world_size)
        config = ZeroConfig.from_dict(translation.settings)
    except (ValueError, OSError) as exc:
        print(f"zero-plugin config: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(config, translation))
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
    _add_config(sub)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
