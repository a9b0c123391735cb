"""Greedy shrinking of a failing spec, without hypothesis: try one simplification at a time, keep it when the
spec still fails the same way, until none applies. Used by ``explore.py --minimize``; far fewer runs than
hypothesis' shrinker needs through a process pool, and every candidate stays a valid spec."""

from __future__ import annotations

import copy
import re
from typing import Callable, Iterator

from tests.fuzz.model import SKIP, USE


def minimize(spec: dict, fails: Callable[[dict], bool], max_runs: int = 400) -> dict:
    runs = 0
    improved = True
    while improved and runs < max_runs:
        improved = False
        for candidate in _candidates(spec):
            candidate = _normalise(candidate)
            if candidate == spec:
                continue
            runs += 1
            if fails(candidate):
                spec, improved = candidate, True
                break
            if runs >= max_runs:
                break
    return spec


def _normalise(spec: dict) -> dict:
    """Restore the schedule rules after an edit: a clip or step follows a synced micro-batch."""
    last_micro = None
    for op in spec["schedule"]:
        if op[0] == "micro":
            last_micro = op
        elif op[0] in ("clip", "step") and last_micro is not None:
            last_micro[1]["sync"] = True
    return spec


def _edit(spec: dict, fn) -> dict:
    out = copy.deepcopy(spec)
    fn(out)
    return out


def _candidates(spec: dict) -> Iterator[dict]:
    yield from _schedule_edits(spec)
    yield from _model_edits(spec)
    yield from _config_edits(spec)


def _schedule_edits(spec: dict) -> Iterator[dict]:
    sched = spec["schedule"]
    for i, op in enumerate(sched):
        follows_step = i > 0 and sched[i - 1][0] == "step"
        if op[0] != "zero_grad" or not follows_step or i == len(sched) - 1:
            yield _edit(spec, lambda s, i=i: s["schedule"].pop(i))
    if spec["world_size"] > 1:

        def drop_rank(s):
            s["world_size"] -= 1
            for op in s["schedule"]:
                if op[0] in ("micro", "forward"):
                    op[1]["usage"].pop()

        yield _edit(spec, drop_rank)
    for i, op in enumerate(sched):
        if op[0] != "micro":
            continue
        yield _edit(spec, lambda s, i=i: s["schedule"][i][1].update(sync=True))
        yield _edit(spec, lambda s, i=i: s["schedule"][i][1].update(scale=1.0))
        for r, row in enumerate(op[1]["usage"]):
            for b, use in enumerate(row):
                if use != USE:
                    # Stage 3: every rank calls the same blocks, so a skipped block is called on all at once.
                    ranks = range(len(op[1]["usage"])) if use == SKIP and spec["stage"] == 3 else [r]
                    yield _edit(spec, lambda s, i=i, ranks=ranks, b=b: _use(s["schedule"][i][1]["usage"], ranks, b))


def _use(usage: list, ranks, b: int) -> None:
    for r in ranks:
        usage[r][b] = USE


def _model_edits(spec: dict) -> Iterator[dict]:
    m = spec["model"]
    for b in reversed(range(len(m["widths"]))):
        if len(m["widths"]) > 1 and b not in [t for t in m["tie_to"] if t is not None]:
            yield _edit(spec, lambda s, b=b: _drop_block(s, b))
    for j, t in enumerate(m["tie_to"]):
        if t is not None:
            yield _edit(spec, lambda s, j=j: s["model"]["tie_to"].__setitem__(j, None))
    for name in m["frozen"]:
        yield _edit(spec, lambda s, name=name: s["model"]["frozen"].remove(name))
    for b, w in enumerate(m["widths"]):
        if m["tie_to"][b] is None:
            for smaller in sorted({1, max(1, w - 1)}):
                if smaller < w:
                    yield _edit(spec, lambda s, b=b, v=smaller: _set_width(s, b, v))
    for key in ("d_in", "d_out", "batch"):
        if m[key] > 1:
            yield _edit(spec, lambda s, key=key: s["model"].__setitem__(key, 1))
    if m["bias"]:

        def no_bias(s):
            s["model"]["bias"] = False
            s["model"]["frozen"] = [n for n in s["model"]["frozen"] if not n.endswith(".bias")]

        yield _edit(spec, no_bias)


def _drop_block(s: dict, b: int) -> None:
    m = s["model"]
    m["widths"].pop(b)
    m["tie_to"].pop(b)
    m["tie_to"] = [None if t is None else t - (t > b) for t in m["tie_to"]]

    def rename(name: str) -> str | None:
        hit = re.match(r"blocks\.(\d+)\.(.*)", name)
        if not hit:
            return name
        k = int(hit.group(1))
        return None if k == b else f"blocks.{k - (k > b)}.{hit.group(2)}"

    m["frozen"] = [n for n in map(rename, m["frozen"]) if n is not None]
    for op in s["schedule"]:
        if op[0] in ("micro", "forward"):
            for row in op[1]["usage"]:
                row.pop(b)


def _set_width(s: dict, b: int, width: int) -> None:
    m = s["model"]
    for j, t in enumerate(m["tie_to"]):
        if j == b or t == b:
            m["widths"][j] = width


def _config_edits(spec: dict) -> Iterator[dict]:
    simpler = {"buffered": False, "offload": False, "precision": "fp64", "bucket_size_mb": 25.0, "seed": 0}
    for key, value in simpler.items():
        if spec[key] != value:
            yield _edit(spec, lambda s, key=key, value=value: s.__setitem__(key, value))
    if spec["precision"] == "bf16_reduce_fp32":
        yield _edit(spec, lambda s: s.__setitem__("precision", "bf16"))
    plain = {"kind": "sgd", "lr": 0.2, "momentum": 0.0, "weight_decay": 0.0, "two_groups": False}
    for key, value in plain.items():
        if spec["optimizer"][key] != value:
            yield _edit(spec, lambda s, key=key, value=value: s["optimizer"].__setitem__(key, value))
    for key, value in {"prefetch_depth": 1, "reshard_after_forward": True, "persistence_threshold": 0}.items():
        if spec["stage3"][key] != value:
            yield _edit(spec, lambda s, key=key, value=value: s["stage3"].__setitem__(key, value))
    if spec["stage3"].get("secondary_shard_size") is not None:
        yield _edit(spec, lambda s: s["stage3"].update(secondary_shard_size=None))
    elif spec["stage"] > 0:  # a lower stage allows every usage pattern a higher one does
        yield _edit(spec, lambda s: s.update(stage=s["stage"] - 1, offload=s["offload"] and s["stage"] > 1))
