"""A torch.distributed.checkpoint (DCP) folder, read without running anything it holds.

[Note: DCP checkpoint layout]
``dcp.save(state, checkpoint_id=folder)`` (FSDP2 / torchtitan / Accelerate under FSDP) writes::

    .metadata          a pickle of DCP's ``Metadata``: every flattened key (``model.up.weight``,
                       ``optim.state.up.weight.exp_avg``, ``optim.param_groups.0.lr``) with its path in the
                       saved dict (``planner_data``), its shape, dtype and chunks, and where each chunk lies
    __0_0.distcp ...   one file per saving rank: each chunk a ``torch.save`` of one tensor at a byte range,
                       each non-tensor (hyper-parameters, param names) a ``torch.save`` of the value

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and the non-tensor items with
``torch.load(weights_only=False)``: opening an untrusted folder with it runs whatever the files say.  Here
``.metadata`` goes through an unpickler that knows only DCP's metadata classes, ``torch.Size``, dtypes,
layouts and paths (:func:`read_metadata`; anything else is refused, naming the file and the global), and
every item through ``torch.load(weights_only=True)``.  Chunk paths must name files inside the folder.
Accelerate's folder layout (``pytorch_model_fsdp_0/`` + ``optimizer_0/``, what ``save_fsdp_model`` /
``save_fsdp_optimizer`` and the HF Trainer write under ``SHARDED_STATE_DICT``) is found by :func:`find_layout`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from .format import CheckpointError

__all__ = ["METADATA", "Chunk", "DcpLayout", "DcpFolder", "find_layout", "read_metadata"]

METADATA = ".metadata"
_ACCELERATE_MODEL = re.compile(r"^pytorch_model_fsdp_(\d+)$")  # accelerate's FSDP_MODEL_NAME + index

_DCP_MD = "torch.distributed.checkpoint.metadata"
_BUILDABLE = (  # classes whose instances the pickle may fill in (BUILD)
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
_CALLABLE = {  # further globals it may name: value constructors that run nothing else
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", p) for p in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be guarded below
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _BUILDABLE or (module, name) in _CALLABLE or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.path}: refuses to load the global {module}.{name} (not unpickled: a DCP {METADATA} holds "
            "only torch.distributed.checkpoint's metadata classes; this file was not written by DCP, or was "
            "tampered with)"
        )

    def load_build(self) -> None:
        # BUILD sets attributes on the object below it: only on instances of the metadata classes, never on a
        # class (that would patch it for the whole process)
        target = self.stack[-2]
        if isinstance(target, type) or (type(target).__module__, type(target).__qualname__) not in _BUILDABLE:
            raise CheckpointError(f"{self.path}: refuses to set the state of a {type(target).__name__} (not unpickled)")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(folder: str) -> Any:
    """The ``Metadata`` of the DCP folder ``folder``, unpickled with the allowlist above."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt pickle raises many kinds
        raise CheckpointError(f"{path}: not a readable DCP metadata file: {type(exc).__name__}: {exc}") from exc
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored chunk of a tensor: ``offsets`` / ``sizes`` per dimension, and where its bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


class DcpFolder:
    """One DCP folder: its keys (by their path in the saved dict) and safe reads of their items."""

    def __init__(self, folder: str) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
        self.metadata = read_metadata(folder)
        md = self.metadata.state_dict_metadata
        self.paths: dict[tuple, str] = {}  # path in the saved dict -> flattened key
        for key in md:
            path = (self.metadata.planner_data or {}).get(key, tuple(key.split(".", 1)))
            self.paths[tuple(path)] = key
        self.tensors = {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        self.storage = self._storage()

    def _storage(self) -> dict[tuple, Any]:
        out = {}
        for index, info in (self.metadata.storage_data or {}).items():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
                raise CheckpointError(
                    f"{self.where(index.fqn)}: its data file {name!r} is outside the folder (refused)"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.where(index.fqn)} is stored with DCP extensions {list(info.transform_descriptors)} "
                    "(compression?), which zero_plugin does not read; save without them"
                )
            out[(index.fqn, tuple(index.offset or ()))] = info
        return out

    def where(self, key: str) -> str:
        return f"DCP key {key!r} of {self.folder}"

    def chunks(self, key: str) -> list[Chunk]:
        out = []
        for chunk in self.tensors[key].chunks:
            info = self.storage.get((key, tuple(chunk.offsets)))
            if info is None:
                raise CheckpointError(f"{self.where(key)}: the chunk at {tuple(chunk.offsets)} has no stored data")
            out.append(Chunk(tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path, info.offset, info.length))
        return out

    def read_chunk(self, key: str, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        value = self._load(key, chunk.file, chunk.start, chunk.length)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes or value.dtype != dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"{self.where(key)}: the chunk at {chunk.offsets} holds {got}, expected {chunk.sizes} {dtype}"
            )
        return value

    def read_value(self, key: str) -> Any:
        """A non-tensor item (a hyper-parameter, a list of names), unpickled as weights only."""
        info = self.storage.get((key, ()))
        if info is None:
            raise CheckpointError(f"{self.where(key)} has no stored data")
        return self._load(key, info.relative_path, info.offset, info.length)

    def _load(self, key: str, name: str, start: int, length: int) -> Any:
        path = os.path.join(self.folder, name)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{self.where(key)}: cannot read {path}: {exc}") from exc
        if len(data) != length:
            raise CheckpointError(f"{self.where(key)}: {path} ends before byte {start + length} (truncated?)")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds on bad input
            raise CheckpointError(f"{self.where(key)}: bytes {start}..{start + length} of {path}: {exc}") from exc


# -- which folders ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DcpLayout:
    """Where the model and optimizer state of one checkpoint are: ``kind`` ``dcp`` (one folder, keys under
    ``model`` and ``optim`` / ``optimizer``) or ``accelerate`` (``pytorch_model_fsdp_N/`` with ``model``,
    ``optimizer_N/`` with ``optimizer``); ``root`` is where a ``config.json`` may lie."""

    kind: str
    root: str
    model_dir: str
    optim_dir: str | None


def find_layout(path: str) -> DcpLayout | None:
    """The DCP checkpoint at ``path`` (a DCP folder, Accelerate's model folder, or the folder holding it), or
    None when ``path`` is none of these."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, METADATA)):
        found = _ACCELERATE_MODEL.match(os.path.basename(path))
        if found is None:
            return DcpLayout("dcp", path, path, path)
        return _accelerate(os.path.dirname(path), found.group(1))
    if os.path.isfile(os.path.join(path, "pytorch_model_fsdp_0", METADATA)):
        return _accelerate(path, "0")
    return None


def _accelerate(root: str, index: str) -> DcpLayout:
    optim = os.path.join(root, f"optimizer_{index}")
    has_optim = os.path.isfile(os.path.join(optim, METADATA))
    return DcpLayout(
        "accelerate", root, os.path.join(root, f"pytorch_model_fsdp_{index}"), optim if has_optim else None
    )
