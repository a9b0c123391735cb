"""Python values (``extra``, hyper-parameters, RNG states) as JSON, tensors set aside.

JSON keeps dicts with string keys, lists, str, int, float, bool and None.  What
JSON cannot say is tagged: ``{"__tuple__": [...]}``, ``{"__dict__": [[k, v], ...]}``
(non-string keys), ``{"__tensor__": key}`` (the tensor goes into a safetensors
file under ``key``), ``{"__ndarray__": key}`` and ``{"__np__": dtype, "value": v}``.
Anything else is refused at save time, so loading never needs pickle.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .format import CheckpointError

__all__ = ["encode", "decode"]

_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__", "__np__")


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> Any:
    """JSON-able form of ``value``; tensors are added to ``tensors`` under ``prefix/<n>``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = value.detach().cpu()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value))
        return {"__ndarray__": key}
    if isinstance(value, np.generic):
        return {"__np__": value.dtype.str, "value": value.item()}
    if isinstance(value, torch.Size):
        value = tuple(value)
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: encode(v, tensors, prefix, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__dict__": [
                [encode(k, tensors, prefix, f"{where} key"), encode(v, tensors, prefix, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise CheckpointError(
        f"zp.save_checkpoint: {where} has type {type(value).__name__}; a checkpoint stores only JSON "
        "values (dict, list, str, int, float, bool, None), tuples, tensors and numpy arrays"
    )


def decode(value: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; ``tensor(key)`` fetches a stored tensor."""
    if isinstance(value, list):
        return [decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v, tensor) for v in value["__tuple__"])
    if "__dict__" in value:
        return {_hashable(decode(k, tensor)): decode(v, tensor) for k, v in value["__dict__"]}
    if "__tensor__" in value:
        return tensor(value["__tensor__"])
    if "__ndarray__" in value:
        return tensor(value["__ndarray__"]).numpy()
    if "__np__" in value:
        return np.dtype(value["__np__"]).type(value["value"])
    return {k: decode(v, tensor) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def tensor_keys(value: Any) -> list[str]:
    """Every tensor key an encoded value refers to."""
    if isinstance(value, list):
        return [k for v in value for k in tensor_keys(v)]
    if not isinstance(value, dict):
        return []
    if "__tensor__" in value:
        return [value["__tensor__"]]
    if "__ndarray__" in value:
        return [value["__ndarray__"]]
    return [k for v in value.values() for k in tensor_keys(v)]
