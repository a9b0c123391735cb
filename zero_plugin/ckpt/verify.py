"""Checking a checkpoint directory before anything in it is used: manifest, sizes, sha256, index.

The same checks, in the same order, serve both readers: ``load.py`` runs each
step as one collective phase (and splits the hashing over the ranks), while
``consolidate.py`` runs them all in one process through :func:`read_checked_index`.
"""

from __future__ import annotations

import os

from . import format as fmt
from .index import check_index

__all__ = ["read_sized_manifest", "check_hashes", "read_index", "read_checked_index"]


def read_sized_manifest(path: str) -> dict[str, dict]:
    """The ``COMPLETE`` manifest, after checking that every file it lists is there with its recorded size."""
    files = fmt.read_manifest(path)
    fmt.check_sizes(path, files)
    return files


def check_hashes(path: str, files: dict[str, dict], names: list[str]) -> None:
    """Raise unless each of ``names`` hashes to its sha256 in the manifest ``files``."""
    for name in names:
        fmt.check_sha256(path, name, files[name]["sha256"])


def read_index(path: str, files: dict[str, dict]) -> dict:
    """``index.json``, structure-checked against the manifest ``files`` (not yet against any model)."""
    index = fmt.read_json(os.path.join(path, fmt.INDEX), "checkpoint index")
    check_index(index, files, path)
    return index


def read_checked_index(path: str, *, verify: bool = True) -> dict:
    """Every check above in one process, the sha256 of every file only with ``verify``; returns the index."""
    files = read_sized_manifest(path)
    if verify:
        check_hashes(path, files, sorted(files))
    return read_index(path, files)
