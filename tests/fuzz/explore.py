"""Long fuzz run that keeps going after failures and groups them: ``python -m tests.fuzz.explore``.

    python -m tests.fuzz.explore --examples 300 --seed 1 [--minimize] [--out failures.jsonl]
    python -m tests.fuzz.explore --stages 0,1,2 --precisions fp64 --even   # look past a known bug

Draws ``--examples`` specs from ``spec.specs()`` (``--seed`` fixes the draw), runs each against the
reference, and prints one line per distinct failure signature (the error with its numbers blanked):
how often it occurred and the smallest spec that showed it. ``--minimize`` then shrinks each of those
specs greedily (``minimize.py``) while the signature stays the same. ``--out`` writes every failure as
a JSON line {"signature", "spec", "detail"}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz.check import FuzzFailure, close_pools, run_spec
from tests.fuzz.spec import specs, to_json


def signature(failure: FuzzFailure) -> str:
    """The failure's kind with numbers and parameter names blanked, so that one bug gives one signature."""
    text = re.sub(r"'[\w.]+'", "'P'", failure.kind)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return text


def failure_of(spec: dict) -> FuzzFailure | None:
    try:
        run_spec(spec)
    except FuzzFailure as exc:
        return exc
    return None


def explore(examples: int, seed: int, narrow: dict, out=None) -> dict[str, list[FuzzFailure]]:
    found: dict[str, list[FuzzFailure]] = {}
    count, passed_s = [0], []

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(spec=specs(**narrow))
    def one(spec):
        count[0] += 1
        start = time.monotonic()
        exc = failure_of(spec)
        if exc is None:
            passed_s.append(time.monotonic() - start)
            return
        sig = signature(exc)
        found.setdefault(sig, []).append(exc)
        print(f"[{count[0]}] {sig}", flush=True)
        if out is not None:
            out.write(json.dumps({"signature": sig, "spec": spec, "detail": exc.detail[-4000:]}) + "\n")
            out.flush()

    one()
    if passed_s:
        print(f"{len(passed_s)} passing specs took {sum(passed_s):.0f} s (max {max(passed_s):.1f} s)")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minimize", action="store_true")
    parser.add_argument("--out")
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    parser.add_argument("--stages", type=ints, help="e.g. 0,1 (default: all)")
    parser.add_argument("--world-sizes", type=ints, help="e.g. 2,3 (default: 1-4)")
    parser.add_argument("--precisions", type=lambda t: tuple(t.split(",")), help="fp64,bf16,bf16_reduce_fp32")
    parser.add_argument("--even", action="store_true", help="every rank uses every block")
    parser.add_argument("--no-frozen", action="store_true")
    parser.add_argument("--no-model-zero-grad", action="store_true", help="zero grads through the optimizer only")
    parser.add_argument("--no-drop", action="store_true", help="every accumulation ends in a step")
    parser.add_argument("--one-sync", action="store_true", help="only the last micro-batch of a step is synced")
    parser.add_argument("--no-forwards", action="store_true", help="no forward without backward")
    parser.add_argument("--no-writes", action="store_true", help="no weight writes between steps")
    args = parser.parse_args(argv)
    narrow = {
        k: v
        for k, v in {"stages": args.stages, "world_sizes": args.world_sizes, "precisions": args.precisions}.items()
        if v
    }
    narrow.update({"uneven": (False,)} if args.even else {})
    narrow.update({"frozen": (False,)} if args.no_frozen else {})
    narrow.update({"zero_grad": ("optimizer",)} if args.no_model_zero_grad else {})
    narrow.update({"drop_steps": False} if args.no_drop else {})
    narrow.update({"multi_sync": False} if args.one_sync else {})
    narrow.update({"forwards": False} if args.no_forwards else {})
    narrow.update({"writes": False} if args.no_writes else {})
    start = time.monotonic()
    out = open(args.out, "a") if args.out else None
    try:
        found = explore(args.examples, args.seed, narrow, out)
        print(f"\n{args.examples} specs in {time.monotonic() - start:.0f} s; {len(found)} distinct failure(s)")
        for sig, failures in sorted(found.items(), key=lambda kv: -len(kv[1])):
            smallest = min(failures, key=lambda f: len(to_json(f.spec)))
            spec = smallest.spec
            if args.minimize:
                from tests.fuzz.minimize import minimize

                spec = minimize(spec, lambda s, sig=sig: (f := failure_of(s)) is not None and signature(f) == sig)
            print(f"\n{len(failures)}x {sig}\nSPEC {to_json(spec)}")
    finally:
        close_pools()
        if out is not None:
            out.close()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
