"""Files of a checkpoint directory, and the only code that touches them.

[Note: checkpoint layout]
A checkpoint is a directory::

    COMPLETE                            manifest: every file with its size and sha256 (written last)
    index.json                          what is stored where (see ``save.py``)
    rank-00000-of-00002.safetensors     rank 0's regions of every parameter and optimizer state,
    rank-00001-of-00002.safetensors       plus (rank 0) buffers, scalars and ``extra`` tensors

Tensors are only ever stored as safetensors and metadata only as JSON, so loading
never unpickles anything.  The writer streams each tensor straight from its
(region view of the) parameter into the file, hashing the same bytes on the way,
so a save neither copies model state nor reads its files back.  Readers use the
``safetensors`` library, which validates every header and maps files lazily: a
rank reads only the byte ranges of the regions it needs.

Saving happens in ``<path>.tmp-<uuid>``; ``COMPLETE`` is written after every
rank's file is on disk and the directory is then renamed to ``<path>``.  A
directory without ``COMPLETE`` is therefore an interrupted save.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = [
    "CheckpointError",
    "FileRecord",
    "FORMAT",
    "VERSION",
    "INDEX",
    "COMPLETE",
    "shard_file_name",
    "write_safetensors",
    "write_safetensors_streaming",
    "write_json",
    "write_manifest",
    "read_manifest",
    "check_sizes",
    "sha256_file",
    "read_json",
    "fsync_dir",
    "dtype_name",
    "dtype_from_name",
    "safetensors_code",
    "check_sha256",
]

FORMAT = "zero_plugin.checkpoint"
VERSION = 1
INDEX = "index.json"
COMPLETE = "COMPLETE"
_CHUNK = 64 << 20
_HASH_QUEUE = 4  # chunks written but not yet hashed (bounds host copies of device tensors)
# Only these names are ever opened; anything else a manifest lists is refused (no paths, no pickles).
_FILE_NAME = re.compile(r"^(index\.json|rank-\d{5}-of-\d{5}\.safetensors)$")

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in _ST_DTYPES}


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, or does not match the model/optimizer it is loaded into."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    name: str
    size: int
    sha256: str


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _ST_DTYPES:
        raise CheckpointError(f"zp.save_checkpoint: cannot store tensors of dtype {dtype}")
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    return _ST_DTYPES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPE_BY_NAME:
        raise CheckpointError(f"checkpoint records an unknown dtype {name!r}")
    return _DTYPE_BY_NAME[name]


# -- writing --------------------------------------------------------------------
def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: str, entries: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> FileRecord:
    """Stream ``entries`` into a safetensors file at ``path``; returns its size and sha256.

    The sha256 runs in a helper thread on the chunks just written (hashlib releases the GIL),
    so hashing overlaps the writes instead of adding to them.
    """
    blob, offset = _header([(key, t.dtype, tuple(t.shape)) for key, t in entries], metadata)
    digest = hashlib.sha256()
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        in_flight: deque = deque()
        for chunk in _chunks([struct.pack("<Q", len(blob)), blob], entries):
            f.write(chunk)
            in_flight.append(hasher.submit(digest.update, chunk))  # one worker: chunks hashed in order
            while len(in_flight) > _HASH_QUEUE:
                in_flight.popleft().result()
        for future in in_flight:
            future.result()
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(os.path.basename(path), 8 + len(blob) + offset, digest.hexdigest())


def _header(specs: list[tuple[str, torch.dtype, tuple]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The length-prefixed JSON header of a safetensors file holding ``specs`` in order, and the data size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape in specs:
        dtype_name(dtype)  # raises for dtypes safetensors cannot hold
        nbytes = dtype.itemsize * math.prod(shape)
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    return blob, offset


def write_safetensors_streaming(
    path: str,
    specs: list[tuple[str, torch.dtype, tuple]],
    fetch: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
) -> int:
    """Write a safetensors file whose tensors are produced one at a time by ``fetch(key)`` (in ``specs``
    order), so at most one of them is in memory; returns the file size.  For exports (no hash kept)."""
    blob, size = _header(specs, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, shape in specs:
            t = fetch(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(
                    f"export: {key!r} came out as {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}"
                )
            data = _as_bytes(t)
            for start in range(0, len(data), _CHUNK):
                f.write(data[start : start + _CHUNK])
            del t, data
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + size


def _chunks(head: list[bytes], entries: list[tuple[str, torch.Tensor]]) -> Iterator[memoryview | bytes]:
    yield from head
    for _, t in entries:
        data = _as_bytes(t)
        for start in range(0, len(data), _CHUNK):
            yield data[start : start + _CHUNK]


def write_json(path: str, obj: Any) -> FileRecord:
    data = json.dumps(obj, indent=1, sort_keys=False).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(os.path.basename(path), len(data), hashlib.sha256(data).hexdigest())


def write_manifest(directory: str, records: Iterable[FileRecord]) -> None:
    files = {r.name: {"size": r.size, "sha256": r.sha256} for r in sorted(records, key=lambda r: r.name)}
    write_json(os.path.join(directory, COMPLETE), {"format": FORMAT, "version": VERSION, "files": files})


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading and verifying -------------------------------------------------------
def read_json(path: str, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc}") from exc


def read_manifest(directory: str) -> dict[str, dict]:
    """``{file name: {"size", "sha256"}}`` from ``COMPLETE``; raises if the save never finished."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint at {directory}{_leftovers(directory)}")
    marker = os.path.join(directory, COMPLETE)
    if not os.path.isfile(marker):
        raise CheckpointError(f"incomplete checkpoint (interrupted save?): {directory} has no {COMPLETE} manifest")
    manifest = read_json(marker, "checkpoint manifest")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{marker} is not a zero_plugin checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{marker}: checkpoint format version {manifest.get('version')!r}, this zero_plugin reads version {VERSION}"
        )
    for name, entry in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise CheckpointError(
                f"{marker} lists {name!r}, which is not a checkpoint file (only index.json and "
                "rank-NNNNN-of-NNNNN.safetensors are read); refusing to load it"
            )
        if not (
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"{marker}: malformed entry for {name!r}")
    if INDEX not in files:
        raise CheckpointError(f"{marker} does not list {INDEX}")
    return files


def _leftovers(path: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    try:
        near = sorted(
            n for n in os.listdir(parent or ".") if n.startswith(base + ".old-") or n.startswith(base + ".tmp-")
        )
    except OSError:
        return ""
    if not near:
        return ""
    return f" (an interrupted save left {', '.join(os.path.join(parent, n) for n in near)})"


def check_sizes(directory: str, files: dict[str, dict]) -> None:
    for name, entry in files.items():
        full = os.path.join(directory, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing (listed in the {COMPLETE} manifest)")
        size = os.path.getsize(full)
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint file {full} has {size} bytes, the manifest says {entry['size']} (truncated or modified)"
            )


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(directory: str, name: str, expected: str) -> None:
    full = os.path.join(directory, name)
    if sha256_file(full) != expected:
        raise CheckpointError(
            f"checkpoint file {full} does not match its sha256 in the {COMPLETE} manifest (corrupted or modified)"
        )
