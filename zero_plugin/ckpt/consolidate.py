"""``zero-plugin consolidate``: a sharded checkpoint to standard files, offline, in one process.

    zero-plugin consolidate CKPT OUT [--format safetensors|hf|lightning] [--dtype bf16] [--max-shard-size 5GB]

* ``safetensors``: every parameter and persistent buffer under its saved name, in safetensors files of
  at most ``--max-shard-size`` (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
  ``model.safetensors.index.json``: the layout ``transformers`` writes and reads).
* ``hf``: what ``save_pretrained`` writes.  For a transformers model: the weights as above, named as
  in the model's own ``state_dict``, and ``config.json`` -- the folder loads with ``from_pretrained``.
  For a PEFT model: only the adapter weights, as ``adapter_model.safetensors`` and
  ``adapter_config.json`` (further adapters in subfolders named after them, as PEFT does) -- the folder
  loads with ``PeftModel.from_pretrained``.  Both need what ``save_checkpoint`` recorded about the
  model (``export_info.py``).
* ``lightning``: a sharded Lightning / Fabric checkpoint directory (``ZeroStrategy``'s ``epoch=0.ckpt/``) as
  the one file Lightning writes, for ``LightningModule.load_from_checkpoint`` and other strategies
  (``lightning_file.py``).  ``OUT`` is a file.  The other formats also accept such a directory (they
  export its ``zero/`` part).

[Note: streaming consolidation]
Memory stays near the largest single tensor: each one is assembled from its pieces in the rank files
(read lazily through safetensors' memory maps), cast, written and dropped before the next; the output
headers are computed from ``index.json`` up front.  Nothing is written until the manifest, sizes,
sha256 hashes (unless ``verify=False``) and the index have been checked, and the result appears under
``OUT`` only when complete (written as ``OUT.tmp-<id>`` and renamed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import dcp_source, deepspeed_reader
from . import format as fmt
from .assemble import full_tensor, write_new_folder
from .dcp_export import export_dcp
from .dcp_reader import DcpLayout, find_layout
from .format import CheckpointError
from .lightning_file import SHARDS_DIR, consolidate_lightning, is_lightning_checkpoint
from .load import Reader
from .verify import read_checked_index

__all__ = ["FORMATS", "consolidate"]

FORMATS = ("safetensors", "hf", "lightning", "dcp")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
_ST_METADATA = {"format": "pt"}  # transformers refuses safetensors weights without it


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One output tensor: its key in the output, and where it comes from in the checkpoint."""

    key: str
    source: str  # "p/<name>" (a parameter, in pieces) or "b/<name>" (a buffer, in rank 0's file)
    dtype: torch.dtype  # as written (after ``--dtype``)
    shape: tuple

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = True,
    weights_only: bool = True,
) -> list[str]:
    """Write ``checkpoint`` as standard files into the new folder ``out`` (``lightning``: the new file ``out``);
    returns the files written.  ``weights_only``: how ``lightning`` unpickles ``meta.pt`` ([Note: Lightning
    file memory] in ``lightning_file.py``)."""
    if format not in FORMATS:
        raise ValueError(f"consolidate: format must be one of {FORMATS}; got {format!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"consolidate: max_shard_bytes must be positive; got {max_shard_bytes!r}")
    if format == "dcp":  # ours to FSDP2 ([Note: DCP export] in dcp_export.py)
        return export_dcp(checkpoint, out, verify=verify)
    if (dcp := find_layout(os.fspath(checkpoint))) is not None:  # FSDP / torch DCP, read as ours
        return _consolidate_dcp(dcp, os.fspath(out), format=format, dtype=dtype, max_shard_bytes=max_shard_bytes)
    deepspeed = deepspeed_reader.find_tag_dir(os.path.abspath(os.fspath(checkpoint)))
    if format == "lightning":
        if deepspeed is not None:
            raise ValueError("consolidate: a DeepSpeed checkpoint exports as --format safetensors or hf")

        if dtype is not None:
            raise ValueError(
                "consolidate --format lightning: --dtype is not supported (the optimizer state "
                "must keep the dtype of the weights it belongs to)"
            )
        return consolidate_lightning(checkpoint, out, verify=verify, weights_only=weights_only)
    checkpoint, out = _zero_part(os.path.abspath(os.fspath(checkpoint))), os.path.abspath(os.fspath(out))
    source = deepspeed_reader.open_checkpoint(deepspeed) if deepspeed is not None else None
    index = source.index if source is not None else read_checked_index(checkpoint, verify=verify)
    export = _checked_export(source.export if source is not None else index.get("export"), checkpoint)

    def write(tmp: str) -> list[str]:
        with contextlib.ExitStack() as stack:
            reader = source if source is not None else Reader(checkpoint, index["files"], stack)
            return _write(reader, index, export, tmp, format, dtype, max_shard_bytes)

    return write_new_folder(out, write)


def _consolidate_dcp(layout: DcpLayout, out: str, *, format: str, dtype, max_shard_bytes: int) -> list[str]:
    """A DCP checkpoint to safetensors or a ``save_pretrained`` folder ([Note: DCP as a zero_plugin index])."""
    if format not in ("safetensors", "hf"):
        raise ValueError(f"consolidate: a DCP checkpoint exports as --format safetensors or hf; got {format!r}")
    source = dcp_source.open_checkpoint(layout)
    if format == "hf" and "hf_config" not in source.export:
        raise CheckpointError(
            f"consolidate --format hf: no config.json in {layout.root} (DCP records no model config); copy the "
            "model's config.json there, or use --format safetensors"
        )
    return write_new_folder(
        out, lambda tmp: _write(source, source.index, source.export, tmp, format, dtype, max_shard_bytes)
    )


def _zero_part(checkpoint: str) -> str:
    """A sharded Lightning checkpoint directory holds its zp.save_checkpoint folder under ``zero/``."""
    return os.path.join(checkpoint, SHARDS_DIR) if is_lightning_checkpoint(checkpoint) else checkpoint


def _checked_export(export: Any, checkpoint: str) -> dict:
    """``index.json``'s ``export`` record (``export_info.py``), type-checked: the index is untrusted input."""
    if export is None:
        return {}  # saved by a zero_plugin that recorded nothing for export

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"malformed checkpoint index {checkpoint}/{fmt.INDEX}: export record: {what}")

    if not isinstance(export, dict):
        raise bad("not an object")
    if not isinstance(export.get("hf_config", {}), dict) or not isinstance(export.get("prefix", ""), str):
        raise bad("hf_config must be an object and prefix a string")
    peft = export.get("peft", {})
    if not isinstance(peft, dict):
        raise bad("peft must be an object")
    for adapter, entry in peft.items():
        keys = entry.get("keys") if isinstance(entry, dict) else None
        if not (
            isinstance(keys, dict)
            and keys
            and isinstance(entry.get("config", {}), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())
        ):
            raise bad(f"adapter {adapter!r} needs a config object and a non-empty map of saved to exported names")
    return export


def _write(reader: Reader, index: dict, export: dict, tmp: str, format: str, dtype, max_shard: int) -> list[str]:
    if format == "safetensors":
        return _write_weights(reader, index, _all_tensors(index, dtype, lambda name: name), tmp, "model", max_shard)
    if "peft" in export:
        return _write_adapters(reader, index, export["peft"], tmp, dtype)
    if "hf_config" not in export:
        raise CheckpointError(
            "consolidate --format hf: the checkpoint records no transformers config (the model "
            "had none, or it was saved by an older zero_plugin); use --format safetensors"
        )
    prefix = export.get("prefix", "")
    rename = lambda name: name[len(prefix) :] if prefix and name.startswith(prefix) else name  # noqa: E731
    written = _write_weights(reader, index, _all_tensors(index, dtype, rename), tmp, "model", max_shard)
    config = dict(export["hf_config"])
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    _write_json(os.path.join(tmp, "config.json"), config)
    return written + ["config.json"]


def _all_tensors(index: dict, dtype, rename: Callable[[str], str]) -> list[_Tensor]:
    packed = _packed_4bit(index)
    out = []
    for kind, entries in (("p", index["params"]), ("b", index["buffers"])):
        for name, entry in entries.items():
            stored = fmt.dtype_from_name(entry["dtype"])
            keep = (
                name in packed
                or name.rpartition(".")[0] in packed
                or any(name.startswith(p + ".quant_state.") for p in packed)
            )
            out.append(
                _Tensor(
                    rename(name), f"{kind}/{name}", stored if keep else _cast_to(stored, dtype), tuple(entry["shape"])
                )
            )
    for alias, name in index.get("aliases", {}).items():  # tied names DeepSpeed records (our index has none)
        entry = index["params"][name]
        out.append(
            _Tensor(
                rename(alias), f"p/{name}", _cast_to(fmt.dtype_from_name(entry["dtype"]), dtype), tuple(entry["shape"])
            )
        )
    return out


def _packed_4bit(index: dict) -> set[str]:
    """Parameters saved with a bitsandbytes quant state beside them (``<name>.quant_state.bitsandbytes__nf4``
    among the buffers): packed 4-bit codes, which ``--dtype`` must not cast, nor their quant state
    ([Note: packed 4-bit weights] in ``zero_plugin/loading/quantized.py``)."""
    marker = ".quant_state.bitsandbytes__"
    return {b.split(marker, 1)[0] for b in index["buffers"] if marker in b} & set(index["params"])


def _cast_to(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and stored.is_floating_point else stored


def _write_adapters(reader: Reader, index: dict, peft: dict, tmp: str, dtype) -> list[str]:
    written = []
    names = sorted(peft, key=lambda a: (a != "default", a))  # the default adapter at the top, as PEFT saves
    for adapter in names:
        entry = peft[adapter]
        keys = entry["keys"]
        tensors = []
        for name, key in keys.items():
            info = index["params"].get(name) or index["buffers"].get(name)
            kind = "p" if name in index["params"] else "b"
            if info is None:
                raise CheckpointError(f"consolidate: adapter {adapter!r} names {name!r}, which the checkpoint lacks")
            tensors.append(
                _Tensor(
                    key, f"{kind}/{name}", _cast_to(fmt.dtype_from_name(info["dtype"]), dtype), tuple(info["shape"])
                )
            )
        sub = "" if adapter == names[0] else adapter
        os.makedirs(os.path.join(tmp, sub), exist_ok=True)
        path = os.path.join(sub, "adapter_model.safetensors")
        fmt.write_safetensors_streaming(
            os.path.join(tmp, path),
            [(t.key, t.dtype, t.shape) for t in tensors],
            _fetcher(reader, index, tensors),
            dict(_ST_METADATA),
        )
        config_path = os.path.join(sub, "adapter_config.json")
        _write_json(os.path.join(tmp, config_path), entry.get("config", {}))
        written += [path, config_path]
    return written


def _write_weights(
    reader: Reader, index: dict, tensors: list[_Tensor], tmp: str, stem: str, max_shard: int
) -> list[str]:
    """Greedy shards of at most ``max_shard`` bytes (a larger tensor gets one of its own), in saved order."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    names = [f"{stem}.safetensors"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    fetch = _fetcher(reader, index, tensors)
    for name, shard in zip(names, shards):
        fmt.write_safetensors_streaming(
            os.path.join(tmp, name), [(t.key, t.dtype, t.shape) for t in shard], fetch, dict(_ST_METADATA)
        )
    if n == 1:
        return names
    weight_map = {t.key: name for name, shard in zip(names, shards) for t in shard}
    _write_json(
        os.path.join(tmp, f"{stem}.safetensors.index.json"),
        {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map},
    )
    return names + [f"{stem}.safetensors.index.json"]


def _fetcher(reader: Reader, index: dict, tensors: list[_Tensor]) -> Callable[[str], torch.Tensor]:
    by_key = {t.key: t for t in tensors}

    def fetch(key: str) -> torch.Tensor:
        t = by_key[key]
        return full_tensor(reader, index, t.source).to(t.dtype)

    return fetch


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
