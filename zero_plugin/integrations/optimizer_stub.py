"""A stub ``optimizer.pt`` that makes a plain (non-zero_plugin) loader fail loudly.

[Note: optimizer stub]
Under zero_plugin a Trainer checkpoint keeps its optimizer state sharded in ``checkpoint-N/zero_plugin/``.
A plain ``transformers.Trainer`` resuming that folder looks for ``optimizer.pt`` and ``scheduler.pt``; when
``optimizer.pt`` is absent it skips both without a word and trains on with a fresh optimizer and learning-rate
schedule.  Only the writing side can see the problem coming, so it leaves a file in the Trainer's path that
cannot be loaded, and whose loading fails with the message as the first line of the error.

The file is a pickle of ``torch.serialization._get_layout(message)``: one of the few functions torch's
``weights_only`` unpickler may call (it maps a layout's name, e.g. ``"torch.strided"``, to the layout, when
old checkpoints are read).  It raises ``KeyError(message)``, which ``torch.load`` does not rewrap (only an
``UnpicklingError`` gets torch's paragraph about ``weights_only`` put in front), so the Trainer's traceback
ends with ``KeyError: '<message>'``:

* ``torch.load(weights_only=True)`` (what the Trainer calls), ``torch.load(weights_only=False)`` and
  ``pickle.load`` all end there (``pickle.load`` needs torch importable, as the Trainer does).

Nothing in the file can run code beyond that lookup, which always fails (no layout is named like a message).
The message is one line (a ``KeyError`` prints it quoted).  Stubs written before (a ``GLOBAL`` whose name was
the message, quoted by torch only after its own paragraph) are still recognised.  zero_plugin's own loader
reads the sharded folder first and recognises a stub by its bytes.
"""

from __future__ import annotations

import os
import struct

__all__ = ["write_stub", "is_stub"]

# pickle protocol 2, GLOBAL torch.serialization._get_layout; then BINUNICODE message, TUPLE1, REDUCE, STOP
_PREFIX = b"\x80\x02ctorch.serialization\n_get_layout\n"
_EARLIER_PREFIX = b"\x80\x02czero_plugin\n"  # GLOBAL zero_plugin.<message>


def write_stub(path: str | os.PathLike, message: str) -> None:
    """Write the stub at ``path``; ``message`` (one line) is what a plain loader's error will say first."""
    if "\n" in message or "\r" in message:
        raise ValueError("zero_plugin optimizer stub: the message must be one line")
    text = message.encode("utf-8")
    with open(path, "wb") as f:
        f.write(_PREFIX + b"X" + struct.pack("<I", len(text)) + text + b"\x85R.")  # STOP never reached


def is_stub(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file written by :func:`write_stub` (or by an earlier version of it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_PREFIX))
    except OSError:
        return False
    return head.startswith(_PREFIX) or head.startswith(_EARLIER_PREFIX)
