"""A stub ``optimizer.pt`` that makes a plain (non-zero_plugin) loader fail loudly.

[Note: optimizer stub]
Under zero_plugin a Trainer checkpoint keeps its optimizer state sharded in ``checkpoint-N/zero_plugin/``.
A plain ``transformers.Trainer`` resuming that folder looks for ``optimizer.pt`` and ``scheduler.pt``; when
``optimizer.pt`` is absent it skips both without a word and trains on with a fresh optimizer and learning-rate
schedule.  Only the writing side can see the problem coming, so it leaves a file in the Trainer's path that
cannot be loaded: a two-opcode pickle naming a global in module ``zero_plugin`` whose *name is the message*.

* ``torch.load(weights_only=True)`` (what the Trainer calls) refuses the global and quotes its name;
* ``torch.load(weights_only=False)`` / ``pickle.load`` look the name up and fail with ``AttributeError``
  quoting it (or ``No module named 'zero_plugin'`` where zero_plugin is not installed).

Nothing in the file can run code: unpickling stops at the lookup, which always fails (no module has an
attribute with spaces in its name).  The message is one line (pickle's ``GLOBAL`` opcode is line-based).
zero_plugin's own loader reads the sharded folder first and recognises the stub by its bytes.
"""

from __future__ import annotations

import os

__all__ = ["write_stub", "is_stub"]

_PREFIX = b"\x80\x02czero_plugin\n"  # pickle protocol 2, GLOBAL opcode, module name


def write_stub(path: str | os.PathLike, message: str) -> None:
    """Write the stub at ``path``; ``message`` (one line) is what a plain loader's error will quote."""
    if "\n" in message or "\r" in message:
        raise ValueError("zero_plugin optimizer stub: the message must be one line")
    with open(path, "wb") as f:
        f.write(_PREFIX + message.encode("utf-8") + b"\n.")  # '.' = STOP (never reached)


def is_stub(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file written by :func:`write_stub`."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_PREFIX)) == _PREFIX
    except OSError:
        return False
