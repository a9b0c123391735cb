"""Replay one fuzz spec: ``python -m tests.fuzz.replay 'SPEC_JSON'`` (or a file holding it, or ``-`` for stdin).

Prints OK, or the failure (the spec, what differed, and each failing rank's traceback); exit status 1 on failure.
"""

from __future__ import annotations

import os
import sys

from tests.fuzz.check import FuzzFailure, close_pools, run_spec
from tests.fuzz.spec import from_json


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    arg = argv[0]
    text = sys.stdin.read() if arg == "-" else open(arg).read() if os.path.isfile(arg) else arg
    text = text.strip()
    if text.startswith("SPEC "):
        text = text[len("SPEC ") :]
    try:
        run_spec(from_json(text))
    except FuzzFailure as exc:
        print(exc)
        return 1
    finally:
        close_pools()
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
