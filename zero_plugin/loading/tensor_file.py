"""Read one tensor of a ``.safetensors`` file straight into a tensor that already exists.

[Note: reading without a second copy]  ``safe_open(...).get_tensor(key)`` maps the whole file and returns a
new tensor: copying that into the unit's own full tensor holds the value twice, and the mapped file pages
count in the process's RSS as long as the handle is open.  On a 3B Llama loaded unit by unit at stage 3
that made the end of setup (the 393 MB output layer) the peak of the whole run: +0.39 GiB of copy and
+0.33 GiB of mapped pages per rank over the shards (``benchmarks/results/large_model.md``).  The file
format is a little-endian u64 header length, a JSON header (dtype, shape, byte offsets per tensor) and
the raw bytes, so a tensor whose dtype matches is read with one ``readinto`` into the destination's own
memory; otherwise (bf16 on disk, fp32 in training; a destination on an accelerator) it goes through a
bounded staging buffer, chunk by chunk.  Plain reads go through the page cache, which is not this
process's memory.

[Note: byte ranges checked against shapes]  A tensor's ``data_offsets`` (its byte range) must hold exactly
``prod(shape) * itemsize`` bytes.  The reads below take their length from the destination, not from the
range, so a header whose range disagrees with its shape (hand-edited, truncated by a broken writer) would
silently fill the destination with part of this tensor and part of the next one.  ``header`` checks every
tensor when it parses the file, before anything is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

__all__ = ["TensorEntry", "header", "read_into"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_STAGING_BYTES = 16 << 20  # per chunk when the value must be converted or moved


class TensorEntry:
    """Where one tensor's bytes are in its file."""

    __slots__ = ("path", "dtype", "shape", "start", "nbytes")

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], start: int, nbytes: int) -> None:
        self.path, self.dtype, self.shape, self.start, self.nbytes = path, dtype, shape, start, nbytes


def header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file (``__metadata__`` left out)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(length))
    base = 8 + length
    out = {}
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"zero_plugin: {path}: tensor {key!r} has dtype {info['dtype']}, which this reader "
                f"does not know ({', '.join(_DTYPES)})"
            )
        lo, hi = info["data_offsets"]
        entry = TensorEntry(path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + lo, hi - lo)
        _check_byte_range(key, entry)
        out[key] = entry
    return out


def _check_byte_range(key: str, entry: TensorEntry) -> None:
    """[Note: byte ranges checked against shapes]"""
    expected = math.prod(entry.shape) * entry.dtype.itemsize
    if entry.nbytes != expected:
        raise ValueError(
            f"zero_plugin: {entry.path}: tensor {key!r} ({str(entry.dtype).removeprefix('torch.')}, shape "
            f"{entry.shape}) needs {expected} bytes, but the header's data_offsets record {entry.nbytes}; the "
            "file's header is corrupt or was written by a broken tool: re-save the checkpoint (e.g. "
            "save_pretrained, or safetensors.torch.save_file) or download it again"
        )


def read_into(entry: TensorEntry, out: torch.Tensor) -> None:
    """Fill ``out`` (same shape, any dtype/device) with the tensor ``entry`` describes."""
    if tuple(out.shape) != entry.shape:
        raise ValueError(
            f"zero_plugin: tensor in {entry.path} has shape {entry.shape}, the model expects {tuple(out.shape)}"
        )
    if not out.numel():
        return
    with open(entry.path, "rb", buffering=0) as f:
        f.seek(entry.start)
        if out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous():
            _read_exact(f, out.view(-1).view(torch.uint8))
            return
        _read_converted(f, entry, out)


def _read_converted(f, entry: TensorEntry, out: torch.Tensor) -> None:
    item = entry.dtype.itemsize
    per_chunk = max(1, _STAGING_BYTES // item)
    flat_out = out.view(-1) if out.is_contiguous() else None
    staging = torch.empty(min(per_chunk, out.numel()) * item, dtype=torch.uint8)
    whole = torch.empty(out.shape, dtype=out.dtype) if flat_out is None else None
    target = flat_out if flat_out is not None else whole.view(-1)
    for lo in range(0, out.numel(), per_chunk):
        n = min(per_chunk, out.numel() - lo)
        chunk = staging[: n * item]
        _read_exact(f, chunk)
        target[lo : lo + n].copy_(chunk.view(entry.dtype))
    if whole is not None:
        out.copy_(whole)


def _read_exact(f, dest: torch.Tensor) -> None:
    view = memoryview(dest.numpy()).cast("B")
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"zero_plugin: {os.fspath(f.name)} ends early (truncated or corrupt checkpoint)")
        done += got
