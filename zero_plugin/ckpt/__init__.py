"""Sharded checkpoints: the pieces behind ``zp.save_checkpoint`` / ``zp.load_checkpoint``.

``format.py`` (files on disk), ``tree.py`` (JSON values with tensors beside them),
``regions.py`` (which flat region of each parameter this rank owns, per stage),
``verify.py`` (manifest, sizes, sha256 and index checks before a checkpoint is read),
``save.py`` and ``load.py`` (the two collective verbs), ``rng.py`` (per-rank RNG),
``export_info.py`` and ``consolidate.py`` (offline export to safetensors / ``save_pretrained``).
The public entry points live in ``zero_plugin/checkpoint.py``.
"""

from .format import CheckpointError

__all__ = ["CheckpointError"]
