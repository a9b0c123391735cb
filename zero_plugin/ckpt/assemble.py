"""One parameter of a sharded checkpoint assembled whole, and a folder written under a temporary name: what
``zero-plugin consolidate``'s writers share (``consolidate.py``: safetensors / ``save_pretrained``;
``dcp_export.py``: DCP; ``lightning_file.py``: one Lightning file), in one place below all three
([Note: streaming consolidation] in ``consolidate.py``)."""

from __future__ import annotations

import math
import os
import shutil
import uuid
from typing import Callable

import torch

from . import format as fmt
from .format import CheckpointError
from .load import Reader

__all__ = ["assemble", "full_tensor", "write_new_folder"]


def write_new_folder(out: str, write: Callable[[str], list[str]]) -> list[str]:
    """``write(tmp)`` into ``out.tmp-<id>``, renamed to ``out`` (new, or an empty folder) once complete;
    returns the paths of the files ``write`` names."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise CheckpointError(f"consolidate: {out} already exists and is not an empty folder; choose a new one")
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        written = write(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # the empty folder the user named
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(out, name) for name in written]


def full_tensor(reader: Reader, index: dict, source: str) -> torch.Tensor:
    """One parameter assembled from its pieces in the rank files, or a buffer ([Note: streaming consolidation])."""
    kind, name = source.split("/", 1)
    if kind == "b":
        entry = index["buffers"][name]
        value = reader.tensor(0, source)
        if list(value.shape) != list(entry["shape"]):
            raise CheckpointError(
                f"{reader.where(0, source)} has shape {list(value.shape)}, the index says {entry['shape']}"
            )
        return value
    entry = index["params"][name]
    return assemble(reader, source, entry["shards"], fmt.dtype_from_name(entry["dtype"]), entry["shape"])


def assemble(reader: Reader, key: str, shards: list, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The full tensor ``key`` from its pieces ``[rank file, lo, hi)`` of the flattened whole."""
    flat = torch.empty(math.prod(shape), dtype=dtype)
    for i, lo, hi in shards:
        flat[lo:hi] = reader.slice(i, key, hi - lo, dtype)[:]
    return flat.view(shape)
